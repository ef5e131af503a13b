"""The step gate (`distca_jax/gate.py`): its predicted saving and gain, the exchange's bytes it
charges (padded blocks, bytes across nodes), its decisions on plans, and its fit
(`launch/fit_gate.py`, `launch/tools/gate_report.py`) against the recorded measurements."""

import dataclasses
import json
import sys

import jax
import numpy as np
import pytest

from distca_jax import attention as attn
from distca_jax import dispatch
from distca_jax import gate as gate_lib
from distca_jax import mesh as mesh_lib
from distca_jax.config import ConfigError
from distca_jax.data.sources import make_batch, synthetic_from_config
from distca_jax.dispatch import host
from distca_jax.schedule.capacities import Capacities, largest
from distca_jax.schedule.transport import RAGGED, TILED
from distca_jax.train import metrics
from helpers import launch_script, layout_batch, small_config

T = 256  # buffer length


def test_predicted_gain():
  """CAD's predicted saving: none on a balanced batch; where attention is nearly all of the step and
  one device holds it, balancing takes the slowest device to the mean (1 - 1/N of its step)."""
  from distca_jax.models.presets import ModelShape

  shape = ModelShape(vocab_size=2, hidden=1, layers=1, heads=64, kv_heads=1, head_dim=1024, ffn=1,
                     rope_theta=1.0)
  T, N = 4096, 4
  lens = np.concatenate([[T], np.ones((N - 1) * T, np.int64)])
  one_long = make_batch(lens, np.zeros(N * T, np.int32), N, T).layout
  assert gate_lib.predicted_cad_gain(shape, one_long) == pytest.approx(1 - 1 / N, abs=2e-3)
  equal = make_batch(np.full(N, T), np.zeros(N * T, np.int32), N, T).layout
  assert gate_lib.predicted_cad_gain(shape, equal) == 0.0
  # With the matmuls of a real model the same skew buys less, and more as documents grow.
  llama = dataclasses.replace(shape, vocab_size=128256, hidden=4096, heads=32, kv_heads=8,
                              head_dim=128, ffn=14336)
  gains = [gate_lib.predicted_cad_gain(llama, make_batch(
      np.concatenate([[t], np.ones(N * t - t, np.int64)]), np.zeros(N * t, np.int32), N, t).layout)
           for t in (1024, 8192, 65536)]
  assert 0 < gains[0] < gains[1] < gains[2] < 1 - 1 / N, gains


def test_gate_on_the_plan(monkeypatch, tmp_path):
  """The gate decides from the step's own plans: `attention.min_gain` just above their predicted
  saving runs colocated attention, just below it CAD with those plans; a plan that moves nothing
  is predicted to cost the exchange's fixed part; a batch that cannot reach `min_gain` even
  perfectly balanced is not planned at all."""
  from distca_jax.models.presets import resolve

  cfg = small_config("mesh.data=4", f"data.tokens_per_device={T}", "data.distribution=prolong",
                     "attention.impl=distca")
  assert not cfg.attention.gate  # small_config turns it off
  batch = synthetic_from_config(cfg.data, 512, 4).batch(2)
  shape = resolve(cfg.model)
  ungated = attn.host_context(cfg.attention, batch, shape)
  saving = ungated.predicted_saving  # with the tiled exchange's padded blocks
  assert saving <= gate_lib.predicted_cad_saving(shape, batch.layout, ungated.plans)  # moved rows
  assert saving <= gate_lib.predicted_cad_gain(shape, batch.layout, exchange=True)
  for margin, gated in ((0.01, True), (-0.01, False)):
    a = dataclasses.replace(cfg.attention, gate=True, min_gain=saving + margin)
    ctx = attn.host_context(a, batch, shape)
    assert isinstance(ctx, attn.ColocatedContext) == gated, (saving, margin)
    if not gated:
      assert [p.stats.load_after.tolist() for p in ctx.plans] == [
          p.stats.load_after.tolist() for p in ungated.plans]

  equal = layout_batch("equal", 4, seed=3, T=128)
  plans = attn.host_context(dataclasses.replace(cfg.attention, pingpong=False), equal, shape).plans
  assert sum(int(p.traffic.send.sum()) for p in plans) == 0
  tokens = np.bincount(equal.layout.buffer, weights=equal.layout.length, minlength=4)
  linear = 3.0 * shape.matmul_flops_per_token() * tokens.max()
  area = metrics.attention_load_per_device(equal.layout).max()
  a = cfg.attention
  step = linear + 3.5 * gate_lib.gate_attention_cost(a) * 4.0 * shape.head_dim * shape.heads * \
      shape.layers * area
  assert gate_lib.predicted_cad_saving(shape, equal.layout, plans, a) == pytest.approx(
      -gate_lib.costs(a).fixed * linear / step)
  # The cost model is the config's profile: a free exchange leaves exactly the (here zero)
  # balance gain.
  profile = tmp_path / "free.json"
  profile.write_text(json.dumps({**gate_lib.read_profile(), "exchange_fixed": 0.0, "machinery": 0.0,
                                 "exchange_flops_per_byte": 0.0}))
  free = dataclasses.replace(a, gate_profile=str(profile))
  assert gate_lib.predicted_cad_saving(shape, equal.layout, plans, free) == 0.0

  def no_dispatch(*a, **k):
    raise AssertionError("built the dispatch arrays of a step the gate stopped")

  with monkeypatch.context() as m:  # a gated step's plans are made, their arrays are not
    m.setattr(host, "_arrays", no_dispatch)
    a = dataclasses.replace(cfg.attention, gate=True, min_gain=saving + 0.01)
    assert isinstance(attn.host_context(a, batch, shape), attn.ColocatedContext)

  def no_planning(*a, **k):
    raise AssertionError("planned a batch the pre-check should have stopped")

  monkeypatch.setattr(host, "_schedule", no_planning)
  gated = dataclasses.replace(cfg.attention, gate=True, min_gain=0.0)
  assert isinstance(attn.host_context(gated, equal, shape), attn.ColocatedContext)


def test_gate_charges_the_padded_exchange():
  """The gate prices the tiled exchange as it runs: every off-diagonal block whole, at the
  capacities the step gets (a run's grown ones), so a step planned under larger capacities is
  predicted to save less; the ragged exchange, the rows that move. A step the gate turns away
  leaves the run's capacities as they were."""
  from distca_jax.models.presets import resolve

  cfg = small_config("mesh.data=4", "data.tokens_per_device=2048", "data.distribution=prolong",
                     "attention.impl=distca")
  shape = resolve(cfg.model)
  batch = synthetic_from_config(cfg.data, 512, 4).batch(2)
  ctx = attn.host_context(cfg.attention, batch, shape)
  caps = ctx.capacities
  comm = gate_lib.comm_model(shape, cfg.attention)
  got = gate_lib.exchange_bytes(cfg.attention, shape, ctx.plans, caps)
  want = 2 * 3 * (caps.c * comm.q_row_bytes + caps.ckv * comm.kv_row_bytes) * 2  # Ping, Pong
  np.testing.assert_allclose(got, np.full(4, want))
  moved = sum(p.traffic.send + p.traffic.recv for p in ctx.plans)
  assert (got >= moved).all() and (got > moved).any()
  ragged = dataclasses.replace(cfg.attention, exchange="ragged")
  np.testing.assert_array_equal(gate_lib.exchange_bytes(ragged, shape, ctx.plans, caps), moved)
  assert ctx.predicted_saving == pytest.approx(gate_lib.predicted_cad_saving(
      shape, batch.layout, ctx.plans, cfg.attention, got))

  T = batch.layout.buffer_len // 2
  shapes = dispatch.StepShapes()
  shapes.fit(f"cad@{T}", dataclasses.replace(caps, c=2 * caps.c, ckv=2 * caps.ckv))
  before = dict(shapes.sizes)
  grown = attn.host_context(cfg.attention, batch, shape, shapes=shapes)
  assert grown.capacities.c == 2 * caps.c and shapes.sizes == before
  assert grown.predicted_saving < ctx.predicted_saving
  gated = dataclasses.replace(cfg.attention, gate=True, min_gain=ctx.predicted_saving)
  fresh = dispatch.StepShapes()
  assert isinstance(attn.host_context(gated, batch, shape, shapes=shapes), attn.ColocatedContext)
  # The gate turned the step away: no CAD capacity grew (the colocated step's shape is new).
  assert {k: v for k, v in shapes.sizes.items() if k.startswith("cad@")} == before
  assert isinstance(attn.host_context(gated, batch, shape, shapes=fresh), dispatch.StepContext)
  assert fresh.sizes["cad@%d.c" % T] == caps.c


@pytest.mark.parametrize("dist", ["pretrain", "prolong"])
def test_gate_decides_alike_on_every_process(dist):
  """Each process plans only its own devices' rows, and every process must take the gate's
  decision alike (else they would run different executables): the prediction comes from the
  global plans, the same whatever rows a process builds."""
  from distca_jax.models.presets import resolve

  n = 8
  cfg = small_config(f"mesh.data={n}", f"data.tokens_per_device={T}", "attention.impl=distca",
                     f"data.distribution={dist}")
  shape = resolve(cfg.model)
  for step in range(3):
    batch = synthetic_from_config(cfg.data, 512, n).batch(step)
    whole = attn.host_context(cfg.attention, batch, shape)
    want = whole.predicted_saving
    for D in (np.array([0, 1]), np.arange(4, 8)):
      part = attn.host_context(cfg.attention, batch, shape, devices=D)
      assert part.predicted_saving == want
      for min_gain in (want - 1e-3, want + 1e-3):
        gated = dataclasses.replace(cfg.attention, gate=True, min_gain=min_gain)
        assert (isinstance(attn.host_context(gated, batch, shape, devices=D), attn.ColocatedContext)
                == isinstance(attn.host_context(gated, batch, shape), attn.ColocatedContext)
                == (min_gain > want))


def test_gate_constants_are_the_fit_of_the_recorded_measurements(tmp_path):
  """The gate's shipped cost profile (distca_jax/gate_fit.json) is what launch/fit_gate.py fits to the step times it records
  (4 x H100, docs/PERFORMANCE.md, "Gated runs"): a change to the planner, the traffic model or
  the data that moves the fit leaves them stale, and this says so. And the shipped gate takes
  CAD's side on every measured batch that gained more than 2%, colocated's on every one that lost
  more than 2% (the batches were measured with the ping-pong split before it stopped cutting
  documents that fit whole: their halves now differ by a few short documents, and the
  leave-one-out error is up to 2%)."""
  from distca_jax.config import AttentionConfig

  fit_gate = launch_script("fit_gate")
  fitted = fit_gate.fit(verbose=False)
  shipped = AttentionConfig()
  assert shipped.gate_attention_cost is None  # per kernel: the fit's kernel's, and scaled ones
  assert fitted["attention_cost"] == pytest.approx(
      gate_lib.GATE_ATTENTION_COST[gate_lib.GATE_FIT_KERNEL], rel=0.02)
  assert set(gate_lib.GATE_ATTENTION_COST) == {gate_lib.GATE_FIT_KERNEL, *fit_gate.KERNEL_COST_RATIO}
  for kernel, ratio in fit_gate.KERNEL_COST_RATIO.items():
    assert gate_lib.GATE_ATTENTION_COST[kernel] == pytest.approx(
        gate_lib.GATE_ATTENTION_COST[gate_lib.GATE_FIT_KERNEL] * ratio, rel=2e-3), kernel
  for name in ("exchange_fixed", "exchange_flops_per_byte"):
    assert fitted[name] == pytest.approx(gate_lib.read_profile()[name], rel=0.02), name
  written = fit_gate.write_profile(tmp_path / "profile.json", fitted)  # what a run then loads
  loaded = gate_lib.costs(dataclasses.replace(shipped, gate_profile=str(tmp_path / "profile.json")))
  assert written["exchange_fixed"] == loaded.exchange_fixed == fitted["exchange_fixed"]
  assert written["machinery"] == loaded.machinery == fitted["machinery"] == gate_lib.FIT_MACHINERY
  # The shipped profile charges the current code's machinery, measured on one GPU, not fitted.
  assert 0 < gate_lib.costs().machinery <= gate_lib.FIT_MACHINERY
  assert len(fitted["batches"]) == 14
  for name, (measured, predicted) in fitted["batches"].items():
    if abs(measured) > 0.02:
      assert (predicted >= 0) == (measured > 0), (name, measured, predicted)


def test_gate_attention_cost_is_the_kernels(monkeypatch):
  """Unset, the gate's attention cost is the one measured for the kernel the run's attention
  resolves to (mosaic's below triton's: a faster kernel leaves less to balance); kernels not
  measured in steps, and callers that resolve none, take the fit's kernel's; a set one stays."""
  from distca_jax import kernels
  from distca_jax.config import AttentionConfig
  from distca_jax.models.presets import resolve

  cfg = small_config()
  shape = resolve(cfg.model)
  fit = gate_lib.GATE_ATTENTION_COST[gate_lib.GATE_FIT_KERNEL]
  assert gate_lib.GATE_ATTENTION_COST["mosaic"] < fit
  unset = AttentionConfig()
  set_cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention,
                                                                   gate_attention_cost=0.5))
  for backend, want in (("mosaic", gate_lib.GATE_ATTENTION_COST["mosaic"]), ("triton", fit),
                        ("reference", fit), ("pallas", fit)):
    monkeypatch.setattr(kernels, "resolve_backend", lambda b, d, t, backend=backend: backend)
    got, kernel = metrics.with_kernel_gate_cost(cfg, shape)
    assert (got.attention.gate_attention_cost, kernel) == (want, backend)
    assert metrics.with_kernel_gate_cost(set_cfg, shape)[0].attention.gate_attention_cost == 0.5
  # The run's log says where the cost came from.
  mosaic_cost = gate_lib.GATE_ATTENTION_COST["mosaic"]
  assert gate_lib.describe_gate_cost(unset, "mosaic") == (
      f"{mosaic_cost:.3g} (mosaic kernel, measured)")
  assert gate_lib.describe_gate_cost(unset, "reference") == (
      f"{fit:.3g} (triton's: the reference kernel is not measured in training steps)")
  assert gate_lib.describe_gate_cost(dataclasses.replace(unset, gate_attention_cost=0.5),
                                    "mosaic") == "0.5 (attention.gate_attention_cost)"
  # What predicts a step reads the resolved cost; unresolved, the fit kernel's.
  batch = layout_batch("long_on_one", 4, seed=0)
  mosaic = dataclasses.replace(unset, gate_attention_cost=gate_lib.GATE_ATTENTION_COST["mosaic"])
  assert (gate_lib.predicted_cad_gain(shape, batch.layout, attention_config=unset)
          == gate_lib.predicted_cad_gain(shape, batch.layout,
                                        attention_config=dataclasses.replace(
                                            unset, gate_attention_cost=fit))
          > gate_lib.predicted_cad_gain(shape, batch.layout, attention_config=mosaic) > 0)


def test_fit_gate_reads_bench_json(tmp_path):
  """fit_gate --from: per sampled batch of a bench_train JSON, colocated's step against CAD's
  (distca-ungated, or distca when it ran CAD; a gated distca row is not CAD); other batch kinds
  are skipped."""
  import json

  fit_gate = launch_script("fit_gate")
  row = lambda batch, variant, s, ran=False: dict(batch=batch, variant=variant, median_s=s,
                                                  cad_ran=ran)
  rows = [row("prolong@58", "colocated", 2.0328), row("prolong@58", "distca", 2.03),
          row("prolong@58", "distca-ungated", 2.0415, True),
          row("pretrain@2", "colocated", 2.7395), row("pretrain@2", "distca", 1.9927, True),
          row("pretrain@1", "colocated", 1.5462), row("pretrain@1", "distca", 1.55),
          row("skewed", "colocated", 2.2), row("skewed", "distca", 1.9, True)]
  (tmp_path / "cad.json").write_text(json.dumps(rows))
  got = fit_gate.from_bench_json([tmp_path / "cad.json"], 4, fit_gate.SETUP)
  assert [(d, s, round(c), round(x)) for _, _, d, s, c, x in got] == [
      ("prolong", 58, 2033, 2042), ("pretrain", 2, 2740, 1993)]
  fitted = fit_gate.fit(verbose=False, extra=got)
  assert len(fitted["batches"]) == 14  # the same two batches again: same names, same fit
  # Two points counted twice move the small exchange terms; the step-time fit barely.
  assert fitted["attention_cost"] == pytest.approx(
      gate_lib.GATE_ATTENTION_COST[gate_lib.GATE_FIT_KERNEL], rel=0.02)


def test_gate_report_pairs_uncompiled_steps(tmp_path, capsys):
  """gate_report: only steps on which neither run compiled count; the speedup is the ratio of
  the summed step times, overall and split by whether the gate gave the step CAD; the gate's
  predicted saving against the measured one on the CAD steps."""
  line = lambda n, s, c, cad=None: (f"step {n}: loss=1 step_s={s} compile_count={c}"
                                    + ("" if cad is None else f" cad={cad}"))
  col = [line(1, 9.0, 1), line(2, 2.0, 1), line(3, 2.0, 1), line(4, 4.0, 2), line(5, 3.0, 2)]
  cad = [line(1, 9.0, 1, 1), line(2, 1.0, 1, 1) + " cad_predicted_saving=0.4", line(3, 2.5, 2, 0),
         line(4, 3.0, 2, 1), line(5, 3.0, 2, 0)]
  (tmp_path / "c.log").write_text("noise\n" + "\n".join(col))
  (tmp_path / "d.log").write_text("\n".join(cad) + "\nsummary")
  assert launch_script("tools/gate_report").main([str(tmp_path / "c.log"), str(tmp_path / "d.log")]) == 0
  out = capsys.readouterr().out
  assert out.startswith("2 steps timed in both runs")  # 1: both compiled, 3: distca, 4: colocated
  assert "| all | 2 | 5.00 | 4.00 | 1.250 |" in out
  assert "| CAD ran | 1 | 2.00 | 1.00 | 2.000 |" in out
  assert "| gated (colocated) | 1 | 3.00 | 3.00 | 1.000 |" in out
  # Step 2: predicted 40%, measured 1 - 1/2 = 50%.
  assert ("predicted saving +40.0% on average, measured +50.0%; error RMS 10.0%, at most 10.0%; "
          "same sign on 1 of 1") in out
  assert "losses within 0.1% of each other on all 5 steps" in out
  assert "| query rows |" not in out  # one exchange shape: no per-shape table
  (tmp_path / "d.log").write_text("\n".join(cad[:3] + [cad[3].replace("loss=1", "loss=1.01"), cad[4]]))
  assert launch_script("tools/gate_report").main([str(tmp_path / "c.log"), str(tmp_path / "d.log")]) == 0
  assert ("losses within 0.1% of each other up to step 3; first apart at step 4 (1.00%), apart "
          "on 1 of 5 steps") in capsys.readouterr().out


def test_gate_report_per_exchange_shape(tmp_path, capsys):
  """gate_report: with CAD steps at two exchange shapes, the prediction's error per shape (the
  capacities logged with each step), so a cost that grows with the padded blocks shows."""
  line = lambda n, s, extra="": f"step {n}: loss=1 step_s={s} compile_count=1{extra}"
  shape = lambda kv, kv2="": (f" exchange_q_rows=12288 exchange_kv_rows={kv}"
                             + (f" exchange_kv2_rows={kv2}" if kv2 else "") + " nano_batches=2")
  col = [line(n, 2.0) for n in range(1, 9)]
  cad = [line(1, 9.0, " cad=0"),  # compiled (the first step): left out
         line(2, 1.8, " cad=1 cad_predicted_saving=0.1" + shape(32768)),   # measured 10%
         line(3, 1.6, " cad=1 cad_predicted_saving=0.2" + shape(32768)),   # measured 20%
         line(4, 1.9, " cad=1 cad_predicted_saving=0.1" + shape(65536)),   # measured 5%
         line(5, 1.8, " cad=1 cad_predicted_saving=0.2" + shape(65536)),   # measured 10%
         line(6, 2.0, " cad=0"),
         # The relayed round's rows make their own shape (a step compiled for them).
         line(7, 1.6, " cad=1 cad_predicted_saving=0.3" + shape(32768, 8192)),  # measured 20%
         line(8, 2.0, " cad=0")]
  (tmp_path / "c.log").write_text("\n".join(col))
  (tmp_path / "d.log").write_text("\n".join(cad))
  assert launch_script("tools/gate_report").main([str(tmp_path / "c.log"), str(tmp_path / "d.log")]) == 0
  out = capsys.readouterr().out
  assert "| 12,288 | 32,768 | 0 | 2 | 2 | +15.0% | +15.0% | +0.0 points |" in out
  assert "| 12,288 | 65,536 | 0 | 2 | 2 | +15.0% | +7.5% | +7.5 points |" in out
  assert "| 12,288 | 32,768 | 8,192 | 2 | 1 | +30.0% | +20.0% | +10.0 points |" in out


def test_fit_gate_kernel_cost_from_train_logs(tmp_path, capsys):
  """fit_gate --kernel-logs: per one-device colocated log, the step time fit as matmul plus
  attention FLOPs of the sampler's batch each step trained on (log step s: batch s - 1);
  compiled steps are left out; gate_attention_cost scales by each kernel's attention time per
  FLOP over the first log's. Logs made from known costs give them back."""
  from distca_jax.config import load_config
  from distca_jax.data.sources import synthetic_from_config
  from distca_jax.models.presets import resolve

  fit_gate = launch_script("fit_gate")
  setup = ("data.distribution=prolong",)
  cfg = load_config(None, list(fit_gate.SETUP) + list(setup))
  shape = resolve(cfg.model)
  src = synthetic_from_config(cfg.data, shape.vocab_size, 1)
  flops = [[f.max() for f in gate_lib.colocated_flops(shape, src.batch(s - 1).layout)]
           for s in range(1, 13)]
  assert np.ptp([a for _, a in flops]) > 0.2 * np.mean([a for _, a in flops])  # a fit can tell
  paths = []
  for name, c_att in (("triton", 1 / 340e9), ("mosaic", 1 / 400e9)):  # ms per FLOP
    lines = [f"step {s}: loss=1 step_s={(lin / 250e9 + att * c_att) / 1e3:.6f} "
             f"compile_count={1 if s < 7 else 2}" for s, (lin, att) in enumerate(flops, 1)]
    lines[6] = lines[6].replace("step_s=", "step_s=9")  # step 7 recompiled: slow
    paths.append(tmp_path / f"kfit_{name}.log")
    paths[-1].write_text("config ...\n" + "\n".join(lines) + "\n")
  fits = fit_gate.kernel_cost([str(p) for p in paths], setup)
  for fit, c_att in zip(fits, (1 / 340e9, 1 / 400e9)):
    assert fit["steps"] == 10  # 12 less step 1 (the first compile) and step 7 (a recompile)
    assert fit["c_att"] == pytest.approx(c_att, rel=1e-3)
    assert fit["c_lin"] == pytest.approx(1 / 250e9, rel=1e-3)
  row = capsys.readouterr().out.splitlines()[-1]
  cost = gate_lib.GATE_ATTENTION_COST["triton"] * 340 / 400
  assert row.startswith("| kfit_mosaic.log | 10 | 250 | 400 |")
  ratio, scaled = row.split("|")[-3:-1]
  assert ratio.strip() == "0.850" and float(scaled) == pytest.approx(cost, abs=1e-3)
  flat = tmp_path / "flat.log"  # one batch again and again: no attention slope to fit
  flat.write_text("\n".join(f"step {s}: step_s=1.0 compile_count=1" for s in (2, 2, 2)))
  with pytest.raises(SystemExit, match="too few"):
    fit_gate.kernel_cost([str(flat)], setup)


def test_gate_charges_bytes_between_nodes_more():
  """With data ranks on two nodes (`attention.data_rank_nodes`) a device's exchange takes as long as
  its busier link: its bytes within the node, or its bytes across nodes counted at
  the cost profile's `network_byte_cost` NVLink bytes each (the tiled exchange's blocks by their pair, the
  ragged one's moved bytes by the share of the
  device's peers on the other node); so the gate predicts less saving. One node prices as
  before."""
  from distca_jax.models.presets import resolve

  cfg = small_config("mesh.data=4", "data.tokens_per_device=2048", "data.distribution=prolong",
                     "attention.impl=distca")
  shape = resolve(cfg.model)
  batch = synthetic_from_config(cfg.data, 512, 4).batch(2)
  ctx = attn.host_context(cfg.attention, batch, shape)
  plans, comm = ctx.plans, gate_lib.comm_model(shape, cfg.attention)
  caps = largest(*(p.capacities for p in plans))  # every exchange's sizes (the step keeps its own)
  P = len(plans)
  one_node = dataclasses.replace(cfg.attention, data_rank_nodes=(0, 0, 0, 0))
  two = dataclasses.replace(cfg.attention, data_rank_nodes=(0, 0, 1, 1))  # the shipped 4.0
  for exchange in ("tiled", "ragged"):
    unset, one, split = (gate_lib.exchange_bytes(dataclasses.replace(a, exchange=exchange), shape,
                                                 plans, caps)
                         for a in (cfg.attention, one_node, two))
    np.testing.assert_array_equal(one, unset)
    if exchange == "tiled":  # 1 peer within the node (out and in), 2 across at 4x
      block = caps.c * comm.q_row_bytes + caps.ckv * comm.kv_row_bytes
      np.testing.assert_allclose(unset, 2 * 3 * block * P)
      np.testing.assert_allclose(split, max(2 * 1, 4 * 2 * 2) * block * P)
    else:  # 1 of 3 peers within the node
      np.testing.assert_allclose(split, np.maximum(unset / 3, 4 * unset * 2 / 3))
    assert (split >= unset).all() and (split > unset).any()
    saving = lambda a, x: gate_lib.predicted_cad_saving(shape, batch.layout, plans, a, x)
    assert saving(two, split) < saving(one_node, one)
  with pytest.raises(ValueError, match="2 node numbers for 4 data ranks"):
    gate_lib.exchange_bytes(dataclasses.replace(cfg.attention, data_rank_nodes=(0, 1)), shape, plans,
                            caps)


def test_trainer_records_the_nodes_of_its_data_ranks():
  """One process is one node; `mesh.devices_per_node` groups consecutive devices; a config's own
  node map is kept, and must cover the data ranks."""
  from distca_jax.train.step import with_nodes

  cfg = small_config("mesh.data=4", "attention.impl=distca")
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4])
  assert with_nodes(cfg, mesh).attention.data_rank_nodes == (0, 0, 0, 0)
  mine = small_config("mesh.data=4", "attention.data_rank_nodes=[0,0,1,1]")
  assert with_nodes(mine, mesh).attention.data_rank_nodes == (0, 0, 1, 1)
  per_node = small_config("mesh.data=4", "mesh.devices_per_node=2")
  assert with_nodes(per_node, mesh).attention.data_rank_nodes == (0, 0, 1, 1)
  wide = small_config("mesh.data=2", "mesh.tensor=2", "mesh.devices_per_node=2")  # a rank a node
  mesh_2x2 = mesh_lib.make_mesh(wide.mesh, jax.devices()[:4])
  assert with_nodes(wide, mesh_2x2).attention.data_rank_nodes == (0, 1)
  with pytest.raises(ConfigError, match="attention.data_rank_nodes: one node number per data rank"):
    with_nodes(small_config("attention.data_rank_nodes=[0,1]"), mesh)
  # Host names by process: ranks numbered by the first rank on each host.
  assert mesh_lib.nodes_of([0, 0, 1, 1, 2, 3], ["b", "b", "a", "a"]) == (0, 0, 0, 0, 1, 1)
  # The run's log names the nodes when there are several, and whether K/V is relayed.
  assert gate_lib.describe_nodes(with_nodes(cfg, mesh).attention) == ""
  two = dataclasses.replace(mine.attention, data_rank_nodes=(0, 1, 1, 1))
  assert gate_lib.describe_nodes(two) == (  # exchange=auto: ragged across nodes
      "; 2 nodes (1, 3 data ranks), a byte between them 4 NVLink bytes; K/V relay fanout 8 "
      "(kv_relay_fanout=auto)")
  assert gate_lib.describe_nodes(dataclasses.replace(two, exchange="tiled")).endswith(
      "; K/V relay off (kv_relay_fanout=auto)")
  assert gate_lib.describe_nodes(dataclasses.replace(two, kv_relay_fanout=4)).endswith(
      "; K/V relay fanout 4")


def test_fit_gate_expect_plans_as_the_trainer(capsys):
  """fit_gate --expect: per distribution, the CAD steps and the predicted run speedup with the
  run's grown capacities and with each step's own buckets; the gated run never predicts below
  colocated (the gate keeps a step colocated rather than lose)."""
  launch_script("fit_gate").expect(6, devices=(2,))  # 2 x 64K, Llama-3-8B shape (host only)
  rows = [l.split("|")[1:-1] for l in capsys.readouterr().out.splitlines()
          if l.startswith("| 2 |")]
  assert [r[1].strip() for r in rows] == ["pretrain", "prolong"]
  for r in rows:
    cad, speedup = int(r[2]), float(r[3])
    own_cad, own_speedup = (float(x) for x in r[4].split(","))
    assert 1 <= cad <= 6 and 1 <= own_cad <= 6 and speedup > 1.0 and own_speedup > 1.0
    assert speedup <= own_speedup + 1e-9  # padding to the run's capacities never helps
  # The same steps on 4 devices, as one node and as two of 2: bytes across nodes cost more, so
  # with each step's own buckets (no capacities carried between steps) the gate gives CAD no
  # more steps and predicts no more than on one node (the same transport on both).
  def table(**kw):
    launch_script("fit_gate").expect(4, devices=(4,), overrides=("attention.exchange=tiled",), **kw)
    rows = [l.split("|")[1:-1] for l in capsys.readouterr().out.splitlines() if l.startswith("| 4 |")]
    return {r[1].strip(): tuple(float(x) for x in r[4].split(",")) for r in rows}

  one, two = table(), table(per_node=2)
  assert set(one) == set(two) == {"pretrain", "prolong"}
  for dist in one:
    assert two[dist][0] <= one[dist][0] and two[dist][1] <= one[dist][1] + 1e-9
  assert any(two[d] != one[d] for d in one)


def test_fit_gate_reads_train_logs(tmp_path, monkeypatch):
  """fit_gate --logs: the CAD steps of a gated train.py run on which neither run compiled join
  the fit, each with its batch (log step s trained on the sampler's batch s - 1) and the rows per
  exchanged block it ran with (the run's grown capacities, the relayed K/V round's included
  where the log has it), which price its exchange."""
  fit_gate = launch_script("fit_gate")
  line = lambda n, s, c, extra="": f"step {n}: loss=1 step_s={s} compile_count={c}{extra}"
  ran = lambda q, kv: f" cad=1 cad_predicted_saving=0.1 nano_batches=2 exchange_q_rows={q} exchange_kv_rows={kv}"
  col = [line(1, 9.0, 1), line(2, 2.0, 1), line(3, 2.0, 1), line(4, 2.0, 1), line(5, 2.0, 1)]
  cad = [line(1, 9.0, 1, ran(8192, 16384)), line(2, 1.8, 1, ran(8192, 16384)),
         line(3, 2.0, 1, " cad=0"), line(4, 1.9, 2, ran(16384, 16384)),
         line(5, 1.7, 2, ran(16384, 16384) + " exchange_kv2_rows=4096")]
  (tmp_path / "c.log").write_text("\n".join(col))
  (tmp_path / "d.log").write_text("\n".join(cad))
  setup = fit_gate.SETUP + ("data.distribution=prolong",)
  pairs = fit_gate.from_train_logs(tmp_path / "c.log", tmp_path / "d.log", 2, setup)
  # Step 1 compiled in both, 3 ran colocated, 4 compiled in distca: steps 2 and 5; step 2's log
  # has no relayed round (ckv2 not given), step 5's has one.
  assert pairs == [(2, fit_gate.SETUP, "prolong", 1, 2000.0, 1800.0,
                    Capacities(c=8192, ckv=16384)),
                   (2, fit_gate.SETUP, "prolong", 4, 2000.0, 1700.0,
                    Capacities(c=16384, ckv=16384, ckv2=4096))]
  seen = []
  real = gate_lib.exchange_bytes

  def spy(attention_config, shape, plans, capacities):  # the fit's own pricing (not the planner's)
    if sys._getframe(1).f_code.co_filename.endswith("fit_gate.py"):
      seen.append((capacities, (attention_config, shape, plans)))
    return real(attention_config, shape, plans, capacities)

  monkeypatch.setattr(gate_lib, "exchange_bytes", spy)
  fitted = fit_gate.fit(verbose=False, extra=pairs)
  assert {"prolong@1 (2 dev)", "prolong@4 (2 dev)"} <= set(fitted["batches"])
  assert len(fitted["batches"]) == 16
  assert len(seen) == 16
  # Priced at the logged capacities (the logs' pairs come last); the step without a logged
  # relayed round takes its own plan's, none with relays off.
  (no_relay, _), (relayed, args) = seen[-2:]
  assert (no_relay.c, no_relay.ckv, no_relay.ckv2) == (8192, 16384, 0)
  assert (relayed.c, relayed.ckv, relayed.ckv2) == (16384, 16384, 4096)
  # The relayed round's blocks add to the bytes the busiest device moves.
  assert (real(*args, relayed).max()
          > real(*args, dataclasses.replace(relayed, ckv2=0)).max())


def test_exchange_padding_report(capsys):
  """launch/tools/exchange_padding.py: the tiled exchange sends at least what one block size for all
  pairs needs, which is at least what per-shift blocks need, which is at least what moves."""
  assert launch_script("tools/exchange_padding").main(["--steps", "2"]) == 0
  rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| all |")]
  tiled, pair, shift = (float(x.strip().rstrip("x")) for x in rows[0].split("|")[2:5])
  assert tiled >= pair >= shift >= 1.0 and tiled > 1.0


def test_the_log_says_when_the_tiled_exchange_will_keep_steps_colocated():
  assert TILED.pool_note(8) == ""  # one node's servers
  assert RAGGED.pool_note(64) == ""
  note = TILED.pool_note(64)
  assert note.startswith("attention.exchange=tiled over 64 attention servers") and "ragged" in note


def test_step_logs_name_each_transports_capacities(tmp_path):
  """A CAD step's log line carries its exchange's capacities in that transport's terms (tiled
  blocks, ragged send buffers; the relayed round's only while the
  run has one); gate_report reads each as the step's shape, and fit_gate --logs, whose exchange
  cost is the tiled one's, refuses another transport's log rather than fit it at zero bytes."""
  caps = Capacities(send_q=4096, send_kv=2048, send_kv2=512, c=1024, ckv=768, ckv2=256)
  assert TILED.log_rows(caps) == {
      "exchange_q_rows": 1024, "exchange_kv_rows": 768, "exchange_kv2_rows": 256}
  assert RAGGED.log_rows(caps) == {
      "exchange_send_q_rows": 4096, "exchange_send_kv_rows": 2048, "exchange_send_kv2_rows": 512}
  assert TILED.log_rows(dataclasses.replace(caps, ckv2=0)) == {
      "exchange_q_rows": 1024, "exchange_kv_rows": 768}
  report = launch_script("tools/gate_report")
  fields = lambda d: {k: float(v) for k, v in d.items()}
  assert report.exchange_shape({**fields(RAGGED.log_rows(caps)),
                                "nano_batches": 2.0}) == (4096, 2048, 512, 2)
  assert report.exchange_shape(fields(TILED.log_rows(caps))) == (1024, 768, 256, 0)
  line = lambda n, extra="": f"step {n}: loss=1 step_s=2 compile_count=1{extra}"
  (tmp_path / "c.log").write_text("\n".join([line(1), line(2)]))
  ragged = " cad=1 " + " ".join(f"{k}={v}" for k, v in RAGGED.log_rows(caps).items())
  (tmp_path / "d.log").write_text("\n".join([line(1, ragged), line(2, ragged)]))
  fit_gate = launch_script("fit_gate")
  with pytest.raises(SystemExit, match="attention.exchange=tiled"):
    fit_gate.from_train_logs(tmp_path / "c.log", tmp_path / "d.log", 2, fit_gate.SETUP)
