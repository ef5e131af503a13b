"""Core attention disaggregation equals colocated attention and a single-device reference:
loss and every parameter gradient (fp32), across layouts, device counts, meshes, ping-pong and
memory modes; and bad plans are refused before a step runs."""

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
from distca_jax.dispatch import exchange, host
from distca_jax.schedule.capacities import Capacities
from distca_jax.schedule.pingpong import split_pingpong
from distca_jax.schedule.plan import make_plan
from distca_jax.schedule.planner import pair_rows
from distca_jax.train import metrics
from distca_jax.train.step import Trainer
from helpers import (launch_script, pure_params, reference_value_and_grad, small_config,
                     tree_rel_err)

T = 256  # default buffer length; CASES may use less to keep the suite fast on 2 CPU cores


def _layout_batch(kind: str, n: int, seed: int, T: int = T):
  rng = np.random.default_rng(seed)
  total = n * T
  if kind == "span_all":      # one document spanning every device
    lens = np.array([total - 37, 37])
  elif kind == "long_on_one":  # device 0 holds all the long documents, the rest many short ones
    lens = np.concatenate([[T // 2, T // 2], np.full((total - T) // 16, 16)])
  elif kind == "equal":        # nothing to balance
    lens = np.full(total // 64, 64)
  else:
    raise ValueError(kind)
  return make_batch(lens, rng.integers(0, 512, lens.sum()).astype(np.int32), n, T)


def _run(cfg, batch, n, shapes=None):
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:n])
  trainer = Trainer(cfg, mesh)
  state = trainer.init_state(0)
  ctx = attn.host_context(cfg.attention, batch, trainer.shape, shapes=shapes)
  arrays, dctx = trainer.put_batch(batch, ctx)
  (loss, _), grads = jax.jit(jax.value_and_grad(trainer.loss_fn, has_aux=True))(state.params, arrays, dctx)
  return float(loss), pure_params(grads), pure_params(state.params), trainer.shape, ctx


def _reference(params, shape, batches):
  """Token-weighted mean loss over nano-batches, single-device plain jnp."""
  counts = [float(b.loss_mask.sum()) for b in batches]
  outs = [reference_value_and_grad(params, shape, b) for b in batches]
  loss = sum(l * c for (l, _), c in zip(outs, counts)) / sum(counts)
  grads = jax.tree.map(lambda *g: sum(x * c for x, c in zip(g, counts)) / sum(counts), *[g for _, g in outs])
  return float(loss), grads


def _plan_for_layout(attention_config, layout, shape, devices=None):
  """The scheduler's plan of one nano-batch and its checked dispatch arrays at the plan's own
  capacities (tiled exchange), planned as the trainer plans an unpipelined stream."""
  plan = make_plan(layout, gate_lib.comm_model(shape, attention_config),
                   epsilon=attention_config.epsilon,
                   min_imbalance=attention_config.min_imbalance_for(pipelined=False))
  d = dispatch.build_dispatch(plan.tasks, layout, plan.capacities.without_shifts(), devices=devices)
  dispatch.validate_plan(d, layout, devices)
  return plan, d


def _prefer_streams(monkeypatch, streams: int):
  """Make the gate's model prefer `streams` streams where a step may run one or two (a ping-pong
  split that cuts a document longer than half the step)."""
  real = gate_lib.predicted_cad_saving
  monkeypatch.setattr(gate_lib, "predicted_cad_saving", lambda shape, layout, plans, *a:
                      real(shape, layout, plans, *a) + (1.0 if len(plans) == streams else 0.0))


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
    batch = _layout_batch(layout, data, seed=data, T=T)
  _prefer_streams(monkeypatch, 2)  # ping-pong's two streams even where one is predicted better
  loss, grads, params, shape, ctx = _run(cfg, batch, data * tensor)
  assert len(ctx.batches) == (2 if pingpong else 1)
  ref_loss, ref_grads = _reference(params, shape, [batch])  # the whole batch, on one device
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
  colo = _run(batch_cfg, batch, 4)
  dist_cfg = small_config("mesh.data=4", f"data.tokens_per_device={T}", "attention.impl=distca",
                          "attention.pingpong=false", "model.layers=1",
                          f"attention.min_imbalance={gate}")
  dist = _run(dist_cfg, batch, 4)
  assert isinstance(dist[4], attn.ColocatedContext) == (gate > 1)
  assert abs(colo[0] - dist[0]) <= 1e-5 * abs(colo[0])
  assert tree_rel_err(dist[1], colo[1]) <= 1e-5


def test_pingpong_single_stream_can_be_refused(monkeypatch):
  """attention.pingpong_allow_single=false: a step whose split cuts a long document runs two
  streams even where one is predicted to save more (one stream needs more memory)."""
  _prefer_streams(monkeypatch, 1)
  batch = _layout_batch("span_all", 2, seed=2, T=T)
  base = ["mesh.data=2", f"data.tokens_per_device={T}", "model.layers=1", "attention.impl=distca"]
  assert len(_run(small_config(*base), batch, 2)[4].batches) == 1
  assert len(_run(small_config(*base, "attention.pingpong_allow_single=false"), batch, 2)[4].batches) == 2


@pytest.mark.parametrize("streams", [2, 1])
def test_pingpong_cuts_a_long_document_exactly(monkeypatch, streams):
  """A document longer than half the batch cannot go whole into either ping-pong half: its
  prefix fills Ping and its suffix goes to Pong, whose attention reads the prefix's K/V rows
  from Ping. Such a step is planned as two streams and as one and runs the one the gate's model
  predicts saves more (here made to prefer `streams`). Either way exactly colocated's loss and
  gradients; without Ping's rows (the suffix as a document of its own, as the split once ran
  it) the loss is another."""
  _prefer_streams(monkeypatch, streams)
  batch = _layout_batch("span_all", 2, seed=2, T=T)  # documents of 2T - 37 and 37 tokens
  base = ["mesh.data=2", f"data.tokens_per_device={T}", "model.layers=1"]
  colo = _run(small_config(*base), batch, 2)
  exact = _run(small_config(*base, "attention.impl=distca"), batch, 2)
  assert len(exact[4].batches) == streams
  assert abs(exact[0] - colo[0]) <= 1e-5 * abs(colo[0])
  assert tree_rel_err(exact[1], colo[1]) <= 1e-5
  if streams == 2:
    ping, pong = exact[4].batches
    assert int(pong.layout.prior.length.sum()) == T  # the long document's prefix fills Ping
    # The same two halves, each as a batch of its own (the suffix from position 0, no prefix).
    lens = split_pingpong(batch.layout.doc_lens).lens
    cut = _reference(exact[2], exact[3], [make_batch(l, b.tokens[b.segment_ids >= 0], 2, T // 2)
                                          for l, b in zip(lens, (ping, pong))])
    assert abs(cut[0] - colo[0]) > 1e-4 * abs(colo[0])


@pytest.mark.parametrize("source", ["span_all", "pretrain", "prolong"])
def test_pingpong_halves_hold_the_batch(source):
  """Ping and Pong together hold every token of the batch once, each with its own target, loss
  weight and position; Pong's prior shards name rows of Ping that hold exactly the cut
  document's prefix."""
  n = 4
  if source == "span_all":
    batch = _layout_batch(source, n, seed=1, T=128)
  else:
    batch = synthetic_from_config(small_config(f"mesh.data={n}", "data.tokens_per_device=512",
                                               f"data.distribution={source}").data, 512, n).batch(7)
  ping, pong = dispatch.split_pingpong_batch(batch)
  key = lambda b: sorted(zip(*(a[b.segment_ids >= 0].tolist() for a in
                               (b.tokens, b.targets, b.loss_mask, b.positions))))
  whole = key(batch)
  assert sorted(key(ping) + key(pong)) == whole
  assert ping.layout.prior is None and pong.layout.prior is not None
  prior = pong.layout.prior
  cut = split_pingpong(batch.layout.doc_lens).cut
  assert (prior.num_shards > 0) == (cut is not None)
  if cut is not None:  # the prefix's rows in Ping: positions 0 .. x-1 of that document, in order
    g, x = cut
    rows = np.concatenate([np.arange(o, o + l) + b * ping.layout.buffer_len for b, o, l in
                           zip(prior.buffer, prior.buffer_offset, prior.length)])
    assert ping.positions.reshape(-1)[rows].tolist() == list(range(x))
    start = int(np.sum(batch.layout.doc_lens[:g]))
    assert ping.tokens.reshape(-1)[rows].tolist() == batch.tokens.reshape(-1)[start:start + x].tolist()


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
  """A step run at capacities grown by earlier steps (padded exchange blocks, larger server K/V
  buffers and task tables) gives the reference's loss and gradients, ping-pong on."""
  cfg = small_config("mesh.data=4", f"data.tokens_per_device={T}", "attention.impl=distca",
                     "data.distribution=prolong", "model.layers=1")
  batch = synthetic_from_config(cfg.data, 512, 4).batch(3)
  plain = _run(cfg, batch, 4)
  caps = plain[4].capacities
  assert caps.c > 0 and caps.ckv > 0  # rows move between devices
  shapes = dispatch.StepShapes()
  grown = Capacities(c=caps.c + 128, ckv=caps.ckv + 256, skv=2 * caps.skv, ctask=2 * caps.ctask)
  shapes.fit(f"cad@{T // 2}", grown)
  loss, grads, params, shape, ctx = _run(cfg, batch, 4, shapes)
  assert ctx.capacities == grown
  ref_loss, ref_grads = _reference(params, shape, [batch])
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
  assert tree_rel_err(grads, ref_grads) <= 1e-5
  assert abs(loss - plain[0]) <= 1e-5 * abs(loss)


def _step_shape(ctx):
  """What the step compiles for: its kind and every context array's shape (and the window)."""
  if isinstance(ctx, attn.ColocatedContext):
    return ("colocated", ctx.q_start.shape, ctx.window)
  return (f"cad x{len(ctx.batches)}",) + tuple(jax.tree.leaves(jax.tree.map(np.shape, ctx.dispatch)))


@pytest.mark.parametrize("pingpong", [False, True])
def test_step_shapes_only_grow(pingpong):
  """Over a run's sampled batches, a trainer's StepShapes gives every step capacities no smaller
  than any earlier step's: no shape repeats after it was left, one new shape per growth, fewer
  shapes than steps planned alone (each taking its own buckets) -- and the same CAD plans."""
  cfg = small_config("mesh.data=4", "data.tokens_per_device=2048", "data.distribution=pretrain",
                     "attention.impl=distca", "attention.gate=false", "model.layers=1",
                     f"attention.pingpong={str(pingpong).lower()}")
  shape = Trainer(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4])).shape
  source = synthetic_from_config(cfg.data, 512, 4)
  shapes = dispatch.StepShapes()
  grown, alone = [], []
  for step in range(16):
    batch = source.batch(step)
    ctx = attn.host_context(cfg.attention, batch, shape, shapes=shapes)
    grown.append(_step_shape(ctx))
    alone_ctx = attn.host_context(cfg.attention, batch, shape)
    alone.append(_step_shape(alone_ctx))
    if isinstance(ctx, dispatch.StepContext):  # same tasks, larger arrays
      assert [p.tasks.server.tolist() for p in ctx.plans] == [p.tasks.server.tolist() for p in alone_ctx.plans]
  firsts = [s for i, s in enumerate(grown) if s not in grown[:i]]
  # Within each kind (colocated, CAD in one or two streams), each new shape is elementwise >=
  # the previous one.
  kinds = {s[0] for s in grown}
  for kind in kinds:
    seq = [s for s in firsts if s[0] == kind]
    for a, b in zip(seq, seq[1:]):
      assert all(np.all(np.array(y) >= np.array(x)) for x, y in zip(a[1:], b[1:]))
  # A step reuses the latest shape of its kind: no return to a shape it had left.
  for kind in kinds:
    seq = [s for s in grown if s[0] == kind]
    assert all(seq[i] == seq[i + 1] or seq[i + 1] not in seq[:i + 1] for i in range(len(seq) - 1))
  assert len(firsts) == shapes.growths
  assert len(firsts) < len(set(alone)), (len(firsts), len(set(alone)))


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


def test_gate_on_the_plan(monkeypatch):
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

  equal = _layout_batch("equal", 4, seed=3, T=128)
  plans = attn.host_context(dataclasses.replace(cfg.attention, pingpong=False), equal, shape).plans
  assert sum(int(p.traffic.send.sum()) for p in plans) == 0
  tokens = np.bincount(equal.layout.buffer, weights=equal.layout.length, minlength=4)
  linear = 3.0 * shape.matmul_flops_per_token() * tokens.max()
  area = metrics.attention_load_per_device(equal.layout).max()
  a = cfg.attention
  step = linear + 3.5 * gate_lib.gate_attention_cost(a) * 4.0 * shape.head_dim * shape.heads * \
      shape.layers * area
  assert gate_lib.predicted_cad_saving(shape, equal.layout, plans, a) == pytest.approx(
      -a.gate_exchange_fixed * linear / step)
  # The cost model is the config's: a free exchange leaves exactly the (here zero) balance gain.
  free = dataclasses.replace(a, gate_exchange_fixed=0.0, gate_exchange_flops_per_byte=0.0)
  assert gate_lib.predicted_cad_saving(shape, equal.layout, plans, free) == 0.0

  def no_dispatch(*a, **k):
    raise AssertionError("built the dispatch arrays of a step the gate stopped")

  with monkeypatch.context() as m:  # a gated step's plans are made, their arrays are not
    m.setattr(host, "_checked_arrays", no_dispatch)
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


def test_gate_constants_are_the_fit_of_the_recorded_measurements():
  """The gate's default cost model (attention.gate_*) is what launch/fit_gate.py fits to the step times it records
  (4 x H100, docs/PERFORMANCE.md "The step gate"): a change to the planner, the traffic model or
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
  assert fitted["gate_attention_cost"] == pytest.approx(
      gate_lib.GATE_ATTENTION_COST[gate_lib.GATE_FIT_KERNEL], rel=0.02)
  assert set(gate_lib.GATE_ATTENTION_COST) == {gate_lib.GATE_FIT_KERNEL, *fit_gate.KERNEL_COST_RATIO}
  for kernel, ratio in fit_gate.KERNEL_COST_RATIO.items():
    assert gate_lib.GATE_ATTENTION_COST[kernel] == pytest.approx(
        gate_lib.GATE_ATTENTION_COST[gate_lib.GATE_FIT_KERNEL] * ratio, rel=2e-3), kernel
  for name in ("gate_exchange_fixed", "gate_exchange_flops_per_byte"):
    assert fitted[name] == pytest.approx(getattr(shipped, name), rel=0.02), name
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
  batch = _layout_batch("long_on_one", 4, seed=0)
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

  from distca_jax.config import AttentionConfig

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
  assert fitted["gate_attention_cost"] == pytest.approx(
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
  shape = lambda kv: f" exchange_q_rows=12288 exchange_kv_rows={kv} nano_batches=2"
  col = [line(n, 2.0) for n in range(1, 7)]
  cad = [line(1, 9.0, " cad=0"),  # compiled (the first step): left out
         line(2, 1.8, " cad=1 cad_predicted_saving=0.1" + shape(32768)),   # measured 10%
         line(3, 1.6, " cad=1 cad_predicted_saving=0.2" + shape(32768)),   # measured 20%
         line(4, 1.9, " cad=1 cad_predicted_saving=0.1" + shape(65536)),   # measured 5%
         line(5, 1.8, " cad=1 cad_predicted_saving=0.2" + shape(65536)),   # measured 10%
         line(6, 2.0, " cad=0")]
  (tmp_path / "c.log").write_text("\n".join(col))
  (tmp_path / "d.log").write_text("\n".join(cad))
  assert launch_script("tools/gate_report").main([str(tmp_path / "c.log"), str(tmp_path / "d.log")]) == 0
  out = capsys.readouterr().out
  assert "| 12,288 | 32,768 | 2 | 2 | +15.0% | +15.0% | +0.0 points |" in out
  assert "| 12,288 | 65,536 | 2 | 2 | +15.0% | +7.5% | +7.5 points |" in out


def test_fit_gate_kernel_cost_from_train_logs(tmp_path, capsys):
  """fit_gate --kernel-logs: per one-device colocated log, the step time fit as matmul plus
  attention FLOPs of the sampler's batch each step trained on (log step s: batch s - 1);
  compiled steps are left out; gate_attention_cost scales by each kernel's attention time per
  FLOP over the first log's. Logs made from known costs give them back."""
  from distca_jax.config import AttentionConfig, load_config
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


def test_pong_plan_is_checked_against_its_ping():
  """Pong's plan reads its cut document's prefix from Ping's rows: checked against the Ping it was
  split with it passes, against a Ping whose rows hold other positions it is refused."""
  from distca_jax.models.presets import resolve

  cfg = small_config("mesh.data=2", f"data.tokens_per_device={T}", "attention.impl=distca")
  ping, pong = dispatch.split_pingpong_batch(_layout_batch("span_all", 2, seed=2, T=T))
  assert pong.layout.prior.num_shards
  _, plan = _plan_for_layout(cfg.attention, pong.layout, resolve(cfg.model))
  dispatch.validate_plan(plan, pong.layout, batch=pong, prior_batch=ping)
  shifted = dataclasses.replace(ping, positions=np.roll(ping.positions, 1, axis=1))
  with pytest.raises(dispatch.PlanMismatchError, match="earlier stream"):
    dispatch.validate_plan(plan, pong.layout, batch=pong, prior_batch=shifted)


def test_plan_for_another_batch_is_refused():
  cfg = small_config("mesh.data=4", f"data.tokens_per_device={T}", "attention.impl=distca",
                     "attention.pingpong=false")
  a = synthetic_from_config(cfg.data, 512, 4).batch(0)
  b = synthetic_from_config(cfg.data, 512, 4).batch(1)
  from distca_jax.models.presets import resolve

  _, plan_a = _plan_for_layout(cfg.attention, a.layout, resolve(cfg.model))
  with pytest.raises(dispatch.PlanMismatchError, match="does not match the batch"):
    dispatch.validate_plan(plan_a, b.layout)
  with pytest.raises(dispatch.PlanMismatchError, match="batch has"):
    dispatch.validate_plan(plan_a, _layout_batch("equal", 2, 0).layout)
  bad = dataclasses.replace(plan_a, q_start=plan_a.q_start + 10 * T)
  with pytest.raises(dispatch.PlanMismatchError, match="past its capacities"):
    dispatch.validate_plan(bad, a.layout)
  swapped = plan_a.local_q_idx.copy()
  swapped[0, [0, 1]] = swapped[0, [1, 0]]
  with pytest.raises(dispatch.PlanMismatchError, match="another token"):
    dispatch.validate_plan(dataclasses.replace(plan_a, local_q_idx=swapped), a.layout)
  # The backward's transposes: a wrong K/V inverse, or a query row placed on two servers.
  inv = plan_a.server_kv_inv.copy()
  slot = np.argwhere(plan_a.server_kv_inv_valid)[0]
  inv[tuple(slot)] += 1
  with pytest.raises(dispatch.PlanMismatchError, match="inverse"):
    dispatch.validate_plan(dataclasses.replace(plan_a, server_kv_inv=inv), a.layout)
  counts = plan_a.send_q_count.copy()  # the exchange's counts must describe its blocks
  off = np.argwhere(counts > 0)[0]
  counts[tuple(off)] -= 1
  with pytest.raises(dispatch.PlanMismatchError, match="send_q_count"):
    dispatch.validate_plan(dataclasses.replace(plan_a, send_q_count=counts), a.layout)
  with pytest.raises(dispatch.PlanMismatchError, match="recv_kv_count"):
    dispatch.validate_plan(dataclasses.replace(plan_a, recv_kv_count=plan_a.send_kv_count), a.layout)
  with pytest.raises(dispatch.PlanMismatchError, match="send_kv_idx outside"):
    dispatch.validate_plan(dataclasses.replace(plan_a, send_kv_idx=plan_a.send_kv_idx - T), a.layout)
  kv_idx = plan_a.server_kv_idx.copy()  # one K/V row gathered into two slots of server 0
  used = np.flatnonzero(plan_a.server_kv_valid[0])
  kv_idx[0, used[1]] = kv_idx[0, used[0]]
  with pytest.raises(dispatch.PlanMismatchError, match="two server slots"):
    dispatch.validate_plan(dataclasses.replace(plan_a, server_kv_idx=kv_idx), a.layout)
  free = np.argwhere(~plan_a.local_q_valid)
  assert free.size, "want a batch where some rows move (free local slots)"
  twice_valid = plan_a.local_q_valid.copy()
  twice_valid[tuple(free[0])] = True
  twice_idx = plan_a.local_q_idx.copy()
  twice_idx[tuple(free[0])] = plan_a.local_q_idx[free[0][0], 0]
  with pytest.raises(dispatch.PlanMismatchError, match="query rows on servers"):
    dispatch.validate_plan(dataclasses.replace(plan_a, local_q_valid=twice_valid,
                                               local_q_idx=twice_idx), a.layout)


def test_balanced_batch_skips_the_exchange():
  """When the plan keeps every row home (nothing to balance), the step has no all-to-all at all
  (a balanced batch costs what colocated costs) and still equals the reference."""
  # fsdp off: the FSDP embedding gather would bring its own all-to-all into the step.
  cfg = small_config("mesh.data=4", "attention.impl=distca", "attention.pingpong=false",
                     "model.layers=1", "data.tokens_per_device=128", "mesh.fsdp=false")
  batch = _layout_batch("equal", 4, seed=3, T=128)
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4])
  trainer = Trainer(cfg, mesh)
  state = trainer.init_state(0)
  ctx = attn.host_context(cfg.attention, batch, trainer.shape)
  assert ctx.dispatch[0].send_q_idx.shape[-1] == 0 and ctx.dispatch[0].send_kv_idx.shape[-1] == 0
  arrays, dctx = trainer.put_batch(batch, ctx)
  step = jax.jit(jax.value_and_grad(trainer.loss_fn, has_aux=True))
  hlo = step.lower(state.params, arrays, dctx).compile().as_text()
  assert "all-to-all" not in hlo
  (loss, _), grads = step(state.params, arrays, dctx)
  ref_loss, ref_grads = _reference(pure_params(state.params), trainer.shape, ctx.batches)
  assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
  assert tree_rel_err(pure_params(grads), ref_grads) <= 1e-5
  # A batch with the long documents on device 0 does exchange, in the same compiled step shape.
  skewed = _layout_batch("long_on_one", 4, seed=3, T=128)
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
  batch = _layout_batch("long_on_one", 2, seed=0, T=128)
  from distca_jax.models.presets import resolve

  _, plan = _plan_for_layout(cfg.attention, batch.layout, resolve(cfg.model))
  assert plan.send_q_idx.shape[-1] > 0, "want a plan that moves rows"
  q = jax.numpy.ones((2, 128, 4, 16))
  kv = jax.numpy.ones((2, 128, 2, 16))
  loss = lambda q, k, v: core_attention(q, k, v, plan).sum()
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv)

  from jax.extend import core as jax_core

  def count(jaxpr, name):
    n = 0
    for eqn in jaxpr.eqns:
      n += eqn.primitive.name == name
      for sub in jax_core.jaxprs_in_params(eqn.params):
        n += count(sub, name)
    return n

  assert count(jaxpr.jaxpr, "scatter-add") == 2  # K and V gradients summed home
  # Forward: Q, K, V out and O back; backward: dO out and dQ, dK, dV back.
  assert count(jaxpr.jaxpr, "all_to_all") == 8


def test_validate_plan_checks_the_given_devices_rows():
  """A process checks the outputs and tasks of the rows it feeds: a wrong output row of device 0
  is refused when device 0 is among them, and is left to device 0's process otherwise."""
  cfg = small_config("mesh.data=4", f"data.tokens_per_device={T}", "attention.impl=distca",
                     "attention.pingpong=false")
  a = synthetic_from_config(cfg.data, 512, 4).batch(0)
  from distca_jax.models.presets import resolve

  _, mine = _plan_for_layout(cfg.attention, a.layout, resolve(cfg.model), devices=[0, 2])
  with pytest.raises(dispatch.PlanMismatchError, match="does not match the batch"):
    dispatch.validate_plan(mine, a.layout)  # built for devices 0 and 2 only
  _, plan = _plan_for_layout(cfg.attention, a.layout, resolve(cfg.model))
  swapped = plan.local_q_idx.copy()
  swapped[0, [0, 1]] = swapped[0, [1, 0]]
  bad = dataclasses.replace(plan, local_q_idx=swapped)
  for devices in (None, [0], [0, 3]):
    with pytest.raises(dispatch.PlanMismatchError, match="another token"):
      dispatch.validate_plan(bad, a.layout, devices)
  dispatch.validate_plan(bad, a.layout, [1, 2, 3])
  assert mesh_lib.local_rows(mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4])) is None  # one process


def _global_plan(n: int, dist: str):
  """(batch, the scheduler's global plan) of the sampler's first batch of `dist` over `n` data
  ranks, planned as the trainer plans it (no arrays)."""
  from distca_jax.models.presets import resolve

  cfg = small_config(f"mesh.data={n}", f"data.tokens_per_device={T}", "attention.impl=distca",
                     f"data.distribution={dist}")
  batch = synthetic_from_config(cfg.data, 512, n).batch(0)
  comm = gate_lib.comm_model(resolve(cfg.model), cfg.attention)
  return batch, make_plan(batch.layout, comm, epsilon=cfg.attention.epsilon)


def test_kv_gradients_return_drops_the_empty_slots():
  """The K/V gradients' way home adds each returned row onto the local row it came from and
  drops every slot that carried none (the diagonal block, the padding past each block's count:
  index 0 in the plan) instead of adding zeros onto row 0: on the GPU each of those adds was an
  atomic update of row 0, all contending, more of them the larger the blocks (a 4-GPU ProLong run
  overstated the gate's saving once its K/V blocks grew to 65,536 rows)."""
  n = 4
  batch, plan = _global_plan(n, "prolong")
  d = dispatch.build_dispatch(plan.tasks, batch.layout,
                              Capacities(skv=plan.capacities.skv, ctask=plan.capacities.ctask))
  assert d.send_kv_valid.any() and (~d.send_kv_valid).any()
  for dev in range(n):
    idx, valid = d.send_kv_idx[dev], d.send_kv_valid[dev]
    assert (idx[~valid] == 0).all()  # the plan's empty slots all name row 0
    got = np.asarray(dispatch.kv_return_index(idx, valid, T))
    np.testing.assert_array_equal(got, np.where(valid, idx, T).reshape(-1))
    assert (got.reshape(idx.shape)[dev] == T).all()  # nothing comes back from itself
    # Each local row gets one add per server it went to; dropped slots add nothing anywhere.
    adds = jax.numpy.zeros(T).at[got].add(jax.numpy.ones(got.size), mode="drop")
    np.testing.assert_array_equal(np.asarray(adds), np.bincount(idx[valid], minlength=T))


@pytest.mark.parametrize("dist", ["pretrain", "prolong"])
def test_a_process_builds_only_its_devices_plan(dist):
  """build_dispatch(devices=D): D's rows and the blocks D sends or receives equal the whole
  plan's, every other row stays zero, the counts are the whole plan's, and it passes D's checks."""
  n = 8
  batch, plan = _global_plan(n, dist)
  assert (plan.tasks.server != plan.tasks.home).any()
  caps = Capacities(skv=plan.capacities.skv, ctask=plan.capacities.ctask)
  args = (plan.tasks, batch.layout, caps)
  whole = dispatch.build_dispatch(*args)
  req = plan.requirements  # capacities one short of what the plan needs: refused
  moved_q = int(pair_rows(plan.tasks, batch.layout)[0].max())
  for small in ({"skv": req.skv - 1}, {"ctask": req.ctask - 1}, {"c": moved_q - 1}):
    with pytest.raises(dispatch.PlanMismatchError, match="capacit"):
      dispatch.build_dispatch(*args[:2], dataclasses.replace(caps, **small))
  blocks = ("send_q_idx", "send_q_valid", "send_kv_idx", "send_kv_valid")
  for D in (np.array([0]), np.array([2, 5, 7]), np.arange(4, 8)):
    part = dispatch.build_dispatch(*args, devices=D)
    dispatch.validate_plan(part, batch.layout, D)
    others = np.setdiff1d(np.arange(n), D)
    for f in dispatch.ARRAY_FIELDS:
      x, y = getattr(whole, f), getattr(part, f)
      if f.endswith("_count"):
        np.testing.assert_array_equal(y, x, err_msg=f)
      elif f in blocks:
        np.testing.assert_array_equal(y[D], x[D], err_msg=f)
        np.testing.assert_array_equal(y[:, D], x[:, D], err_msg=f)
        assert not y[others][:, others].any(), f
      else:
        np.testing.assert_array_equal(y[D], x[D], err_msg=f)
        assert not y[others].any(), f


def test_ragged_exchange_is_refused_off_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("ragged_all_to_all runs here")
  cfg = small_config("mesh.data=2", "attention.impl=distca", "attention.exchange=ragged")
  with pytest.raises(ValueError, match="needs GPUs"):
    _run(cfg, _layout_batch("long_on_one", 2, 0), 2)


@pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2,
                    reason="ragged_all_to_all needs 2 GPUs")
def test_ragged_exchange_equals_tiled():
  """Only the transport differs: loss and every gradient as with the tiled all_to_all."""
  batch = _layout_batch("long_on_one", 2, 0)
  out = {}
  for exchange in ("tiled", "ragged"):
    cfg = small_config("mesh.data=2", f"data.tokens_per_device={T}", "attention.impl=distca",
                       "attention.pingpong=true", "model.layers=1", "attention.kernel=reference",
                       f"attention.exchange={exchange}")
    out[exchange] = _run(cfg, batch, 2)
  assert any(p.stats.moves > 0 for p in out["ragged"][4].plans)
  assert abs(out["ragged"][0] - out["tiled"][0]) <= 1e-6 * abs(out["tiled"][0])
  assert tree_rel_err(out["ragged"][1], out["tiled"][1]) <= 1e-6


@pytest.mark.parametrize("n,tensor,pingpong,layout", [
    (2, 1, True, "long_on_one"), (4, 1, False, "prolong"), (8, 1, True, "pretrain"),
    (4, 2, True, "prolong")])  # tensor 2: each tensor rank's ppermutes among its own servers
def test_shifted_exchange_equals_tiled(n, tensor, pingpong, layout):
  """attention.exchange=shifted (one ppermute per shift, each at its own capacity): loss and
  every gradient as with the tiled all_to_all, which sends more."""
  if layout in ("prolong", "pretrain"):
    data_cfg = small_config(f"mesh.data={n}", "data.tokens_per_device=128",
                            f"data.distribution={layout}")
    batch = synthetic_from_config(data_cfg.data, 512, n).batch(5)
  else:
    batch = _layout_batch(layout, n, 0)
  out = {}
  for exchange in ("tiled", "shifted"):
    cfg = small_config(f"mesh.data={n}", f"mesh.tensor={tensor}",
                       f"data.tokens_per_device={batch.layout.buffer_len}",
                       "attention.impl=distca", f"attention.pingpong={str(pingpong).lower()}",
                       "model.layers=1", "attention.kernel=reference", f"attention.exchange={exchange}")
    out[exchange] = _run(cfg, batch, n * tensor)
  ctx = out["shifted"][4]
  assert any(p.stats.moves > 0 for p in ctx.plans)
  d = ctx.dispatch[0]
  assert len(d.shift_q) == n - 1 and max(d.shift_q) <= d.send_q_idx.shape[-1]
  assert out["tiled"][4].dispatch[0].shift_q == ()
  assert abs(out["shifted"][0] - out["tiled"][0]) <= 1e-6 * abs(out["tiled"][0])
  assert tree_rel_err(out["shifted"][1], out["tiled"][1]) <= 1e-6
  # Per-shift blocks never send more bytes than one block size for every pair, and fewer when
  # a shift moves nothing (at T = 128 every non-empty block is one 128-row bucket).
  shape = out["shifted"][3]
  sent = {x: gate_lib.exchange_bytes(small_config(f"attention.exchange={x}").attention, shape,
                                     ctx.plans, ctx.capacities).max() for x in ("tiled", "shifted")}
  assert sent["shifted"] <= sent["tiled"]
  if 0 in d.shift_q + d.shift_kv:
    assert sent["shifted"] < sent["tiled"]


def test_gate_charges_bytes_between_nodes_more():
  """With data ranks on two nodes (`attention.gate_nodes`) a device's exchange takes as long as
  its busier link: its bytes within the node, or its bytes across nodes counted at
  `gate_network_byte_cost` NVLink bytes each (the tiled exchange's blocks by their pair, the
  shifted one's by each shift's partner, the ragged one's moved bytes by the share of the
  device's peers on the other node); so the gate predicts less saving. One node prices as
  before."""
  from distca_jax.models.presets import resolve

  cfg = small_config("mesh.data=4", "data.tokens_per_device=2048", "data.distribution=prolong",
                     "attention.impl=distca", "attention.exchange=shifted")
  shape = resolve(cfg.model)
  batch = synthetic_from_config(cfg.data, 512, 4).batch(2)
  ctx = attn.host_context(cfg.attention, batch, shape)
  plans, caps, comm = ctx.plans, ctx.capacities, gate_lib.comm_model(shape, cfg.attention)
  P = len(plans)
  one_node = dataclasses.replace(cfg.attention, gate_nodes=(0, 0, 0, 0))
  two = dataclasses.replace(cfg.attention, gate_nodes=(0, 0, 1, 1), gate_network_byte_cost=4.0)
  node = lambda i: i // 2
  for exchange in ("tiled", "shifted", "ragged"):
    unset, one, split = (gate_lib.exchange_bytes(dataclasses.replace(a, exchange=exchange), shape,
                                                 plans, caps)
                         for a in (cfg.attention, one_node, two))
    np.testing.assert_array_equal(one, unset)
    if exchange == "tiled":  # 1 peer within the node (out and in), 2 across at 4x
      block = caps.c * comm.q_row_bytes + caps.ckv * comm.kv_row_bytes
      np.testing.assert_allclose(unset, 2 * 3 * block * P)
      np.testing.assert_allclose(split, max(2 * 1, 4 * 2 * 2) * block * P)
    elif exchange == "shifted":  # shift k: d sends b_k to d + k and receives b_k from d - k
      b = [q * comm.q_row_bytes + kv * comm.kv_row_bytes
           for q, kv in zip(caps.shift_q, caps.shift_kv)]
      assert len(b) == 3
      for d in range(4):
        links = {True: 0.0, False: 0.0}  # within, across
        for k in (1, 2, 3):
          links[node(d) == node((d + k) % 4)] += b[k - 1] * P
          links[node(d) == node((d - k) % 4)] += b[k - 1] * P
        assert split[d] == pytest.approx(max(links[True], 4 * links[False]))
        assert unset[d] == pytest.approx(links[True] + links[False])
    else:  # 1 of 3 peers within the node
      np.testing.assert_allclose(split, np.maximum(unset / 3, 4 * unset * 2 / 3))
    assert (split >= unset).all() and (split > unset).any()
    saving = lambda a, x: gate_lib.predicted_cad_saving(shape, batch.layout, plans, a, x)
    assert saving(two, split) < saving(one_node, one)
  with pytest.raises(ValueError, match="2 node numbers for 4 data ranks"):
    gate_lib.same_node(dataclasses.replace(cfg.attention, gate_nodes=(0, 1)), 4)


def test_trainer_records_the_nodes_of_its_data_ranks():
  """One process is one node; a config's own node map is kept, and must cover the data ranks."""
  from distca_jax.train.step import with_gate_nodes

  cfg = small_config("mesh.data=4", "attention.impl=distca")
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4])
  assert with_gate_nodes(cfg, mesh).attention.gate_nodes == (0, 0, 0, 0)
  mine = small_config("mesh.data=4", "attention.gate_nodes=[0,0,1,1]")
  assert with_gate_nodes(mine, mesh).attention.gate_nodes == (0, 0, 1, 1)
  with pytest.raises(ConfigError, match="attention.gate_nodes: one node number per data rank"):
    with_gate_nodes(small_config("attention.gate_nodes=[0,1]"), mesh)
  # Host names by process: ranks numbered by the first rank on each host.
  assert mesh_lib.nodes_of([0, 0, 1, 1, 2, 3], ["b", "b", "a", "a"]) == (0, 0, 0, 0, 1, 1)
  # The run's log names the nodes when there are several.
  assert gate_lib.describe_gate_nodes(with_gate_nodes(cfg, mesh).attention) == ""
  assert gate_lib.describe_gate_nodes(dataclasses.replace(
      mine.attention, gate_nodes=(0, 1, 1, 1), gate_network_byte_cost=2.5)) == (
          "; 2 nodes (1, 3 data ranks), a byte between them 2.5 NVLink bytes")


def test_shifted_plan_that_overflows_a_shift_is_refused():
  """A shifted plan whose block carries more rows than its shift's capacity would drop rows on
  the wire: refused before the step runs."""
  cfg = small_config("mesh.data=4", f"data.tokens_per_device={T}", "attention.impl=distca",
                     "attention.pingpong=false", "attention.exchange=shifted",
                     "data.distribution=prolong")
  batch = synthetic_from_config(cfg.data, 512, 4).batch(5)
  ctx = attn.host_context(cfg.attention, batch, Trainer(cfg, mesh_lib.make_mesh(
      cfg.mesh, jax.devices()[:4])).shape)
  d = ctx.dispatch[0]
  rows = np.asarray(d.send_q_count)
  per_shift = [int(rows[np.arange(4), (np.arange(4) + k) % 4].max()) for k in (1, 2, 3)]
  k = int(np.argmax(per_shift)) + 1  # the shift that carries the most rows
  assert 0 < per_shift[k - 1] <= d.shift_q[k - 1]
  small = tuple(x if i != k - 1 else per_shift[k - 1] - 1 for i, x in enumerate(d.shift_q))
  with pytest.raises(dispatch.PlanMismatchError, match=f"shift {k}'s capacity"):
    dispatch.validate_plan(dataclasses.replace(d, shift_q=small), batch.layout)
  with pytest.raises(dispatch.PlanMismatchError, match="one capacity"):
    dispatch.validate_plan(dataclasses.replace(d, shift_q=d.shift_q[:-1]), batch.layout)


def test_tiled_exchange_over_a_large_pool_warns(monkeypatch, caplog):
  cfg = small_config("mesh.data=2", "attention.impl=distca")
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:2])
  monkeypatch.setattr(exchange, "TILED_POOL_LIMIT", 1)
  with caplog.at_level("WARNING", logger="distca_jax.dispatch"):
    dispatch.make_distca_attention(cfg.attention, mesh)
  assert "attention.exchange=tiled over 2 attention servers" in caplog.text
  caplog.clear()
  monkeypatch.setattr(exchange, "TILED_POOL_LIMIT", 2)
  with caplog.at_level("WARNING", logger="distca_jax.dispatch"):
    dispatch.make_distca_attention(cfg.attention, mesh)
  assert "attention.exchange=tiled" not in caplog.text


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
  # more steps and predicts no more than on one node.
  def table(**kw):
    launch_script("fit_gate").expect(4, devices=(4,), **kw)
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
  exchanged block it ran with (the run's grown capacities), which price its exchange."""
  fit_gate = launch_script("fit_gate")
  line = lambda n, s, c, extra="": f"step {n}: loss=1 step_s={s} compile_count={c}{extra}"
  ran = lambda q, kv: f" cad=1 cad_predicted_saving=0.1 nano_batches=2 exchange_q_rows={q} exchange_kv_rows={kv}"
  col = [line(1, 9.0, 1), line(2, 2.0, 1), line(3, 2.0, 1), line(4, 2.0, 1)]
  cad = [line(1, 9.0, 1, ran(8192, 16384)), line(2, 1.8, 1, ran(8192, 16384)),
         line(3, 2.0, 1, " cad=0"), line(4, 1.9, 2, ran(16384, 16384))]
  (tmp_path / "c.log").write_text("\n".join(col))
  (tmp_path / "d.log").write_text("\n".join(cad))
  setup = fit_gate.SETUP + ("data.distribution=prolong",)
  pairs = fit_gate.from_train_logs(tmp_path / "c.log", tmp_path / "d.log", 2, setup)
  # Step 1 compiled in both, 3 ran colocated, 4 compiled in distca: step 2 only.
  assert pairs == [(2, fit_gate.SETUP, "prolong", 1, 2000.0, 1800.0,
                    Capacities(c=8192, ckv=16384))]
  seen = []
  real = gate_lib.exchange_bytes

  def spy(attention_config, shape, plans, capacities):
    seen.append(capacities)
    return real(attention_config, shape, plans, capacities)

  monkeypatch.setattr(gate_lib, "exchange_bytes", spy)
  fitted = fit_gate.fit(verbose=False, extra=pairs)
  assert "prolong@1 (2 dev)" in fitted["batches"] and len(fitted["batches"]) == 15
  assert any(c is pairs[0][6] for c in seen)  # priced at the logged capacities


def test_exchange_padding_report(capsys):
  """launch/exchange_padding.py: the tiled exchange sends at least what one block size for all
  pairs needs, which is at least what per-shift blocks need, which is at least what moves."""
  assert launch_script("tools/exchange_padding").main(["--steps", "2"]) == 0
  rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| all |")]
  tiled, pair, shift = (float(x.strip().rstrip("x")) for x in rows[0].split("|")[2:5])
  assert tiled >= pair >= shift >= 1.0 and tiled > 1.0


def test_kv_return_bench(capsys):
  """launch/bench_kv_return.py: a planned step's K/V return, padded to a larger capacity, gives
  the same rows with the empty slots dropped as with them added onto row 0 (the script checks
  and fails otherwise), one table row per nano-batch plan with every slot counted."""
  args = ["--iters", "1", "--step", "0", "--ckv", "8192", "--set", "model.preset=tiny",
          "data.tokens_per_device=8192"]
  assert launch_script("tools/bench_kv_return").main(args) == 0
  rows = [l.split("|")[1:-1] for l in capsys.readouterr().out.splitlines()
          if l.startswith("| ") and not l.startswith("| plan")]
  assert len(rows) == 2  # ping-pong's two plans
  for r in rows:
    plan, dev, t, ckv, slots, real, empty = (int(x) for x in r[:7])
    assert ckv == 8192 and slots == 4 * ckv and real + empty == slots and 0 < real < slots
