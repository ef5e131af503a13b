"""Core attention disaggregation equals colocated attention and a single-device reference:
loss and every parameter gradient (fp32), across layouts, device counts, meshes, ping-pong,
memory modes and exchanges (the device side, `dispatch/exchange.py`, end to end)."""

import dataclasses

import jax
import numpy as np
import pytest

from distca_jax import attention as attn
from distca_jax import dispatch
from distca_jax import gate as gate_lib
from distca_jax import mesh as mesh_lib
from distca_jax.config import ConfigError
from distca_jax.data.sources import make_batch, synthetic_from_config
from distca_jax.schedule.capacities import Capacities
from distca_jax.schedule import transport as transport_lib
from distca_jax.schedule.pingpong import split_pingpong
from distca_jax.train import metrics
from distca_jax.train.step import Trainer
from helpers import (global_plan, layout_batch, plan_for_layout, prefer_streams,
                     pure_params, reference_over, run_step, small_config, tree_rel_err)

T = 256  # default buffer length; CASES may use less to keep the suite fast on 2 CPU cores


CASES = [
    # devices, tensor, layout source, ping-pong, memory mode, buffer length
    (2, 1, "pretrain", False, "keep", 256),
    (4, 1, "prolong", True, "keep", 128),
    (8, 1, "pretrain", True, "resend", 128),
    (4, 2, "pretrain", False, "resend", 128),
    (2, 2, "span_all", True, "keep", 256),
    (4, 1, "long_on_one", False, "keep", 256),
    (8, 1, "span_all", False, "keep", 128),
    (4, 1, "equal", True, "resend", 128),
]


def count_primitive(jaxpr, name: str) -> int:
  """How many equations of `jaxpr` (sub-jaxprs included) apply primitive `name`."""
  from jax.extend import core as jax_core

  return sum((eqn.primitive.name == name)
             + sum(count_primitive(sub, name) for sub in jax_core.jaxprs_in_params(eqn.params))
             for eqn in jaxpr.eqns)


@pytest.mark.parametrize("data,tensor,layout,pingpong,mode,T", CASES)
def test_distca_matches_reference(monkeypatch, data, tensor, layout, pingpong, mode, T):
  # One decoder layer: every kind of parameter gradient is still checked, at half the cost.
  cfg = small_config(f"mesh.data={data}", f"mesh.tensor={tensor}", "attention.impl=distca",
                     f"attention.pingpong={str(pingpong).lower()}", f"attention.memory_mode={mode}",
                     f"data.tokens_per_device={T}", "attention.epsilon=0.05", "model.layers=1",
                     f"data.distribution={layout if layout in ('pretrain', 'prolong') else 'pretrain'}")
  if layout in ("pretrain", "prolong"):
    batch = synthetic_from_config(cfg.data, 512, data).batch(11 * data + tensor)
  else:
    batch = layout_batch(layout, data, seed=data, T=T)
  prefer_streams(monkeypatch, 2)  # ping-pong's two streams even where one is predicted better
  loss, grads, params, shape, ctx = run_step(cfg, batch, data * tensor)
  assert len(ctx.batches) == (2 if pingpong else 1)
  ref_loss, ref_grads = reference_over(params, shape, [batch])  # the whole batch, on one device
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
  assert tree_rel_err(grads, ref_grads) <= 1e-5
  if layout == "long_on_one":  # the scheduler must actually move work here
    assert any(p.stats.moves > 0 for p in ctx.plans)
    before, after = ctx.imbalance()
    assert after < before


@pytest.mark.parametrize("gate", [1.0, 100.0])
def test_distca_equals_colocated_on_same_batch(gate):
  """CAD (gate 1: every step moves work), or a batch below attention.min_imbalance (gate 100:
  host_context hands the step colocated attention's context, no exchange and no ping-pong
  split), against colocated on the same batch: loss and gradients equal."""
  batch_cfg = small_config("mesh.data=4", f"data.tokens_per_device={T}", "data.distribution=prolong",
                           "model.layers=1")
  batch = synthetic_from_config(batch_cfg.data, 512, 4).batch(2)
  colo = run_step(batch_cfg, batch, 4)
  dist_cfg = small_config("mesh.data=4", f"data.tokens_per_device={T}", "attention.impl=distca",
                          "attention.pingpong=false", "model.layers=1",
                          f"attention.min_imbalance={gate}")
  dist = run_step(dist_cfg, batch, 4)
  assert isinstance(dist[4], attn.ColocatedContext) == (gate > 1)
  assert abs(colo[0] - dist[0]) <= 1e-5 * abs(colo[0])
  assert tree_rel_err(dist[1], colo[1]) <= 1e-5


def test_pingpong_single_stream_can_be_refused(monkeypatch):
  """attention.pingpong_allow_single=false: a step whose split cuts a long document runs two
  streams even where one is predicted to save more (one stream needs more memory)."""
  prefer_streams(monkeypatch, 1)
  batch = layout_batch("span_all", 2, seed=2, T=T)
  base = ["mesh.data=2", f"data.tokens_per_device={T}", "model.layers=1", "attention.impl=distca"]
  assert len(run_step(small_config(*base), batch, 2)[4].batches) == 1
  assert len(run_step(small_config(*base, "attention.pingpong_allow_single=false"), batch, 2)[4].batches) == 2


@pytest.mark.parametrize("streams", [2, 1])
def test_pingpong_cuts_a_long_document_exactly(monkeypatch, streams):
  """A document longer than half the batch cannot go whole into either ping-pong half: its
  prefix fills Ping and its suffix goes to Pong, whose attention reads the prefix's K/V rows
  from Ping. Such a step is planned as two streams and as one and runs the one the gate's model
  predicts saves more (here made to prefer `streams`). Either way exactly colocated's loss and
  gradients; without Ping's rows (the suffix as a document of its own, as the split once ran
  it) the loss is another."""
  prefer_streams(monkeypatch, streams)
  batch = layout_batch("span_all", 2, seed=2, T=T)  # documents of 2T - 37 and 37 tokens
  base = ["mesh.data=2", f"data.tokens_per_device={T}", "model.layers=1"]
  colo = run_step(small_config(*base), batch, 2)
  exact = run_step(small_config(*base, "attention.impl=distca"), batch, 2)
  assert len(exact[4].batches) == streams
  assert abs(exact[0] - colo[0]) <= 1e-5 * abs(colo[0])
  assert tree_rel_err(exact[1], colo[1]) <= 1e-5
  if streams == 2:
    ping, pong = exact[4].batches
    assert int(pong.layout.prior.length.sum()) == T  # the long document's prefix fills Ping
    # The same two halves, each as a batch of its own (the suffix from position 0, no prefix).
    lens = split_pingpong(batch.layout.doc_lens).lens
    cut = reference_over(exact[2], exact[3], [make_batch(l, b.tokens[b.segment_ids >= 0], 2, T // 2)
                                          for l, b in zip(lens, (ping, pong))])
    assert abs(cut[0] - colo[0]) > 1e-4 * abs(colo[0])


def test_training_mixes_gated_and_balanced_steps(tmp_path):
  """min_imbalance between the steps' imbalances: some steps run colocated attention, the others
  CAD, in one run (two executables); every step's loss is colocated's."""
  from distca_jax.train import loop

  common = ["mesh.data=4", f"data.tokens_per_device={T}", "data.distribution=prolong",
            "model.layers=1", "train.steps=4", "attention.pingpong=false", "optim.warmup_steps=0",
            "train.imbalance_after=false"]
  cfg = small_config(*common)
  src = loop.make_source(cfg, 4)
  imb = [metrics.imbalance(metrics.attention_load_per_device(src.batch(i).layout))
         for i in range(4)]
  assert len(set(np.round(imb, 6))) > 1, imb
  gate = float(np.median(imb))
  colo = loop.run(small_config(*common, f"train.out_dir={tmp_path / 'c'}"),
                  devices=jax.devices()[:4], log=lambda *a: None)
  lines = []
  dist = loop.run(small_config(*common, "attention.impl=distca", f"attention.min_imbalance={gate}",
                               f"train.out_dir={tmp_path / 'd'}"),
                  devices=jax.devices()[:4], log=lines.append)
  assert dist.colocated_steps == sum(i < gate for i in imb) and 0 < dist.colocated_steps < 4
  assert colo.colocated_steps is None
  cad = [" cad=1 " in l + " " for l in lines if l.startswith("step ")]  # per step: CAD ran
  assert cad == [i >= gate for i in imb], (lines, imb)
  # CAD steps log what the gate predicted their plans save; gated steps have no plans.
  assert [" cad_predicted_saving=" in l for l in lines if l.startswith("step ")] == cad
  assert [" nano_batches=1 " in l + " " for l in lines if l.startswith("step ")] == cad  # ping-pong off
  assert [" exchange_q_rows=" in l for l in lines if l.startswith("step ")] == cad
  # ... and whether a plan stopped short of attention.epsilon.
  assert [" plan_short=" in l for l in lines if l.startswith("step ")] == cad
  # Capacities are logged exactly (they name the step's compiled shape), not to 4 digits.
  logged = [int(l.split("exchange_q_rows=")[1].split()[0]) for l in lines if "exchange_q_rows=" in l]
  assert logged and all(r % 8 == 0 for r in logged), lines
  assert f"CAD on {4 - dist.colocated_steps} of 4 steps" in loop.format_summary(dist)
  # The run records the gate's attention cost it resolved: the CPU's reference kernel was not
  # measured in steps, so the fit's kernel's.
  import json
  recorded = json.loads((tmp_path / "d" / "config.json").read_text())["attention"]
  assert recorded["gate_attention_cost"] == gate_lib.GATE_ATTENTION_COST[gate_lib.GATE_FIT_KERNEL]
  # A named kernel that cannot run here fails before anything is built, naming the key.
  with pytest.raises(ConfigError, match="attention.kernel: kernel backend 'triton'"):
    loop.run(small_config(*common, "attention.kernel=triton", f"train.out_dir={tmp_path / 't'}"),
             devices=jax.devices()[:4], log=lambda *a: None)
  assert dist.compile_count >= 2
  assert dist.compile_count == dist.step_shapes  # a step compiles only for a new shape
  assert dist.attention_imbalance == pytest.approx(colo.attention_imbalance, rel=1e-12)
  np.testing.assert_allclose(dist.losses, colo.losses, rtol=1e-5)


def test_pingpong_training_run_is_colocated_s():
  """A ping-pong CAD run (gate off: CAD on every step, two streams wherever the split allows)
  trains exactly colocated's losses step after step, the documents the split cuts included."""
  from distca_jax.train import loop

  common = ["mesh.data=2", "data.tokens_per_device=512", "data.distribution=prolong",
            "model.layers=1", "train.steps=3", "optim.warmup_steps=0", "train.imbalance_after=false"]
  src = loop.make_source(small_config(*common), 2)
  assert any(split_pingpong(src.batch(i).layout.doc_lens).cut for i in range(3))
  colo = loop.run(small_config(*common), devices=jax.devices()[:2], log=lambda *a: None)
  lines = []
  dist = loop.run(small_config(*common, "attention.impl=distca", "attention.gate=false"),
                  devices=jax.devices()[:2], log=lines.append)
  assert any(" nano_batches=2 " in l + " " for l in lines if l.startswith("step "))
  np.testing.assert_allclose(dist.losses, colo.losses, rtol=1e-5)


def test_logged_imbalance_is_the_batch_s():
  """A CAD step logs the imbalance of the batch as loaded (what colocated attention runs), not
  of its ping-pong halves, which the split alone often evens out: a colocated and a distca run
  of the same batches log the same `attention_imbalance`; `after` is the plans' load."""
  from distca_jax.train import profile

  cfg = small_config("mesh.data=4", "data.tokens_per_device=2048", "data.distribution=prolong",
                     "attention.impl=distca")
  shape = Trainer(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4])).shape
  batch = synthetic_from_config(cfg.data, 512, 4).batch(1)
  ctx = attn.host_context(cfg.attention, batch, shape)
  halves = sum(p.stats.load_before for p in ctx.plans)
  whole = metrics.attention_load_per_device(batch.layout)
  assert metrics.imbalance(halves) != pytest.approx(metrics.imbalance(whole))  # they differ here
  before, after = profile.attention_loads(ctx, batch.layout, shape, cfg.attention)
  np.testing.assert_array_equal(before, whole)
  np.testing.assert_array_equal(after, sum(p.stats.load_after for p in ctx.plans))


def test_grown_capacities_compute_the_same_step():
  """A step run at capacities grown by earlier steps (larger send and receive buffers, padded
  exchange blocks, larger server K/V buffers and task tables) gives the reference's loss and
  gradients, ping-pong on."""
  cfg = small_config("mesh.data=4", f"data.tokens_per_device={T}", "attention.impl=distca",
                     "data.distribution=prolong", "model.layers=1")
  batch = synthetic_from_config(cfg.data, 512, 4).batch(3)
  plain = run_step(cfg, batch, 4)
  caps = plain[4].capacities
  assert caps.c > 0 and caps.ckv > 0  # rows move between devices
  shapes = dispatch.StepShapes()
  grown = dataclasses.replace(
      caps, send_q=caps.send_q + 384, recv_q=caps.recv_q + 128, send_kv=caps.send_kv + 256,
      recv_kv=caps.recv_kv + 512, c=caps.c + 128, ckv=caps.ckv + 256, skv=2 * caps.skv,
      ctask=2 * caps.ctask)
  shapes.fit(f"cad@{T // 2}", grown)
  loss, grads, params, shape, ctx = run_step(cfg, batch, 4, shapes)
  assert ctx.capacities == grown
  ref_loss, ref_grads = reference_over(params, shape, [batch])
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
  assert tree_rel_err(grads, ref_grads) <= 1e-5
  assert abs(loss - plain[0]) <= 1e-5 * abs(loss)


def test_balanced_batch_skips_the_exchange():
  """When the plan keeps every row home (nothing to balance), the step has no all-to-all at all
  (a balanced batch costs what colocated costs) and still equals the reference."""
  # fsdp off: the FSDP embedding gather would bring its own all-to-all into the step.
  cfg = small_config("mesh.data=4", "attention.impl=distca", "attention.pingpong=false",
                     "model.layers=1", "data.tokens_per_device=128", "mesh.fsdp=false")
  batch = layout_batch("equal", 4, seed=3, T=128)
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4])
  trainer = Trainer(cfg, mesh)
  state = trainer.init_state(0)
  ctx = attn.host_context(cfg.attention, batch, trainer.shape)
  assert ctx.dispatch[0].q.recv_rows == 0 and ctx.dispatch[0].kv.recv_rows == 0
  arrays, dctx = trainer.put_batch(batch, ctx)
  step = jax.jit(jax.value_and_grad(trainer.loss_fn, has_aux=True))
  hlo = step.lower(state.params, arrays, dctx).compile().as_text()
  assert "all-to-all" not in hlo
  (loss, _), grads = step(state.params, arrays, dctx)
  ref_loss, ref_grads = reference_over(pure_params(state.params), trainer.shape, ctx.batches)
  assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
  assert tree_rel_err(pure_params(grads), ref_grads) <= 1e-5
  # A batch with the long documents on device 0 does exchange, in the same compiled step shape.
  skewed = layout_batch("long_on_one", 4, seed=3, T=128)
  arrays, dctx = trainer.put_batch(skewed, attn.host_context(cfg.attention, skewed, trainer.shape))
  assert "all-to-all" in step.lower(state.params, arrays, dctx).compile().as_text()


def test_backward_has_no_autodiff_scatters():
  """The exchange's backward is its explicit transposes: gathers, the reverse all_to_all, and one
  scatter-add per K/V tensor onto rows that exist (autodiff's transposes of the gathers would add
  a scatter-add into a fresh zero buffer per gather: slow on GPU, and XLA once materialised all
  of their zero buffers at step start)."""
  cfg = small_config("mesh.data=2", "attention.impl=distca", "attention.pingpong=false",
                     "data.tokens_per_device=128")
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:2])
  core_attention = dispatch.make_distca_attention(cfg.attention, mesh)
  batch = layout_batch("long_on_one", 2, seed=0, T=128)
  from distca_jax.models.presets import resolve

  _, plan = plan_for_layout(cfg.attention, batch.layout, resolve(cfg.model))
  assert plan.q.recv_rows > 0, "want a plan that moves rows"
  q = jax.numpy.ones((2, 128, 4, 16))
  kv = jax.numpy.ones((2, 128, 2, 16))
  loss = lambda q, k, v: core_attention(q, k, v, plan).sum()
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv)

  assert count_primitive(jaxpr.jaxpr, "scatter-add") == 2  # K and V gradients summed home
  # Forward: Q, K, V out and O back; backward: dO out and dQ, dK, dV back.
  assert count_primitive(jaxpr.jaxpr, "all_to_all") == 8


def test_kv_gradients_return_drops_the_empty_slots():
  """The K/V gradients' way home adds each returned row onto the local row it came from and
  drops every slot that carried none (the send buffer's padding past its rows: index 0 in the
  plan) instead of adding zeros onto row 0: on the GPU each of those adds is an atomic update of
  row 0, all contending, more of them the larger the buffers."""
  n = 4
  batch, plan = global_plan(n, "prolong")
  d = dispatch.build_dispatch(plan.tasks, batch.layout,
                              Capacities(skv=plan.capacities.skv, ctask=plan.capacities.ctask))
  assert d.kv.send_valid.any() and (~d.kv.send_valid).any()
  for dev in range(n):
    idx, valid = d.kv.send_idx[dev], d.kv.send_valid[dev]
    assert (idx[~valid] == 0).all()  # the plan's empty slots all name row 0
    got = np.asarray(dispatch.kv_return_index(idx, valid, T))
    np.testing.assert_array_equal(got, np.where(valid, idx, T).reshape(-1))
    assert (got[~valid] == T).all()  # nothing comes back into the padding
    # Each local row gets one add per server it went to; dropped slots add nothing anywhere.
    adds = jax.numpy.zeros(T).at[got].add(jax.numpy.ones(got.size), mode="drop")
    np.testing.assert_array_equal(np.asarray(adds), np.bincount(idx[valid], minlength=T))


def test_ragged_exchange_is_refused_off_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("ragged_all_to_all runs here")
  cfg = small_config("mesh.data=2", "attention.impl=distca", "attention.exchange=ragged")
  # A config error (one line, rc 2 from the launcher) when the trainer is built, before tracing.
  with pytest.raises(ConfigError, match="attention.exchange=ragged needs GPUs"):
    Trainer(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:2]))


@pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2,
                    reason="ragged_all_to_all needs 2 GPUs")
def test_ragged_exchange_equals_tiled():
  """Only the transport differs: loss and every gradient as with the tiled all_to_all."""
  batch = layout_batch("long_on_one", 2, 0)
  out = {}
  for exchange in ("tiled", "ragged"):
    cfg = small_config("mesh.data=2", f"data.tokens_per_device={T}", "attention.impl=distca",
                       "attention.pingpong=true", "model.layers=1", "attention.kernel=reference",
                       f"attention.exchange={exchange}")
    out[exchange] = run_step(cfg, batch, 2)
  assert any(p.stats.moves > 0 for p in out["ragged"][4].plans)
  assert abs(out["ragged"][0] - out["tiled"][0]) <= 1e-6 * abs(out["tiled"][0])
  assert tree_rel_err(out["ragged"][1], out["tiled"][1]) <= 1e-6


def test_tiled_exchange_over_a_large_pool_warns(monkeypatch, caplog):
  cfg = small_config("mesh.data=2", "attention.impl=distca")
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:2])
  monkeypatch.setattr(transport_lib, "TILED_POOL_LIMIT", 1)
  with caplog.at_level("WARNING", logger="distca_jax.dispatch"):
    dispatch.make_distca_attention(cfg.attention, mesh)
  assert "attention.exchange=tiled over 2 attention servers" in caplog.text
  caplog.clear()
  monkeypatch.setattr(transport_lib, "TILED_POOL_LIMIT", 2)
  with caplog.at_level("WARNING", logger="distca_jax.dispatch"):
    dispatch.make_distca_attention(cfg.attention, mesh)
  assert "attention.exchange=tiled" not in caplog.text


# ----------------------------------------------------------------------------- relayed K/V
# (attention.kv_relay_fanout: a widely needed shard's K/V forwarded by relays in a second round)

RELAY_CASES = [
    # devices, tokens per device, exchange, ping-pong, memory mode, fanout
    (4, 512, "tiled", False, "keep", 1),
    (8, 384, "tiled", True, "resend", 2),
]


@pytest.mark.parametrize("n,T,exchange,pingpong,mode,fanout", RELAY_CASES)
def test_relayed_kv_matches_reference(n, T, exchange, pingpong, mode, fanout):
  """One document over buffers 0 and 1 whose second shard's queries the planner spreads: many
  servers need buffer 0's K/V, and with relays some get it in round 2 from a relay. Loss and
  every gradient equal the single-device reference (the backward returns round 2's gradients
  through the relays)."""
  cfg = small_config(f"mesh.data={n}", f"data.tokens_per_device={T}", "attention.impl=distca",
                     f"attention.pingpong={str(pingpong).lower()}", f"attention.memory_mode={mode}",
                     f"attention.exchange={exchange}", f"attention.kv_relay_fanout={fanout}",
                     "attention.gate=false", "model.layers=1",
                     "attention.kernel=reference", "attention.epsilon=0.05",
                     "attention.pingpong_allow_single=false")
  batch = layout_batch("wide_prefix", n, seed=n, T=T)
  loss, grads, params, shape, ctx = run_step(cfg, batch, n)
  assert len(ctx.batches) == (2 if pingpong else 1)
  assert sum(int(d.kv2.send_valid.sum()) for d in ctx.dispatch) > 0  # round 2 carries rows
  ref_loss, ref_grads = reference_over(params, shape, [batch])
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
  assert tree_rel_err(grads, ref_grads) <= 1e-5


def test_relayed_kv_backward_is_explicit():
  """With relays the backward is still the explicit transposes: per K/V tensor one scatter-add
  per round (onto the relay's rows, then home), and one exchange each way per round."""
  n, T = 4, 512
  cfg = small_config(f"mesh.data={n}", "attention.impl=distca", "attention.pingpong=false",
                     f"data.tokens_per_device={T}", "attention.kv_relay_fanout=1")
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:n])
  core_attention = dispatch.make_distca_attention(cfg.attention, mesh)
  batch = layout_batch("wide_prefix", n, seed=n, T=T)
  from distca_jax.models.presets import resolve

  ctx = dispatch.plan_step(dataclasses.replace(cfg.attention, gate=False), batch, resolve(cfg.model))
  plan = ctx.dispatch[0]
  assert plan.kv2.recv_rows > 0, "want a plan that relays"
  q = jax.numpy.ones((n, T, 4, 16))
  kv = jax.numpy.ones((n, T, 2, 16))
  loss = lambda q, k, v: core_attention(q, k, v, plan).sum()
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv)

  assert count_primitive(jaxpr.jaxpr, "scatter-add") == 4
  # Forward: Q, K and V in two rounds, O back; backward: dO out, dQ back, dK and dV two rounds.
  assert count_primitive(jaxpr.jaxpr, "all_to_all") == 12


def test_relayed_kv_in_a_pipelined_step_matches_reference():
  """A pipelined step's ticks (plan_ticks) with relays: round 2 carries rows and the loss and
  every gradient equal the single-device reference over the micro-batches."""
  from distca_jax.train import pipeline, pipeline_host
  pipe, data, M = 2, 4, 2
  cfg = small_config(f"mesh.pipe={pipe}", f"mesh.data={data}", f"model.layers={pipe}",
                     "attention.impl=distca", "attention.pingpong=false", f"train.microbatches={M}",
                     "attention.kernel=reference", "data.tokens_per_device=256",
                     "attention.epsilon=0.05", "model.remat=full", "attention.kv_relay_fanout=1")
  trainer = Trainer(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:pipe * data]))
  state = trainer.init_state(0)
  rng = np.random.default_rng(0)
  lens = np.r_[512, np.full(32, 16)]  # one document over data ranks 0 and 1, short ones after
  mbs = [make_batch(lens, rng.integers(0, trainer.shape.vocab_size, lens.sum()).astype(np.int32),
                    data, 256) for _ in range(M)]
  ctx = pipeline_host.host_context(cfg.attention, mbs, pipe, trainer.shape)
  arrays, dctx = trainer.put_batch(ctx.as_batch(), ctx)
  assert int(np.asarray(dctx["forward"].kv2.send_valid).sum()) > 0
  step = jax.jit(lambda p, a, c: trainer.pipeline.value_and_grad(p, a, c["forward"], c["backward"],
                                                                 c["schedule"]))
  (loss, _), grads = step(state.params, arrays, dctx)
  params = pipeline.join_blocks(jax.device_get(state.params))
  ref_loss, ref_grads = reference_over(params, trainer.shape, mbs)
  assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
  assert tree_rel_err(pipeline.join_blocks(jax.device_get(grads)), ref_grads) <= 1e-5
