"""Baselines and the simulator: conservation laws, the systems' known properties, the CLI."""

import csv
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from distca_jax.config import ConfigError
from distca_jax.data.doclens import LengthSampler, load_lengths
from distca_jax.data.packing import pack
from distca_jax.models.presets import PRESETS
from distca_jax.schedule.baselines import colocated, per_document_cp, wlb_packing
from distca_jax.schedule.cost import AnalyticKernel, CommModel, range_area
from distca_jax.schedule.pingpong import pingpong_layouts
from distca_jax.schedule.planner import balance
from distca_jax.schedule.relay import AUTO_FANOUT
from distca_jax.schedule.wlb import wlb_pack
from distca_jax.sim.config import load_sim_config
from distca_jax.sim.engine import Point, Simulator
from helpers import launch_script

COMM = CommModel.for_model(PRESETS["llama3_8b"], tensor_parallel=8)
ROOT = Path(__file__).resolve().parent.parent
N, T = 16, 131072


@pytest.fixture(scope="module")
def lens():
  return LengthSampler(load_lengths("pretrain")).sample(N * T, 0)


def test_colocated_matches_the_planners_starting_point(lens):
  layout = pack(lens, N, T)
  col = colocated(layout, COMM)
  _, stats = balance(layout, COMM, 0.05)
  assert np.allclose(col.area, stats.load_before)
  assert col.memory_imbalance == 1.0
  assert np.isclose(col.area.sum(), range_area(0, lens).sum())


@pytest.mark.parametrize("cp", [1, 2, 4, 16])
def test_wlb_conserves_work_and_respects_the_token_cap(lens, cp):
  out = wlb_packing(lens, N, T, COMM, cp=cp, token_cap=1.5)
  assert np.isclose(out.area.sum(), range_area(0, lens).sum())
  assert np.isclose(out.tokens.sum(), lens.sum())
  assert out.tokens.max() <= 1.5 * T + 1e-6
  if cp == 1:
    assert out.send.sum() == 0  # whole documents, no KV exchange
  else:  # a group all-gathers its K/V exactly when it holds a document split over its ranks
    gathers = np.repeat(wlb_pack(lens, N, T, cp=cp, token_cap=1.5).exchanging_groups(), cp)
    assert gathers.any() and (out.recv[gathers] > 0).all() and (out.recv[~gathers] == 0).all()


def test_wlb_trades_memory_for_compute(lens):
  layout = pack(lens, N, T)
  col = colocated(layout, COMM)
  wlb = wlb_packing(lens, N, T, COMM, cp=4, token_cap=1.5)
  assert wlb.compute_imbalance < col.compute_imbalance
  assert wlb.memory_imbalance > col.memory_imbalance
  pdc = per_document_cp(lens, N, T, COMM)
  assert pdc.compute_imbalance == pytest.approx(1.0) and pdc.memory_imbalance == pytest.approx(1.0)
  # All-gathering every document's KV: each rank receives (N-1)/N of all the batch's KV rows.
  assert pdc.recv.max() == pytest.approx((N - 1) / N * lens.sum() * COMM.kv_row_bytes)


def test_baseline_errors():
  with pytest.raises(ValueError, match="divide"):
    wlb_packing([10, 20], 4, 16, COMM, cp=3)
  with pytest.raises(ValueError, match=">= 1"):
    wlb_packing([10, -2], 4, 16, COMM)


def test_config_overrides_and_errors(tmp_path):
  cfg = load_sim_config(None, ["gpus=[8,16]", "epsilon=0.1", "hardware.network_gbps=25"])
  assert cfg.gpus == (8, 16) and cfg.epsilon == 0.1 and cfg.hardware.network_gbps == 25.0
  assert load_sim_config(None, ["gpus=64"]).gpus == (64,)
  with pytest.raises(ConfigError, match="gpus"):
    load_sim_config(None, ["gpus=[12]"])
  with pytest.raises(ConfigError, match="hardware.bogus"):
    load_sim_config(None, ["hardware.bogus=1"])
  with pytest.raises(ConfigError, match="models"):
    load_sim_config(None, ["models=[gpt5]"])
  paths = sorted((ROOT / "configs").glob("sim_*.yaml"))
  assert paths
  for path in paths:
    load_sim_config(path)


def test_simulator_pingpong_costs_bytes_not_balance():
  base = ["gpus=[64]", "batches=1", "kv_relay_fanout=0"]  # the direct exchange's pieces
  one = Simulator(load_sim_config(None, base + ["pingpong=false"]), Point("llama3_8b", 64, 131072, "pretrain"))
  two = Simulator(load_sim_config(None, base), Point("llama3_8b", 64, 131072, "pretrain"))
  r1, r2 = one.batch(0)[0]["cad"], two.batch(0)[0]["cad"]
  assert r1.memory_imbalance == r2.memory_imbalance == 1.0
  assert r2.compute_imbalance <= 1.05 and r1.compute_imbalance <= 1.05
  # Two plans move two sets of pieces: more bytes, all hidden at this scale.
  assert r2.bytes_per_layer > r1.bytes_per_layer and r2.hidden


def test_min_imbalance_gate_runs_colocated():
  """Gate above the batch's imbalance: CAD's result is colocated's; a ratio below 1 is refused."""
  base = ["gpus=[64]", "batches=1"]
  point = Point("llama3_8b", 64, 131072, "pretrain")
  free = Simulator(load_sim_config(None, base), point).batch(0)[0]
  gated = Simulator(load_sim_config(None, base + ["min_imbalance=100"]), point).batch(0)[0]
  assert free["cad"].shards_max > 0 and free["cad"].iter_s != free["colocated"].iter_s
  assert gated["cad"] == dataclasses.replace(gated["colocated"], name="cad")
  with pytest.raises(ConfigError, match="min_imbalance"):
    load_sim_config(None, ["min_imbalance=0.5"])


def test_cad_cost_terms_slow_cad_only():
  """The calibration terms add to CAD's step exactly their fixed share of the linear time plus
  their ms per GB of the rows that move, per layer on the slowest rank; the baselines do not
  change; negative values are refused."""
  base = ["gpus=[8]", "tensor_parallel=1", "tokens_per_rank=[65536]", "layers=2",
          "distributions=[prolong]"]
  point = Point("llama3_8b", 8, 65536, "prolong")
  ideal = Simulator(load_sim_config(None, base), point).batch(1)[0]
  fixed = Simulator(load_sim_config(None, base + ["cad_machinery=0.04", "cad_exchange_fixed=0.06"]),
                    point).batch(1)[0]
  per_gb = Simulator(load_sim_config(None, base + ["cad_ms_per_gb=50"]), point).batch(1)[0]
  for name in ("colocated", "wlb", "per_doc_cp"):
    assert fixed[name].iter_s == ideal[name].iter_s == per_gb[name].iter_s
  assert ideal["cad"].iter_s < per_gb["cad"].iter_s
  # Every rank holds the same tokens, so the fixed term adds 10% of one rank's linear time.
  sim = Simulator(load_sim_config(None, base), point)
  lin_s = 65536 * sim.lin_ms_per_token * sim.shape.layers / 1e3
  assert fixed["cad"].iter_s - ideal["cad"].iter_s == pytest.approx(0.1 * lin_s, rel=0.05)
  for bad in ("cad_machinery=-0.1", "cad_exchange_fixed=-0.1", "cad_ms_per_gb=-1"):
    with pytest.raises(ConfigError, match=bad.split("=")[0]):
      load_sim_config(None, [bad])
  with pytest.raises(ConfigError, match="cad_fixed_overhead: removed; split into cad_machinery"):
    load_sim_config(None, ["cad_fixed_overhead=0.02"])


def test_gate_keeps_the_faster_of_cad_and_colocated():
  """gate=true: a batch CAD would run slower than colocated runs colocated; the others are
  CAD's result unchanged."""
  base = ["gpus=[4]", "tensor_parallel=1", "tokens_per_rank=[65536]", "layers=2",
          "distributions=[pretrain]", "elongate_factor=1", "cad_machinery=0.01", "cad_exchange_fixed=0.01",
          "cad_ms_per_gb=7"]  # a 4-GPU fit's total: batches 0 and 1 lose with CAD
  point = Point("llama3_8b", 4, 65536, "pretrain")
  free, gated = (Simulator(load_sim_config(None, base + extra), point)
                 for extra in ([], ["gate=true"]))
  lost = won = 0
  for step in range(6):
    f, g = free.batch(step)[0], gated.batch(step)[0]
    if f["cad"].iter_s > f["colocated"].iter_s:
      assert g["cad"] == dataclasses.replace(g["colocated"], name="cad")
      lost += 1
    else:
      assert g["cad"] == f["cad"]
      won += 1
  assert lost and won, (lost, won)


def test_layers_override():
  """layers=2: the preset with two decoder layers; the LM head's share of a layer grows, so the
  step is more than 2/32 of the 32-layer one and CAD's gain on an imbalanced batch is smaller."""
  base = ["gpus=[8]", "tensor_parallel=1", "batches=1", "tokens_per_rank=[65536]",
          "distributions=[prolong]"]
  point = Point("llama3_8b", 8, 65536, "prolong")
  full = Simulator(load_sim_config(None, base), point)
  short = Simulator(load_sim_config(None, base + ["layers=2"]), point)
  assert short.shape.layers == 2 and full.shape.layers == PRESETS["llama3_8b"].layers
  f, s = full.batch(0)[0], short.batch(0)[0]
  assert s["colocated"].iter_s > f["colocated"].iter_s * 2 / full.shape.layers
  gain = lambda r: r["colocated"].iter_s / r["cad"].iter_s
  assert 1 < gain(s) < gain(f)
  with pytest.raises(ConfigError, match="layers"):
    load_sim_config(None, ["layers=-1"])
  with pytest.raises(ConfigError, match="must divide the 2 layers"):
    load_sim_config(None, ["layers=2", "pipeline_parallel=[4]"])


def test_one_rank_cad_equals_colocated(tmp_path):
  # One rank: nothing to balance, and the ping-pong cut must not make attention cheaper.
  path = tmp_path / "lens.json"
  path.write_text(json.dumps([1000, 5000, 300, 70000, 12000] * 20))
  cfg = load_sim_config(None, ["gpus=[8]", "batches=1", f"distributions=[{path}]"])
  res, _ = Simulator(cfg, Point("llama3_8b", 8, 131072, str(path))).batch(0)
  assert res["cad"].iter_s == pytest.approx(res["colocated"].iter_s, rel=2e-3)


def test_simulator_charges_a_cut_document_whole(tmp_path):
  """A document longer than half the batch is cut between Ping and Pong; Pong's plan reads the
  prefix's K/V rows, so the two plans' scheduled attention is the batch's whole causal area (the
  suffix skips nothing), as one plan's is. As in training, such a batch runs whichever of the
  two the model predicts faster."""
  path = tmp_path / "lens.json"
  path.write_text(json.dumps([5 * 131072] + [2000] * 200))  # one document of 5 of 8 ranks' tokens
  base = ["gpus=[8]", "tensor_parallel=1", "batches=1", f"distributions=[{path}]"]
  sim = Simulator(load_sim_config(None, base), Point("llama3_8b", 8, 131072, str(path)))
  lens = sim.sampler.sample(8 * 131072, 0)
  ping, pong, split = pingpong_layouts(lens, 8, 131072)
  assert split.cut is not None and lens[split.cut[0]] > 4 * 131072
  (two, two_after), (one, one_after) = (sim._cad_streams(h, 0, None)
                                        for h in ((ping, pong), (pack(lens, 8, 131072),)))
  total = float(np.sum(range_area(0, lens.astype(np.float64))))
  assert float(two_after.sum()) == pytest.approx(total, rel=1e-12)
  assert float(one_after.sum()) == pytest.approx(total, rel=1e-12)
  assert two.bytes_per_layer != one.bytes_per_layer
  assert one.iter_s < two.iter_s  # here one plan is the faster (what the next lines tell apart)
  res, _ = sim.batch(0)
  assert res["cad"].iter_s == one.iter_s
  two_only = Simulator(load_sim_config(None, base + ["pingpong_allow_single=false"]),
                       Point("llama3_8b", 8, 131072, str(path)))
  assert two_only.batch(0)[0]["cad"].iter_s == two.iter_s


def test_simulator_cad_beats_colocated_and_time_table_agrees(tmp_path):
  cfg = load_sim_config(None, ["gpus=[64]", "batches=1"])
  sim = Simulator(cfg, Point("llama3_8b", 64, 131072, "pretrain"))
  res, loads = sim.batch(0)
  assert res["cad"].compute_imbalance <= 1.05 + 1e-9
  assert res["cad"].iter_s < res["colocated"].iter_s
  assert res["cad"].memory_imbalance == 1.0
  assert loads["after"].max() < loads["before"].max()
  # The same kernel written as a profiled table (fine grid) gives nearly the same step times.
  heads, dim = PRESETS["llama3_8b"].heads, PRESETS["llama3_8b"].head_dim
  k = AnalyticKernel(heads=heads, head_dim=dim, tflops_fwd=300, tflops_fwdbwd=300)
  q = [128 * 2 ** i for i in range(11)]
  kv = q[:]
  grid_q, grid_kv = np.meshgrid(q, kv, indexing="ij")
  table = {"device": "analytic", "dtype": "bfloat16", "heads": heads, "kv_heads": 8,
           "head_dim": dim, "q": q, "kv": kv,
           "fwd_ms": k.fwd_ms(grid_q, np.maximum(grid_kv, grid_q)).tolist(),
           "fwdbwd_ms": k.fwdbwd_ms(grid_q, np.maximum(grid_kv, grid_q)).tolist()}
  path = tmp_path / "table.json"
  path.write_text(json.dumps(table))
  cfg2 = load_sim_config(None, ["gpus=[64]", "batches=1", f"hardware.time_table={path}"])
  res2, _ = Simulator(cfg2, Point("llama3_8b", 64, 131072, "pretrain")).batch(0)
  for name in ("cad", "colocated", "wlb"):
    assert res2[name].iter_s == pytest.approx(res[name].iter_s, rel=0.15)


def test_time_table_by_shipped_name_and_config_errors(tmp_path):
  """hardware.time_table takes a shipped table's name (what an installed package's user has) and
  simulates as with its path; an unknown name or a table of another head dim fails at load."""
  name = "NVIDIA_H200_mosaic"
  path = Path(__file__).parent.parent / "kernels" / "tables" / f"{name}.json"
  point = Point("llama3_8b", 64, 131072, "pretrain")
  by_name = Simulator(load_sim_config(None, ["gpus=[64]", "batches=1", f"hardware.time_table={name}"]),
                      point).batch(0)[0]
  by_path = Simulator(load_sim_config(None, ["gpus=[64]", "batches=1", f"hardware.time_table={path}"]),
                      point).batch(0)[0]
  analytic = Simulator(load_sim_config(None, ["gpus=[64]", "batches=1"]), point).batch(0)[0]
  for impl in ("cad", "colocated"):
    assert by_name[impl].iter_s == by_path[impl].iter_s != analytic[impl].iter_s
  with pytest.raises(ConfigError, match="hardware.time_table: .*neither a shipped table"):
    load_sim_config(None, ["hardware.time_table=NVIDIA_H100"])
  with pytest.raises(ConfigError, match="hardware.time_table: .*head dim 128; llama_1b has 64"):
    load_sim_config(None, ["models=[llama3_8b,llama_1b]", f"hardware.time_table={name}"])
  bad = tmp_path / "bad.json"
  bad.write_text("{")
  with pytest.raises(ConfigError, match="hardware.time_table: .*cannot read"):
    load_sim_config(None, [f"hardware.time_table={bad}"])


def test_cli_writes_table_csv_plots_and_plans(tmp_path, capsys):
  cli = launch_script("simulate")
  main = cli.main

  out, plans = tmp_path / "out", tmp_path / "plans"
  rc = main(["--config", str(ROOT / "configs" / "sim_quick.yaml"), f"out_dir={out}", "progress=false",
             "--dump-plans", str(plans), "--per-batch"])
  assert rc == 0
  text = capsys.readouterr().out
  assert "wlb_best" in text and "per_doc_cp" in text
  assert "pretrain@0: attention imbalance" in text  # --per-batch
  assert "by colocated attention imbalance" in text
  rows = list(csv.DictReader(open(out / "sim.csv")))
  assert {r["system"] for r in rows} == {"cad", "colocated", "wlb", "wlb_best", "per_doc_cp"}
  assert "exchange modelled as 'ragged'" in text and {r["exchange"] for r in rows} == {"ragged"}
  assert (out / "loads.png").stat().st_size > 0 and (out / "speedup.png").stat().st_size > 0
  dumped = sorted(plans.glob("*.json"))  # one plan per nano-batch
  assert [p.stem.rsplit("_", 1)[1] for p in dumped] == ["ping", "pong"]
  d = json.loads(dumped[0].read_text())
  assert d["format"] == "distca-plan-v1" and d["num_devices"] == 8 and d["buffer_len"] == 65536
  assert main(["gpus=[12]"]) == 2


def test_gate_table_bins_every_batch_once():
  cli = launch_script("simulate")
  pairs = [(1.05, 0.99), (1.15, 1.0), (1.12, 1.02), (1.45, 1.1), (4.0, 1.4)]
  lines = cli.gate_table(pairs, bins=(1.0, 1.1, 1.2, 2.0, float("inf")))
  assert lines[2:] == ["| 1.00-1.10 | 1 | 0.990 (0.990-0.990) |",
                       "| 1.10-1.20 | 2 | 1.010 (1.000-1.020) |",
                       "| 1.20-2.00 | 1 | 1.100 (1.100-1.100) |",
                       "| 2.00-inf | 1 | 1.400 (1.400-1.400) |"]


# ----------------------------------------------------------------------------- 4D (pipeline)

from distca_jax.sim.engine import points  # noqa: E402
from distca_jax.sim.pipeline import (PipelineSimulator, bubble_fraction, lockstep_schedule,  # noqa: E402
                                     make_simulator)


def _asdict(r):
  return dataclasses.asdict(r)


def test_pipeline_model_with_one_stage_and_one_microbatch_is_the_3d_model():
  # The expected values come from the 3D code path (Simulator.batch), not from stored numbers.
  cfg = load_sim_config(None, ["gpus=[32]", "tokens_per_rank=[32768]", "batches=1"])
  point = Point("llama3_8b", 32, 32768, "pretrain")
  assert type(make_simulator(cfg, point)) is Simulator  # the CLI keeps the 3D path at PP = 1
  three_d, four_d = Simulator(cfg, point), PipelineSimulator(cfg, point)
  assert four_d.bubble == 0.0 and four_d.microbatches == 1
  for step in (0, 1):
    want, want_loads = three_d.batch(step)
    got, got_loads = four_d.batch(step)
    assert set(got) == set(want)
    for name in want:
      w, g = _asdict(want[name]), _asdict(got[name])
      assert g.pop("idle_frac") == pytest.approx(w.pop("idle_frac"), abs=1e-12)
      assert g == w, name
    assert np.array_equal(got_loads["before"], want_loads["before"])
    assert np.array_equal(got_loads["after"], want_loads["after"])


def test_one_stage_with_microbatches_adds_up_3d_steps():
  # PP = 1, M = 2: two ticks of one micro-batch each; micro-batch k of step 0 is the 3D batch k.
  # WLB packs across micro-batches, so only the systems that work per micro-batch add up.
  cfg = load_sim_config(None, ["gpus=[32]", "tokens_per_rank=[32768]", "microbatches=2"])
  point = Point("llama3_8b", 32, 32768, "pretrain")
  got, _ = make_simulator(cfg, point).batch(0)
  three_d = Simulator(cfg, point)
  want = [three_d.batch(k)[0] for k in (0, 1)]
  for name in ("cad", "colocated", "per_doc_cp"):
    assert got[name].iter_s == pytest.approx(want[0][name].iter_s + want[1][name].iter_s, rel=1e-12)


@pytest.mark.parametrize("pp,m", [(1, 1), (2, 1), (2, 4), (4, 4), (4, 8), (3, 7), (8, 3)])
def test_lockstep_schedule_and_bubble_fraction(pp, m):
  fwd, bwd = lockstep_schedule(pp, m), lockstep_schedule(pp, m, backward=True)
  assert len(fwd) == len(bwd) == m + pp - 1
  assert bubble_fraction(pp, m) == pytest.approx((pp - 1) / (m + pp - 1))
  for k in range(m):  # forward: stage s at tick k + s; backward: the last stage first
    assert {s: t for t, tick in enumerate(fwd) for s, j in tick if j == k} == {s: k + s for s in range(pp)}
    assert ({s: t for t, tick in enumerate(bwd) for s, j in tick if j == k}
            == {s: k + pp - 1 - s for s in range(pp)})
  for f, b in zip(fwd, bwd):  # a forward tick and its backward tick hold the same micro-batches
    assert sorted(j for _, j in f) == sorted(j for _, j in b)
    assert len({s for s, _ in f}) == len(f)  # a stage runs one micro-batch per tick


class _Alternating:
  """Sampler stub: micro-batch k puts one 64K document on replica k % 2 and short ones elsewhere."""

  def sample(self, total, step):
    short = [512] * ((total - 65536) // 512)
    return np.asarray([65536] + short if step % 2 == 0 else short + [65536], np.int64)


def test_cad_tick_never_slower_than_colocated_and_idle_stages_serve_attention():
  # DP 2 x PP 2 x TP 8, 2 micro-batches: ticks are warm-up (stage 0 only), full, drain. In every
  # tick one replica holds a 64K document (attention ~2x its linear work) and the other only
  # 512-token ones, so balancing must help; in warm-up and drain it can only help as much as
  # this asserts if the idle stage computes part of the attention.
  cfg = load_sim_config(None, ["gpus=[32]", "pipeline_parallel=[2]", "microbatches=2",
                               "tokens_per_rank=[65536]"])
  sim = PipelineSimulator(cfg, Point("llama3_8b", 32, 65536, "pretrain", 2))
  sim.sampler = _Alternating()
  ticks = sim.ticks(0)
  assert [len(t["pairs"]) for t in ticks] == [1, 2, 1]
  for t in ticks:
    cad, col = t["results"]["cad"][0], t["results"]["colocated"][0]
    assert cad.iter_s <= col.iter_s
    assert col.compute_imbalance > 1.5 and cad.compute_imbalance < 1.1
  for k in (0, 2):  # warm-up and drain: the idle stage's ranks get attention work
    idle = slice(2, 4) if k == 0 else slice(0, 2)
    assert ticks[k]["before"][idle].sum() == 0 and ticks[k]["after"][idle].min() > 0
    assert ticks[k]["results"]["cad"][0].iter_s < 0.7 * ticks[k]["results"]["colocated"][0].iter_s
  step, _ = sim.batch(0)
  assert step["cad"].iter_s < min(step[s].iter_s for s in ("colocated", "wlb", "wlb_best", "per_doc_cp"))
  assert step["cad"].iter_s == pytest.approx(sum(t["results"]["cad"][0].iter_s for t in ticks))


def test_pipeline_config_errors_and_sweeps():
  with pytest.raises(ConfigError, match="pipeline_parallel: 3 must divide the 32 layers"):
    load_sim_config(None, ["pipeline_parallel=[3]"])
  with pytest.raises(ConfigError, match="pipeline_parallel: 0"):
    load_sim_config(None, ["pipeline_parallel=0"])
  with pytest.raises(ConfigError, match=r"gpus: 64 must be a positive multiple of tensor_parallel x"):
    load_sim_config(None, ["gpus=[64]", "pipeline_parallel=[16]"])
  with pytest.raises(ConfigError, match="microbatches"):
    load_sim_config(None, ["microbatches=-1"])
  with pytest.raises(ConfigError, match=r"sweeps\[0\].bogus: unknown field"):
    load_sim_config(None, ["sweeps=[{bogus: 1}]"])
  with pytest.raises(ConfigError, match=r"sweeps\[1\].pipeline_parallel: 5"):
    load_sim_config(None, ["sweeps=[{gpus: [64]}, {models: [llama_34b], pipeline_parallel: [5]}]"])
  with pytest.raises(ConfigError, match="sweeps: expected a list"):
    load_sim_config(None, ["sweeps=3"])
  cfg = load_sim_config(None, ["sweeps=[{gpus: [64, 128], pipeline_parallel: 2}, "
                               "{models: [llama_34b], gpus: [128], pipeline_parallel: [4]}]"])
  assert [(p.model, p.gpus, p.pipeline) for p in points(cfg)] == [
      ("llama3_8b", 64, 2), ("llama3_8b", 128, 2), ("llama_34b", 128, 4)]
  assert cfg.microbatches_for(1) == 1 and cfg.microbatches_for(4) == 8
  assert load_sim_config(None, ["microbatches=3"]).microbatches_for(4) == 3


def test_cli_4d_writes_pipeline_columns_and_tick_plans(tmp_path, capsys):
  cli = launch_script("simulate")
  out, plans = tmp_path / "out", tmp_path / "plans"
  rc = cli.main(["--config", str(ROOT / "configs" / "sim_quick_4d.yaml"), f"out_dir={out}",
                 "progress=false", "--dump-plans", str(plans)])
  assert rc == 0
  rows = list(csv.DictReader(open(out / "sim.csv")))
  assert {(r["pp"], r["microbatches"]) for r in rows} == {("2", "4")}
  assert all(float(r["bubble"]) == pytest.approx(0.2) for r in rows)
  cad = next(r for r in rows if r["system"] == "cad")
  assert float(cad["idle_frac"]) < 0.2  # idle stages serve attention: less idle than the bubble
  # One plan per tick (M + PP - 1 = 5) and nano-batch, each over all DP x PP = 8 ranks.
  dumped = sorted(plans.glob("*.json"))
  assert len(dumped) == 10 and all("_pp2_" in p.name for p in dumped)
  assert json.loads(dumped[0].read_text())["num_devices"] == 8


def test_tiled_exchange_pads_every_pair_to_the_largest(lens):
  """`traffic(tiled=True)`: every off-diagonal pair carries the capacity bucket of the largest
  pair, so no pair moves fewer bytes than the rows it really sends; no exchange if nothing moves."""
  from distca_jax.schedule.items import initial_tasks, row_bucket
  from distca_jax.schedule.traffic import traffic

  layout = pack(lens, N, T)
  tasks, _ = balance(layout, COMM, 0.05)
  real = traffic(tasks, layout, COMM, pairwise=True)
  tiled = traffic(tasks, layout, COMM, pairwise=True, tiled=True)
  off = ~np.eye(N, dtype=bool)
  assert (np.diagonal(tiled.pair_bytes) == 0).all()
  assert np.unique(tiled.pair_bytes[off]).size == 1
  assert (tiled.pair_bytes >= real.pair_bytes - 1e-6).all()
  assert tiled.send.sum() > 2 * real.send.sum()  # 16 ranks: mostly padding
  assert tiled.pair_bytes[0, 1] >= row_bucket(1, T) * (COMM.q_row_bytes + COMM.kv_row_bytes)
  equal = pack(np.full(8 * N, T // 8), N, T)  # no document spans two buffers: nothing moves
  nothing = traffic(initial_tasks(equal), equal, COMM, pairwise=True, tiled=True)
  assert not nothing.pair_bytes.any() and not nothing.send.any()


def test_simulator_tiled_exchange_costs_more_than_ragged():
  base = ["gpus=[64]", "batches=1"]
  point = Point("llama3_8b", 64, 131072, "pretrain")
  ragged = Simulator(load_sim_config(None, base), point).batch(0)[0]["cad"]
  tiled = Simulator(load_sim_config(None, base + ["exchange=tiled"]), point).batch(0)[0]["cad"]
  assert tiled.bytes_per_layer > 2 * ragged.bytes_per_layer
  assert tiled.comm_ms > ragged.comm_ms and tiled.iter_s >= ragged.iter_s
  with pytest.raises(ConfigError, match="exchange"):
    load_sim_config(None, ["exchange=padded"])


@pytest.mark.parametrize("fanout", [0, 16])
def test_exchanges_bytes_ordered_ragged_tiled(lens, fanout):
  """On a sampled batch, per (device, server) pair and round: ragged carries the rows that move
  (the planner's `traffic`), tiled pads every pair to the largest pair's, so ragged <= tiled
  pair by pair, and strictly in total."""
  from distca_jax.schedule.traffic import traffic
  from distca_jax.schedule.relay import Relay
  from distca_jax.schedule.transport import named
  from distca_jax.sim.transport import exchange_rounds

  layout = pack(lens, N, T)
  tasks, _ = balance(layout, COMM, 0.05)
  relay = Relay(fanout) if fanout else None
  by = {ex: exchange_rounds(tasks, layout, COMM, named(ex), relay) for ex in ("ragged", "tiled")}
  assert {len(r) for r, _ in by.values()} == {len(by["ragged"][0])}
  ragged, moved = by["ragged"]
  assert np.allclose(sum(ragged), traffic(tasks, layout, COMM, pairwise=True, relay=relay).pair_bytes)
  assert np.allclose(moved, sum(ragged))
  tiled = traffic(tasks, layout, COMM, pairwise=True, tiled=True, relay=relay).pair_bytes
  assert np.allclose(sum(by["tiled"][0]), tiled)
  for k in range(len(ragged)):
    assert (by["ragged"][0][k] <= by["tiled"][0][k] + 1e-6).all()
  total = {ex: sum(r).sum() for ex, (r, _) in by.items()}
  assert total["ragged"] < total["tiled"]
  assert np.allclose(by["tiled"][1], moved)  # the padded transport moves the same rows


def test_relay_lowers_the_busiest_devices_bytes_on_a_long_document():
  """A document over 12 of 32 ranks, balanced over many servers: without relays its holders send
  its K/V prefix to each; relayed, the busiest device's bytes drop, the bytes on the wire do not
  change, and the simulator charges the second round after the first."""
  from distca_jax.schedule.relay import Relay
  from distca_jax.schedule.transport import named
  from distca_jax.sim.transport import exchange_rounds

  n = 32
  lens = np.r_[[12 * T], np.full((n - 12) * T // 2048, 2048)]
  layout = pack(lens, n, T)
  tasks, _ = balance(layout, COMM, 0.05)
  busiest = lambda rounds: max(sum(rounds).sum(1).max(), sum(rounds).sum(0).max())
  for ex in ("ragged", "tiled"):
    direct, _ = exchange_rounds(tasks, layout, COMM, named(ex))
    relayed, moved = exchange_rounds(tasks, layout, COMM, named(ex), Relay(16))
    assert len(direct) == 1 and len(relayed) == 2
    if ex == "ragged":
      assert busiest(relayed) < 0.6 * busiest(direct)
      assert np.isclose(sum(relayed).sum(), direct[0].sum())
      assert np.allclose(moved, sum(relayed))
  cfg = load_sim_config(None, [f"gpus=[{8 * n}]", "kv_relay_fanout=16"])
  sim = Simulator(cfg, Point("llama3_8b", 8 * n, T, "pretrain"))
  rounds, _ = exchange_rounds(tasks, layout, COMM, sim.transport, sim.relay)
  comm_ms, bytes_, _ = sim._cad_exchange(tasks, layout, COMM)
  assert np.allclose(comm_ms, sum(sim._comm_ms_pairwise(r) for r in rounds))
  assert (comm_ms >= sim._comm_ms_pairwise(sum(rounds)) - 1e-9).all()
  assert (comm_ms > sim._comm_ms_pairwise(sum(rounds)) + 1e-6).any()  # sequential, not merged
  assert np.isclose(bytes_.max(), busiest(rounds))


def test_simulator_exchange_and_relay_config():
  """The simulator's transports order its CAD bytes and times as the exchanges do; bad values of
  `exchange` and `kv_relay_fanout` are config errors naming the field."""
  base = ["gpus=[128]", "batches=1"]
  point = Point("llama3_8b", 128, 131072, "pretrain")
  cad = {ex: Simulator(load_sim_config(None, base + [f"exchange={ex}", "kv_relay_fanout=0"]),
                       point).batch(0)[0]["cad"]
         for ex in ("ragged", "tiled")}
  assert cad["ragged"].bytes_per_layer < cad["tiled"].bytes_per_layer
  assert cad["ragged"].comm_ms <= cad["tiled"].comm_ms
  assert Simulator(load_sim_config(None, base + ["kv_relay_fanout=0"]), point).relay is None
  relay = Simulator(load_sim_config(None, base + ["kv_relay_fanout=4"]), point).relay
  assert relay.fanout == 4
  # auto, the default: on where the ranks span nodes (TP 8 on 8-GPU nodes: a rank a node) and
  # the transport carries only moving rows; off on tiled and on one node.
  relay_of = lambda *over, p=point: Simulator(load_sim_config(None, base + list(over)), p).relay
  assert load_sim_config(None, base).kv_relay_fanout == "auto"
  assert relay_of().fanout == relay_of("exchange=ragged").fanout == AUTO_FANOUT
  assert relay_of("exchange=tiled") is None
  one_node = Point("llama3_8b", 64, 131072, "pretrain")
  assert relay_of("gpus=[64]", "hardware.gpus_per_node=64", p=one_node) is None
  assert relay_of("gpus=[64]", "hardware.gpus_per_node=32", p=one_node).fanout == AUTO_FANOUT
  for bad in ("exchange=padded", "exchange=shifted", "kv_relay_fanout=-1", "kv_relay_fanout=1.5",
              "kv_relay_fanout=many"):
    with pytest.raises(ConfigError, match=bad.split("=")[0]):
      load_sim_config(None, [bad])


def test_pipeline_single_stream_tick_exposes_its_exchange():
  # The trainer's tick without ping-pong runs one core attention call per block, which waits for
  # its own dispatch: the 4D model adds that exchange to the rank's compute (hiding it would
  # give max(compute, comm) per rank, and the tick no more than the largest of either).
  cfg = load_sim_config(None, ["gpus=[32]", "pipeline_parallel=[2]", "microbatches=2",
                               "tokens_per_rank=[65536]", "pingpong=false"])
  sim = PipelineSimulator(cfg, Point("llama3_8b", 32, 65536, "pretrain", 2))
  sim.sampler = _Alternating()
  for t in sim.ticks(0):
    cad = t["results"]["cad"][0]
    per_layer_ms = cad.iter_s * 1e3 / (sim.shape.layers / sim.pp)
    assert cad.comm_ms > 0 and per_layer_ms > max(cad.compute_ms, cad.comm_ms) * (1 + 1e-6)
