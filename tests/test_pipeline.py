"""Pipeline parallelism (mesh.pipe > 1): the lock-step 1F1B schedule, and the pipelined model's
loss and every parameter gradient equal to a single-device reference of the unpipelined model
(fp32), with colocated and disaggregated attention, on several (pipe, data, tensor) meshes."""


import jax
import numpy as np
import pytest

from distca_jax import mesh as mesh_lib
from distca_jax.train import pipeline, pipeline_host
from distca_jax.config import ConfigError, load_config
from distca_jax.data.sources import make_batch, synthetic_from_config
from distca_jax.train.step import Trainer
from helpers import dense_reference_value_and_grad, small_config, tree_rel_err


@pytest.mark.parametrize("stages,mbs", [(2, 1), (2, 3), (3, 5), (4, 4), (4, 9)])
def test_schedule_is_lockstep_1f1b(stages, mbs):
  s = pipeline_host.Schedule(stages, mbs)
  fwd_done, bwd_done = set(), set()
  for kind, t in s.ticks:
    for stage in range(stages):
      if kind == "F":
        m = s.forward_mb(t, stage)
        if m is None:
          continue
        # Its input was produced by the previous stage in an earlier forward tick.
        assert stage == 0 or (m, stage - 1) in fwd_done
        fwd_done.add((m, stage))
      else:
        m = s.backward_mb(t, stage)
        if m is None:
          continue
        assert (m, stage) in fwd_done, "backward before forward"
        assert stage == stages - 1 or (m, stage + 1) in bwd_done, "gradient not yet sent back"
        bwd_done.add((m, stage))
    # In flight on every stage: forwarded and not yet backwarded.
    for stage in range(stages):
      held = sum((m, stage) in fwd_done and (m, stage) not in bwd_done for m in range(mbs))
      assert held <= s.max_in_flight
  every = {(m, st) for m in range(mbs) for st in range(stages)}
  assert fwd_done == every and bwd_done == every
  assert len(s.ticks) == 2 * (mbs + stages - 1)
  busy = sum(s.forward_mb(t, st) is not None for t in range(s.num_ticks) for st in range(stages))
  assert 1 - busy / (s.num_ticks * stages) == pytest.approx(s.bubble_fraction)
  assert s.bubble_fraction == pytest.approx((stages - 1) / (mbs + stages - 1))


def test_split_and_join_blocks_round_trip():
  rng = np.random.default_rng(0)
  f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
  blocks = {i: {"w": f32(3, 2), "n": {"s": f32(2)}} for i in range(6)}
  pure = {"embed": f32(5, 2), "final_norm": {"scale": np.ones(2, np.float32)},
          "lm_head": f32(2, 5), "blocks": blocks}
  split = pipeline.split_blocks(pure, 6, 3)
  assert split["blocks"]["w"].shape == (3, 2, 3, 2)
  np.testing.assert_array_equal(split["blocks"]["w"][1, 0], blocks[2]["w"])
  back = pipeline.join_blocks(split)
  assert tree_rel_err(back, pure) == 0.0
  with pytest.raises(ValueError, match="do not split"):
    pipeline.split_blocks(pure, 6, 4)


def _microbatches(cfg, kind, data, M, vocab, seed):
  T = cfg.data.tokens_per_device
  if kind == "sampled":
    src = synthetic_from_config(cfg.data, vocab, data)
    return [src.batch(seed + i) for i in range(M)]
  rng = np.random.default_rng(seed)
  out = []
  for i in range(M):
    if kind == "span_all" or i % 2 == 0:   # one document over every data rank of the micro-batch
      lens = np.array([data * T - 40, 40])
    else:                                   # many short documents
      lens = np.full(data * T // 32, 32)
    out.append(make_batch(lens, rng.integers(0, vocab, lens.sum()).astype(np.int32), data, T))
  return out


CASES = [
    # pipe, data, tensor, micro-batches, attention (-pingpong, -resend), layout, blocks per stage,
    # tokens per device
    (2, 2, 2, 3, "colocated", "sampled", 1, 128),
    (2, 2, 2, 3, "distca", "sampled", 2, 128),
    # Ping-pong per tick: Ping and Pong planned on their own, a document cut between them. At 512
    # tokens the halves hold pieces the planner can move (two 128-row granules): Ping's warm-up
    # plan of the first case spreads over one idle row of four (`schedule.tick.plan_tick`), the
    # second's ticks balance over the active stages only.
    (2, 4, 1, 1, "distca-pingpong", "mixed", 1, 512),
    (4, 2, 1, 2, "distca-pingpong-resend", "span_all", 1, 512),
]


@pytest.mark.parametrize("pipe,data,tensor,M,impl,layout,per_stage,tokens", CASES)
def test_pipeline_matches_reference(pipe, data, tensor, M, impl, layout, per_stage, tokens):
  kind, *options = impl.split("-")
  memory = ["attention.memory_mode=resend"] if "resend" in options else []
  cfg = small_config(f"mesh.pipe={pipe}", f"mesh.data={data}", f"mesh.tensor={tensor}",
                     f"model.layers={pipe * per_stage}", f"attention.impl={kind}",
                     f"attention.pingpong={'pingpong' in options}", f"train.microbatches={M}",
                     f"data.tokens_per_device={tokens}", "attention.epsilon=0.05",
                     "model.remat=full", *memory)
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:pipe * data * tensor])
  trainer = Trainer(cfg, mesh)
  state = trainer.init_state(0)
  mbs = _microbatches(cfg, layout, data, M, trainer.shape.vocab_size, seed=pipe * 10 + data)
  ctx = pipeline_host.host_context(cfg.attention, mbs, pipe, trainer.shape)
  assert ctx.num_streams == (2 if "pingpong" in options else 1)
  if "pingpong" in options:  # the split cut a document: Pong reads Ping's K/V of its prefix
    assert any(tick[1].prior.num_shards for tick in ctx.forward_streams)
    assert any(p.stats.moves for p in ctx.plans)
  arrays, dctx = trainer.put_batch(ctx.as_batch(), ctx)
  # At 512 tokens a device the step's run on the CPU outweighs its compile: it is compiled
  # optimised (the suite compiles at level 0, tests/conftest.py), which halves its run.
  opts = {"xla_backend_optimization_level": 2} if tokens >= 512 else None
  step = jax.jit(lambda p, a, c: trainer.pipeline.value_and_grad(p, a, c["forward"], c["backward"],
                                                                 c["schedule"]), compiler_options=opts)
  (loss, count), grads = step(state.params, arrays, dctx)

  params = pipeline.join_blocks(jax.device_get(state.params))
  counts = [float(b.loss_mask.sum()) for b in mbs]
  # One compiled reference for every micro-batch (their arrays are its arguments).
  outs = [dense_reference_value_and_grad(params, trainer.shape, b) for b in mbs]
  ref_loss = sum(l * c for (l, _), c in zip(outs, counts)) / sum(counts)
  ref_grads = jax.tree.map(lambda *g: sum(x * c for x, c in zip(g, counts)) / sum(counts),
                           *[g for _, g in outs])
  assert float(count) == sum(counts)
  assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
  got = pipeline.join_blocks(jax.device_get(grads))
  for name in ("embed", "lm_head", "final_norm", "blocks"):
    assert tree_rel_err(got[name], ref_grads[name]) <= 1e-5, name


def test_cad_idle_stages_serve_attention_where_their_bytes_hide():
  """In warm-up only stage 0 holds tokens. With ping-pong (each stream's exchange beside the
  other's compute) its attention is spread over the idle stage's devices too; with one stream a
  tick, whose exchange adds to the tick, the trainer keeps the warm-up tick's plan that the cost
  model predicts shortest (`schedule.tick.plan_tick`), here shorter than the even spread. No
  tick's plan is worse balanced than its colocated layout."""
  from distca_jax import gate
  from distca_jax.models.presets import resolve
  from distca_jax.schedule.plan import make_plan
  from distca_jax.schedule.tick import tick_time

  for pingpong in (True, False):
    cfg = load_config(None, ["data.tokens_per_device=16384", "data.length_scale=1",
                             "attention.impl=distca", f"attention.pingpong={pingpong}",
                             "model.preset=llama3_8b"])
    shape = resolve(cfg.model)
    src = synthetic_from_config(cfg.data, 512, 2)
    ctx = pipeline_host.host_context(cfg.attention, [src.batch(i) for i in range(2)], 2, shape)
    first = ctx.plans[0].stats
    assert first.load_before[2:].sum() == 0
    if pingpong:
      assert first.load_after[2:].min() > 0
    else:
      lay, costs = ctx.forward_streams[0], gate.tick_costs(shape, cfg.attention)
      even = [make_plan(l, gate.comm_model(shape, cfg.attention), cfg.attention.epsilon) for l in lay]
      assert tick_time(ctx.plans[:1], lay, costs) < tick_time(even, lay, costs)
    ratio = lambda x: np.max(x) / np.mean(x)
    for p in ctx.plans:
      assert ratio(p.stats.load_after) <= ratio(p.stats.load_before) + 1e-9
    before, after = ctx.attention_loads()
    assert before.shape == after.shape == (4,)


@pytest.mark.parametrize("overrides,match", [
    (["mesh.pipe=3", "model.layers=4"], "divide model.layers"),
    (["mesh.pipe=2", "attention.pingpong=false", "train.microbatches=0"], "microbatches"),
    (["mesh.pipe=2", "attention.pingpong=false", "model.remat=none"], "model.remat"),
    (["mesh.pipe=3", "model.layers=3", "attention.pingpong=false", "data.tokens_per_device=128"],
     "multiple of mesh.pipe"),
])
def test_pipeline_config_errors(overrides, match):
  with pytest.raises(ConfigError, match=match):
    load_config(None, ["model.layers=4"] + overrides)


def test_pipeline_trains_and_its_checkpoint_moves_between_layouts(tmp_path):
  """A pipelined run trains end to end (one compile, its bubble reported). Its checkpoint, saved
  with 2 pipeline stages, resumes without a pipeline and back: parameters and AdamW moments
  arrive exactly (relayout of the same numbers), and the loop says so."""
  from distca_jax.train import loop
  from distca_jax.train.checkpoint import Checkpointer

  common = ["model.layers=2", "attention.pingpong=false", "model.remat=full",
            "data.tokens_per_device=128", "checkpoint.every=2"]
  piped = small_config(*common, "mesh.pipe=2", "mesh.data=2", "train.microbatches=2",
                       "train.steps=2", f"train.out_dir={tmp_path / 'piped'}", "optim.lr=3e-3",
                       "optim.warmup_steps=0")
  trained = loop.run(piped, devices=jax.devices()[:4], log=lambda *_: None)
  assert trained.steps == 2 and trained.compile_count == 1 and np.isfinite(trained.losses).all()
  assert trained.microbatches == 2 and trained.pipeline_bubble == pytest.approx(1 / 3)
  assert "bubble 33%" in loop.format_summary(trained)
  saved_dir = tmp_path / "piped" / "checkpoints"

  def trainer_of(cfg):  # a trainer and the state whose shardings a restore fills
    trainer = Trainer(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4]))
    return trainer, trainer.init_state(1)

  def restore(trainer, state, directory):
    with Checkpointer(directory, save_every=2, keep=2, read_only=True) as ck:
      return loop.restore_any_layout(ck, trainer, state, expect={})

  piped_trainer, piped_state = trainer_of(piped)  # restored into twice: one trainer a layout
  as_saved, extra = restore(piped_trainer, piped_state, saved_dir)
  assert extra["pipeline_stages"] == 2
  # 4 data ranks without micro-batches read other batches than 2 with 2: a new data layout.
  flat = small_config(*common, "mesh.data=4", "train.steps=3", f"train.out_dir={tmp_path / 'flat'}",
                      f"checkpoint.dir={saved_dir}", "data.resume_new_layout=true")
  unpiped, _ = restore(*trainer_of(flat), saved_dir)
  want = jax.device_get(piped_trainer.relayout(as_saved, 2, 1))
  got = jax.device_get(unpiped)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  moments = [a for a in jax.tree.leaves(got.opt_state) if a.ndim >= 2]
  assert moments and all(np.abs(a).sum() > 0 for a in moments)  # trained, not fresh zeros

  # ...and back: saved without a pipeline, resumed with 2 stages.
  flat_dir = tmp_path / "flat_ck"
  with Checkpointer(flat_dir, save_every=2, keep=2) as ck:
    ck.maybe_save(2, unpiped, {**extra, "pipeline_stages": 1}, force=True)
  again, _ = restore(piped_trainer, piped_state, flat_dir)
  for a, b in zip(jax.tree.leaves(jax.device_get(again)), jax.tree.leaves(jax.device_get(as_saved))):
    np.testing.assert_array_equal(a, b)

  messages = []
  summary = loop.run(flat, devices=jax.devices()[:4], log=messages.append)
  assert summary.start_step == 2 and summary.steps == 1 and np.isfinite(summary.losses).all()
  assert any("saved with 2 pipeline stages, now 1" in m for m in messages)
