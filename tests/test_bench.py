"""The step benchmark (`launch/bench_train.py`) runs end to end on the CPU, every suite that
`launch/gpu_session.sh` runs, so a crash shows here rather than on lent device time; and what its
rows say."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import child_env, launch_script

from distca_jax.gate_profile import read_profile

ROOT = Path(__file__).resolve().parents[1]


def _bench(tmp_path, *args: str, tokens: int = 512) -> tuple[list[dict], str]:
  """bench_train.py in its own process (it turns on a compilation cache of its own) on two
  simulated devices: its JSON rows and its printed output. `args`: options, then overrides."""
  out = tmp_path / "bench.json"
  env = child_env(DISTCA_CPU_DEVICES="2")
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / "bench_train.py"), "--warmup", "0",
                         "--steps", "1", "--json", str(out), *args, f"data.tokens_per_device={tokens}"],
                        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "FAILED" not in proc.stdout, proc.stdout[-3000:]
  return json.loads(out.read_text()), proc.stdout


def test_cad_suite(tmp_path):
  """Colocated, distca and the WLB-LLM-style baseline on a skewed batch in one process: every row
  ran, the distca row reports the batch's own imbalance before scheduling (colocated's) and the
  streams it ran, the baseline re-packs without CAD, and every variant computes the same loss.
  (`--pingpong-ablation` adds a single-stream row, the same variant the pipeline suite's test
  runs as `pp2-distca-single`.)"""
  rows, _ = _bench(tmp_path, "--suite", "cad", "--batches=skewed", "mesh.data=2", "model.layers=1",
                   "attention.gate=false")  # skewed at 512 tokens: [512] + 4 x [128]
  assert {r["batch"] for r in rows} == {"skewed"}, rows
  for batch in ("skewed",):
    by = {r["variant"]: r for r in rows if r["batch"] == batch}
    assert set(by) == {"colocated", "distca", "wlb"}, batch
    colocated = by["colocated"]
    for name, r in by.items():
      if name == "colocated":
        continue
      if name == "wlb":  # documents re-packed, attention colocated
        assert r["cad_ran"] is False, name
      else:
        assert r["cad_ran"] and r["streams"] == 2, name
      assert r["imbalance"][0] == pytest.approx(colocated["imbalance"][0], rel=1e-9), name
      assert r["loss"] == pytest.approx(colocated["loss"], rel=1e-3), name


def test_pipeline_suite(tmp_path):
  """Two pipeline stages, colocated and distca attention (ping-pong per tick, and one stream):
  every row runs, the scheduler balanced the ticks, and every variant computes the same loss.
  The exchange is priced free: at this toy size the shipped profile's bytes outweigh any balance
  gain, and the tick planner rightly keeps a warm-up tick's attention on its active stage."""
  profile = tmp_path / "free.json"
  profile.write_text(json.dumps({**read_profile(), "exchange_fixed": 0.0, "machinery": 0.0,
                                 "exchange_flops_per_byte": 0.0}))
  rows, _ = _bench(tmp_path, "--suite", "pp", "--batches", "skewed", "--microbatches", "1",
                   "model.layers=2", f"attention.gate_profile={profile}")
  assert [r["variant"] for r in rows] == ["pp2-colocated", "pp2-distca", "pp2-distca-single"]
  for r in rows[1:]:
    assert r["imbalance"][1] < r["imbalance"][0], r["variant"]
    assert r["loss"] == pytest.approx(rows[0]["loss"], rel=1e-3), r["variant"]


def test_scheduler_bench_modes(capsys):
  """bench_scheduler.py's three modes on small sizes: the planner table, the trainer's host path
  per step (the gate off, so every batch takes the CAD path) and the exchange's pair usage."""
  bench = launch_script("bench_scheduler")
  bench.main(["--devices", "16", "--tokens", "16384", "--batches", "1", "--repeats", "1",
              "--arrays-devices", "4", "--dist", "prolong"])
  assert "make_plan with dispatch arrays, 4 devices x 16384 tokens" in capsys.readouterr().out
  bench.main(["--tokens", "16384", "--step-devices", "4", "--local-devices", "2",
              "--step-batches", "1"])
  out = capsys.readouterr().out.splitlines()  # pretrain's batch here the gate would run colocated
  assert [l.split("|")[1].strip() for l in out if l.startswith("| pretrain | 4 |")
          or l.startswith("| prolong | 4 |")] == ["pretrain", "prolong"]
  bench.main(["--tokens", "16384", "--pairs", "4", "--dist", "prolong"])
  rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| prolong | 4 |")]
  assert {l.split("|")[3].strip() for l in rows} == {"ping", "pong"}


def test_exchange_bench_table(capsys):
  """bench_exchange.py at 4 devices: a row per distribution, `ragged` carrying
  exactly the moving rows and `tiled` more, and the compiled exchanges' buffers per transport
  (the CPU's: tiled, query and K/V, alone and with the row gathers)."""
  bench = launch_script("bench_exchange")
  bench.main(["4", "--compile", "4", "--batches", "1", "--tokens", "8192"])
  out = capsys.readouterr().out.splitlines()
  rows = [[c.strip() for c in l.split("|")[1:-1]] for l in out if l.startswith("| 4 |")]
  carried, compiled = rows[:3], rows[3:]
  assert [r[1] for r in carried] == ["pretrain", "prolong", "short"]
  for r in carried:
    assert r[3] == r[6] == "1.00x (1.00x)"  # ragged: query and K/V
    assert float(r[4].split("x")[0]) > 1 and float(r[7].split("x")[0]) >= 1  # tiled pads
  assert [(r[1], r[2]) for r in compiled] == [(d, x) for d in ("pretrain", "prolong", "short")
                                              for x in ("Q", "K/V")]
  cell = lambda c: [float(v.strip().rstrip("x")) for v in c.split("/")]  # alone, with gathers
  for r in compiled:
    assert len(r) == 5
    # The tiled transport's blocks are every pair padded to the largest: more than the moving rows.
    assert cell(r[4])[0] > 1
  assert cell(compiled[0][4])[1] > 1  # Q tiled with its gathers


def test_exchange_bench_compiles_whole_steps():
  """The step compile of `bench_exchange.py --step-layers` (run for mocked GPU clusters) on 4 CPU
  devices: the state, batch and plans as shapes only, one compiled step per variant; CAD's steps
  take the dispatch plans as arguments besides colocated's. Off a mocked GPU the option is
  refused (the CPU's analysis does not size a GPU step)."""
  bench = launch_script("bench_exchange")
  got = bench._compiled_step_bytes(4, 1024, "pretrain", ("colocated", "distca:tiled"),
                                   "model.preset=tiny", "model.layers=1", "model.remat=full")
  assert set(got) == {"colocated", "distca:tiled"}
  assert all(temp > 0 for temp, _ in got.values())
  assert got["distca:tiled"][1] > got["colocated"][1]
  with pytest.raises(SystemExit):
    bench.main(["4", "--step-layers", "1"])


def test_bench_kernels_rounds(tmp_path):
  """bench_kernels.py on the CPU (the reference and Pallas backends; no cuDNN here, so no dense
  baseline): every backend's row of the batch, timed `--rounds` times, and the (q, kv) table."""
  env = child_env()
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / "bench_kernels.py"), "--backends",
                         "reference,pallas", "--contexts", "512", "--datasets", "prolong",
                         "--sweep", "128", "--sweep-area", "4e4", "--table-backend", "reference",
                         "--rounds", "2", "--heads", "2,1", "--head-dim", "16",
                         "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                        env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "FAILED" not in proc.stdout, proc.stdout[-3000:]
  rows = json.loads((tmp_path / "bench_kernels.json").read_text())["batches"]
  assert sorted((r["dataset"], r["backend"]) for r in rows) == [
      ("prolong", "pallas"), ("prolong", "reference")]
  # Timed, not compared: on a loaded CPU a forward can outlast a forward and backward.
  assert all(r["rounds"] == 2 and r["fwdbwd_ms"] > 0 and r["fwd_ms"] > 0 for r in rows), rows
  table, = (json.loads(p.read_text()) for p in tmp_path.glob("*.json")
            if p.name != "bench_kernels.json")
  assert table["q"] == [128] and table["fwdbwd_ms"][0][0] > 0


def test_bench_kernels_call_spans_and_views(capsys):
  """--gpu-time's pieces: the GPU span per call found from a trace's kernel intervals (calls
  parted at the widest gaps, overlapping kernels inside a call), and its table of views with
  ratios to the dense baseline by the same view."""
  from distca_jax.benchtools import call_spans
  bench_kernels = launch_script("bench_kernels")
  # Three calls: [0, 10) with a kernel [2, 12) overlapping; [100, 105) + [106, 110); [300, 301).
  intervals = [(106, 110), (0, 10), (300, 301), (2, 12), (100, 105)]
  assert call_spans(intervals, 3) == [12.0, 10.0, 1.0]
  assert call_spans(intervals, 1) == [301.0]
  assert call_spans(intervals[:2], 3) == []
  # One task of 256 queries over its 256-key prefix: 128 x 128 tiles visit 3 blocks (area
  # 3 * 128²) of a causal area 256 * 257 / 2.
  from distca_jax.kernels import causal_area, make_task_table
  tasks = make_task_table([0], [256], [0], [256], capacity=2)
  assert bench_kernels.tile_waste(tasks, 256, 128, 128) == pytest.approx(
      3 * 128 * 128 / (256 * 257 / 2))
  # The sweep's layouts: n tasks of q queries, each over kv key rows of its own (the table's
  # default) or all over the same ones; the same causal area either way.
  own, T, S, n = bench_kernels.sweep_layout(128, 512, target_area=2e5)
  shared, T2, S2, n2 = bench_kernels.sweep_layout(128, 512, target_area=2e5, own_kv=False)
  assert (T, S, n) == (T2, n * 512, n2) and S2 == 512 and n == 4
  assert np.asarray(own.kv_start)[:n].tolist() == [0, 512, 1024, 1536]
  assert np.asarray(shared.kv_start)[:n].tolist() == [0] * n
  assert float(causal_area(own).sum()) == float(causal_area(shared).sum())
  gpu = {"ours": {"queued": (1.0, 4.0), "span": (1.0, 2.0), "busy": (0.5, 2.0)},
         "dense": {"queued": (1.0, 2.0), "span": (1.0, 2.0), "busy": (0.5, 1.0)}}
  bench_kernels.print_views("b", gpu, {"ours": 1e9, "dense": 2e9},
                            {"ours": (1.0, 4.0), "dense": (1.0, 4.0)})
  out = capsys.readouterr().out.splitlines()
  ours, = (l for l in out if l.strip().startswith("ours"))
  # f+b ratio to dense by view: wall (1/4)/(2/4), queued (1/4)/(2/2), span (1/2)/(2/2), busy (1/2)/(2/1)
  assert [c for c in ours.split() if c.endswith("x")] == ["0.50x", "0.25x", "0.50x", "0.25x"]


def test_bench_kernels_geometry(monkeypatch):
  """--geometry: per batch, rows against the equal-area dense length and the tiles' area over
  the causal area; one document of the dense length is its own dense equivalent, and many short
  documents of the same total rows have a shorter dense length and more tile area."""
  bench_kernels = launch_script("bench_kernels")
  from distca_jax.kernels import make_task_table

  def batch(lens):
    return (lens, *bench_kernels.doc_layout(lens, 8192))

  monkeypatch.setattr(bench_kernels, "sampled_batch",
                      lambda ds, ctx, max_shard: batch([ctx] if ds == "one" else [ctx // 8] * 8))
  (one, short) = bench_kernels.geometry(["one", "short"], [2048], 8192)
  assert one[:5] == ("one 2K", 1, 2048, 2048, 1.0)
  assert one[6] == pytest.approx(one[7]) and one[6] > 1  # 64 x 128 tiles: the dense sequence's
  dense = make_task_table([0], [2048], [0], [2048], num_q_rows=2048, num_kv_rows=2048)
  assert one[7] == bench_kernels.tile_waste(dense, 2048, 64, 128)
  name, n, T, Td, ratio, fwd, bwd, dense_bwd = short
  assert (n, T) == (8, 2048) and Td == 768 and ratio == pytest.approx(2048 / 768)
  # Each 256-row document: its four 64-row tiles visit 1, 1, 2, 2 key blocks of 128.
  assert bwd == pytest.approx(6 * 64 * 128 / (256 * 257 / 2)) and bwd > dense_bwd and fwd >= bwd


def test_ab_mosaic_versions():
  """ab_mosaic.py's NAME=VERSION arguments: the package's kernels, or another version's kernels
  folder imported as a package of its own (its relative imports resolve inside it); anything
  else is an error before anything runs."""
  ab_mosaic = launch_script("ab_mosaic")
  from distca_jax.kernels import mosaic
  assert callable(ab_mosaic.load_version("now", ""))
  assert callable(ab_mosaic.load_version("old", f"@{ROOT / 'kernels'}"))
  old = sys.modules["_ab_old.mosaic"]
  assert old is not mosaic and old.forward is not mosaic.forward
  assert sys.modules["_ab_old.mosaic_bwd"].__file__ == str(ROOT / "kernels" / "mosaic_bwd.py")
  for bad in ("stages=3", f"@{ROOT / 'kernels' / 'mosaic.py'}"):
    with pytest.raises(ValueError, match="kernels folder"):
      ab_mosaic.load_version("bad", bad)


def test_ab_mosaic_trace_plumbing():
  """ab_mosaic.py --trace's table: a profiler trace of forward+backward calls is written, found
  and read (on the CPU there are no GPU kernels in it, so the table is empty)."""
  import jax.numpy as jnp
  from distca_jax.benchtools import timer
  ab_mosaic = launch_script("ab_mosaic")
  q = jnp.ones((8, 2, 4))
  run = timer(lambda q, k, v, t: q * k * v * t, q, q, q, q, jnp.float32(2.0))
  out = ab_mosaic.kernel_table("cpu", run)
  assert out.splitlines() == ["cpu: GPU kernels 0.00 ms per forward+backward call"]


def test_compile_profile(tmp_path):
  """compile_profile.py on the CPU: its summary line, and its trace summed by event name with
  XLA's compile among the events and no Python frames."""
  env = child_env(DISTCA_CPU_DEVICES="1")
  proc = subprocess.run(
      [sys.executable, str(ROOT / "launch" / "compile_profile.py"), "--trace", str(tmp_path),
       "--top", "200", "model.preset=tiny", "model.layers=1", "attention.kernel=reference",
       "data.tokens_per_device=512"],
      capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  summary, *events = proc.stdout.splitlines()
  assert "compile" in summary and "custom calls 0" in summary, summary
  assert "distinct mosaic kernels 0" in summary, summary
  names = [line.split(maxsplit=2)[2] for line in events]
  assert any("Compile" in n for n in names), names[:20]
  assert not any(n.startswith("$") for n in names)


def test_ncu_stalls_summary(tmp_path):
  """ncu_stalls.py on a SASS CSV as `ncu --page source --csv --print-source sass` writes it: the
  samples' share per stall reason (a reason the CSV has no column for counts as "other"), per
  execution count (the warp roles of a warp-specialised kernel), and the hottest instructions in
  program order with their top reasons."""
  cols = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed", "stall_barrier",
          "stall_long_sb", "stall_barrier (Not Issued)"]
  rows = [["0x0", "LDG.E R2, [R4]", "10", "0", "100", "0", "10", "0"],
          ["0x10", "BAR.SYNC R0, 0x80", "30", "0", "400", "30", "0", "30"],
          ["0x20", "WARPGROUP.ARRIVE", "60", "0", "400", "0", "0", "0"],
          ["0x30", "EXIT", "0", "0", "4", "0", "0", "0"]]
  text = '"Kernel Name","k",\n' + "\n".join(",".join(f'"{c}"' for c in r) for r in [cols] + rows)
  (tmp_path / "k.csv").write_text(text + "\n")
  out = launch_script("ncu_stalls").summary(str(tmp_path / "k.csv"), top=3)
  assert out.startswith("4 instructions, 100 warp-stall samples")
  reasons = [l for l in out.splitlines() if l.startswith("| ") and l.endswith("% |")][:3]
  assert reasons == ["| other | 60.0% |", "| barrier | 30.0% |", "| long_sb | 10.0% |"]
  assert "| 400 | 90.0% |" in out and "| 100 | 10.0% |" in out
  hot = out.split("top reasons |\n|---|---|---|---|---|\n")[1].splitlines()
  assert [l.split(" | ")[0] for l in hot] == ["| 0", "| 1", "| 2"]  # program order
  assert hot[2].endswith("| other 100% |") and hot[1].endswith("| barrier 100% |")
