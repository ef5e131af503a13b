"""The training loop: data prefetch, jitted steps, metrics, TensorBoard, checkpoints, summary.

Host work for step k+1 (sampling documents, packing, the attention context — for CAD the
scheduler's plan) runs in a background thread while the devices run step k; `host_wait_s` in the
summary is the total time the loop waited for it (0 means the host never stalled the devices).

Resuming. The data source is a pure function of the step (`source.batch(step)`), so the data
iterator's state is the step counter, saved in each checkpoint's `extra` with the model shape.
A run resumed from step s therefore trains on exactly the batches and learning rates the
uninterrupted run would have, and its losses are identical. `train.stop_at_step` (and
`train.max_seconds`) end a run early with a final checkpoint.

Multi-process. Every process runs this loop on the same global batch (each supplies the shards
its devices hold); metrics are replicated scalars, so every process reads the same values. Only
process 0 writes files (config.json, summary.json, TensorBoard, profile); all processes take part
in checkpoint saves (each writes its own shards).
"""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from distca_jax import attention as attention_lib
from distca_jax import mesh as mesh_lib
from distca_jax.config import Config, ConfigError, to_dict
from distca_jax.dispatch import StepShapes
from distca_jax.models.presets import resolve
from distca_jax.train import metrics as metrics_lib
from distca_jax.train import profile as profile_lib
from distca_jax.train.step import Trainer


class NonFiniteError(FloatingPointError):
  """Loss or gradients became NaN/Inf; the message names the step and the quantity."""


@dataclasses.dataclass
class Summary:
  steps: int
  losses: list[float]
  step_times_s: list[float]
  compile_s: float
  compile_count: int
  tokens_per_s: float
  mfu: float | None
  host_wait_s: float
  attention_imbalance: float
  devices: int
  mesh_shape: dict[str, int]
  # First global step this invocation ran (0, or the step a checkpoint resumed from).
  start_step: int = 0
  # Mean max/mean attention imbalance the CAD scheduler reaches (None: not planned).
  attention_imbalance_after: float | None = None
  # Steady-state step time (s): median and 90th percentile, profiled steps excluded.
  step_time_median_s: float = float("nan")
  step_time_p90_s: float = float("nan")
  # Peak bytes in use per local device (None where the backend keeps no statistics, e.g. CPU).
  peak_memory_bytes: list[int] | None = None
  # With mesh.pipe > 1: micro-batches per step and the schedule's bubble fraction (stage-ticks
  # without a micro-batch, whose devices only serve attention under CAD).
  microbatches: int = 1
  pipeline_bubble: float = 0.0
  # attention.impl=distca: steps that ran colocated attention because the gate
  # (attention.gate / min_imbalance) stopped them (None: colocated attention configured, or a
  # pipelined run).
  colocated_steps: int | None = None
  # Shapes the step took in this run (dispatch.StepShapes: a capacity grew, the first step's
  # included, or a resumed run first used the capacities its checkpoint kept); each compiles the
  # step once, so compile_count is this, plus any compilation the profiler adds.
  step_shapes: int = 0

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def make_source(config: Config, num_buffers: int):
  shape = resolve(config.model)
  if config.data.source == "corpus":
    from distca_jax.data.corpus import corpus_from_config

    return corpus_from_config(config.data, num_buffers, vocab_size=shape.vocab_size)
  from distca_jax.data.sources import synthetic_from_config

  return synthetic_from_config(config.data, shape.vocab_size, num_buffers)


class Prefetcher:
  """Produces (step, batch, attention context) on a background thread, `depth` steps ahead."""

  def __init__(self, make_item, first_step: int, last_step: int, depth: int = 2):
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self.host_seconds = 0.0

    def work():
      for step in range(first_step, last_step):
        if self._stop.is_set():
          return
        t0 = time.perf_counter()
        try:
          item = (step, *make_item(step))
        except BaseException as e:  # surfaced in the training thread
          self._queue.put(e)
          return
        self.host_seconds += time.perf_counter() - t0
        self._queue.put(item)

    self._thread = threading.Thread(target=work, daemon=True, name="distca-prefetch")
    self._thread.start()

  def get(self):
    item = self._queue.get()
    if isinstance(item, BaseException):
      raise item
    return item

  def close(self):
    self._stop.set()
    while not self._queue.empty():
      self._queue.get_nowait()


def run(config: Config, *, devices=None, log=print) -> Summary:
  """Trains for `config.train.steps` steps (resuming from the latest checkpoint if any)."""
  if config.train.compile_cache_dir:
    from distca_jax.launch_env import enable_compile_cache

    enable_compile_cache(config.train.compile_cache_dir)
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  shape = resolve(config.model)
  num_buffers = mesh.shape["data"]
  trainer = Trainer(config, mesh)
  if config.attention.impl == "distca" and config.attention.gate and jax.process_index() == 0:
    log("CAD gate: attention cost " + metrics_lib.describe_gate_cost(config.attention,
                                                                     trainer.kernel)
        + metrics_lib.describe_gate_nodes(trainer.config.attention))
  config = trainer.config  # with the gate's attention cost of the kernel the run takes
  source = make_source(config, num_buffers)
  out_dir = Path(config.train.out_dir)
  main = jax.process_index() == 0
  if main:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(to_dict(config), indent=2))
  last_step = config.train.steps
  if config.train.stop_at_step is not None:
    last_step = min(last_step, config.train.stop_at_step)
  profiling = config.train.profile and main
  if config.train.profile and (config.train.profile_start < 1 or config.train.profile_steps < 1):
    raise ConfigError("train.profile_start and train.profile_steps: must be >= 1")

  t0 = time.perf_counter()
  state = trainer.init_state(config.train.seed)
  start_step = 0
  # Step capacities only grow, so a step compiles only when one does; a resumed run starts from
  # the capacities its checkpoint's steps had reached.
  shapes = StepShapes()
  checkpointer = None
  if config.checkpoint.every > 0:
    from distca_jax.train.checkpoint import Checkpointer

    checkpointer = Checkpointer(config.checkpoint.dir or str(out_dir / "checkpoints"),
                                save_every=config.checkpoint.every, keep=config.checkpoint.keep)
    if config.checkpoint.resume and checkpointer.latest_step() is not None:
      state, extra = restore_any_layout(checkpointer, trainer, state,
                                        expect={"model": dataclasses.asdict(shape)})
      start_step = int(extra["step"])
      shapes.sizes.update(extra.get("step_shapes", {}))
      log(f"resumed from checkpoint at step {start_step}" + (
          f" (saved with {extra['pipeline_stages']} pipeline stages, now {trainer.stages})"
          if extra.get("pipeline_stages", 1) != trainer.stages else ""))
    elif config.checkpoint.resume and main:
      log(f"no complete checkpoint in {checkpointer.directory}: starting from step 0")
  init_s = time.perf_counter() - t0

  microbatches = config.train.microbatches
  rows = mesh_lib.local_rows(mesh)  # each process checks the plans of the rows it feeds

  def make_item(step):
    if trainer.pipeline is not None:
      from distca_jax import pipeline

      mbs = [source.batch(step * microbatches + i) for i in range(microbatches)]
      ctx = pipeline.host_context(config.attention, mbs, mesh.shape["pipe"], shape, rows, shapes)
      return ctx.as_batch(), ctx, ctx.attention_loads(), dict(shapes.sizes)
    batch = source.batch(step)
    ctx = attention_lib.host_context(config.attention, batch, shape, rows, shapes=shapes)
    loads = profile_lib.attention_loads(ctx, batch.layout, shape, config.attention,
                                        tensor_parallel=mesh.shape["tensor"],
                                        plan_after=config.train.imbalance_after)
    return batch, ctx, loads, dict(shapes.sizes)  # the capacities as of this step, to save

  device_kind = mesh.devices.flat[0].device_kind
  peak = metrics_lib.peak_flops_per_device(device_kind, config.train.peak_tflops)
  writer = _tensorboard(out_dir, config.train.tensorboard and main)
  bar = _progress(config.train.progress and main, start_step, last_step)
  prefetch = Prefetcher(make_item, start_step, last_step)
  losses, times, flops_done, tokens_done = [], [], 0.0, 0.0
  host_wait = 0.0
  compile_s = 0.0
  imbalances, imbalances_after = [], []
  load_sum = [None, None]  # per-device attention load summed over the run, before / after
  trace_dir = out_dir / "trace"
  tracing = False
  traced_steps = 0
  colocated_steps = 0 if config.attention.impl == "distca" and trainer.pipeline is None else None
  last_args = None
  saved_step = None
  run_start = time.perf_counter()
  local_devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  try:
    for _ in range(start_step, last_step):
      t_wait = time.perf_counter()
      step, batch, ctx, (load_before, load_after), step_sizes = prefetch.get()
      host_wait += time.perf_counter() - t_wait if step > start_step else 0.0
      if profiling and step + 1 == config.train.profile_start:
        trace_dir.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(trace_dir), profiler_options=profile_lib.trace_options())
        tracing = True
      t_step = time.perf_counter()
      arrays, ctx_dev = trainer.put_batch(batch, ctx)
      compiles_before = trainer.compile_count()
      state, m = trainer.step(state, arrays, ctx_dev)
      m = jax.device_get(m)  # replicated scalars: every process holds them
      dt = time.perf_counter() - t_step
      compiled = trainer.compile_count() != compiles_before
      if tracing:
        traced_steps += 1
        last_args = (state, arrays, ctx_dev)
        if traced_steps == config.train.profile_steps:
          jax.profiler.stop_trace()
          tracing = False
      elif compiled:
        compile_s += dt  # this step's time is dominated by compilation
      else:
        times.append(dt)
      _check_finite(step, m)
      loss = float(m["loss"])
      losses.append(loss)
      flops = metrics_lib.step_flops(shape, batch.layout)
      ran_cad = None
      if colocated_steps is not None:  # a distca step the gate stopped runs colocated
        ran_cad = not isinstance(ctx, attention_lib.ColocatedContext)
        colocated_steps += not ran_cad
      # A pipelined step's loads are summed over its ticks; each tick waits for its slowest
      # device, so its imbalance is the mean over ticks of each tick's.
      tick_imbalance = ctx.imbalance() if trainer.pipeline is not None else None
      imb = tick_imbalance[0] if tick_imbalance else metrics_lib.imbalance(load_before)
      imbalances.append(imb)
      load_sum[0] = load_before if load_sum[0] is None else load_sum[0] + load_before
      record = {"loss": loss, "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
                "step_s": dt, "tokens_per_s": float(m["tokens"]) / dt, "attention_imbalance": imb,
                "compile_count": trainer.compile_count()}
      if ran_cad is not None:
        record["cad"] = float(ran_cad)  # 1: CAD ran, 0: gated (attention.gate / min_imbalance)
      if ran_cad:  # what the gate predicted this step's plans save (a fraction of the step)
        record["cad_predicted_saving"] = ctx.predicted_saving
        record["nano_batches"] = len(ctx.batches)  # streams: 2 with ping-pong
        # Rows per exchanged block (query, K/V): the run's capacities, what the exchange sends.
        record["exchange_q_rows"] = ctx.capacities["c"]
        record["exchange_kv_rows"] = ctx.capacities["ckv"]
      if load_after is not None:
        imbalances_after.append(tick_imbalance[1] if tick_imbalance else metrics_lib.imbalance(load_after))
        record["attention_imbalance_after"] = imbalances_after[-1]
        load_sum[1] = load_after if load_sum[1] is None else load_sum[1] + load_after
      if peak is not None:
        record["mfu"] = flops / dt / (peak * mesh.size)
      if not compiled:
        flops_done += flops
        tokens_done += float(m["tokens"])
      memory = _peak_memory(local_devices)
      if memory is not None:
        record["peak_memory_gib"] = max(memory) / 2**30
      if writer is not None and (step % config.train.log_every == 0):
        for key, value in record.items():
          writer.add_scalar(f"train/{key}", value, step + 1)
        for d, b in zip(local_devices, memory or ()):
          writer.add_scalar(f"memory/peak_gib/device{d.id}", b / 2**30, step + 1)
      if bar is not None:
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        bar.update(1)
      elif main and step % config.train.log_every == 0:
        log(f"step {step + 1}: " + " ".join(f"{k}={_log_value(v)}" for k, v in record.items()))
      # Checked here too: orbax's should_save also saves the first step a manager sees.
      if (checkpointer is not None and (step + 1) % config.checkpoint.every == 0
          and checkpointer.maybe_save(step + 1, state,
                                      _extra(step + 1, shape, trainer.stages, step_sizes))):
        saved_step = step + 1
      if config.train.max_seconds is not None and _out_of_time(run_start, config.train.max_seconds):
        if main:
          log(f"stopping at step {step + 1}: train.max_seconds={config.train.max_seconds} reached")
        break
    done = start_step + len(losses)
    if checkpointer is not None and losses and saved_step != done and done < config.train.steps:
      # An early stop (stop_at_step, max_seconds) keeps its progress: checkpoint where it ended.
      checkpointer.maybe_save(done, state, _extra(done, shape, trainer.stages, step_sizes),
                              force=True)
  finally:
    prefetch.close()
    if tracing:
      jax.profiler.stop_trace()
    if bar is not None:
      bar.close()
    if checkpointer is not None:
      checkpointer.wait()
      checkpointer.close()
    if writer is not None:
      writer.close()

  steady = sum(times)
  stats = profile_lib.step_time_stats(times)
  memory = _peak_memory(local_devices)
  bubble = 0.0
  if trainer.pipeline is not None:
    from distca_jax import pipeline

    bubble = pipeline.Schedule(trainer.stages, microbatches).bubble_fraction
  summary = Summary(
      steps=len(losses), losses=losses, step_times_s=times, compile_s=compile_s + init_s,
      compile_count=trainer.compile_count(),
      tokens_per_s=tokens_done / steady if steady else float("nan"),
      mfu=(flops_done / steady / (peak * mesh.size)) if (peak and steady) else None,
      host_wait_s=host_wait, attention_imbalance=float(np.mean(imbalances)) if imbalances else 1.0,
      devices=mesh.size, mesh_shape=dict(mesh.shape), start_step=start_step,
      attention_imbalance_after=float(np.mean(imbalances_after)) if imbalances_after else None,
      step_time_median_s=stats["median_s"], step_time_p90_s=stats["p90_s"],
      peak_memory_bytes=memory, microbatches=microbatches, pipeline_bubble=bubble,
      colocated_steps=colocated_steps, step_shapes=shapes.growths)
  if main:
    (out_dir / "summary.json").write_text(json.dumps(summary.as_dict(), indent=2))
    if config.train.profile:
      _write_profile(config, out_dir, summary, trainer, last_args, traced_steps, trace_dir, load_sum)
  return summary


def _log_value(v) -> str:
  """A step record's value in the log line: counts and capacities exactly (a 4-digit rounding
  printed 12,288 exchange rows as 1.229e+04), measurements to 4 significant digits."""
  return str(int(v)) if isinstance(v, (int, np.integer)) else f"{v:.4g}"


def _out_of_time(run_start: float, max_seconds: float) -> bool:
  """Whether the run has used its time. Every process decides by process 0's clock: processes
  that stopped at different steps would leave the others blocked in the next step's collectives."""
  out = time.perf_counter() - run_start > max_seconds
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    out = bool(multihost_utils.broadcast_one_to_all(np.asarray(out)))
  return out


def _extra(step: int, shape, stages: int, step_shapes: dict[str, int]) -> dict[str, Any]:
  """Checkpoint `extra`: the data iterator's state (the step), the model shape it belongs to,
  the pipeline stages of its parameter layout, and the step capacities (`StepShapes.sizes`)
  its steps had reached, so a resumed run does not compile its way back up to them."""
  return {"step": step, "model": dataclasses.asdict(shape), "pipeline_stages": stages,
          "step_shapes": step_shapes}


def restore_any_layout(checkpointer, trainer, state, expect: dict[str, Any]) -> tuple[Any, dict]:
  """Restores the latest checkpoint into `state`'s shardings, whatever the pipeline stages it was
  saved with (`extra["pipeline_stages"]`, 1 when absent): a checkpoint of another layout is read
  in its own layout (shardings XLA derives from the current ones through the relayout) and
  converted (`Trainer.relayout`), so a run can resume with more, fewer or no pipeline stages."""
  import jax

  step, stored = checkpointer.read_extra()  # restore that same step below
  saved, now = int(stored.get("pipeline_stages", 1)), trainer.stages
  abstract = lambda tree, shardings: jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
  current = jax.tree.map(lambda x: x.sharding, state)
  if saved == now:
    return checkpointer.restore(step, abstract_state=abstract(state, current), expect=expect)
  to_saved = jax.jit(lambda s: trainer.relayout(s, now, saved))
  saved_shardings = to_saved.lower(state).compile().output_shardings
  restored, extra = checkpointer.restore(
      step, abstract_state=abstract(jax.eval_shape(to_saved, state), saved_shardings), expect=expect)
  to_now = jax.jit(lambda s: trainer.relayout(s, saved, now), out_shardings=current)
  return to_now(restored), extra


def _peak_memory(devices) -> list[int] | None:
  """Peak bytes in use per device since start (None where the backend keeps no statistics)."""
  out = []
  for d in devices:
    try:
      stats = d.memory_stats()
    except Exception:  # some backends raise instead of returning None
      stats = None
    if not stats or "peak_bytes_in_use" not in stats:
      return None
    out.append(int(stats["peak_bytes_in_use"]))
  return out


def _write_profile(config, out_dir, summary, trainer, last_args, traced_steps, trace_dir, load_sum):
  """profile.json (compile time, step-time stats, per-phase breakdown, attention load) and the
  per-device load PNG."""
  report: dict[str, Any] = {
      "compile_s": summary.compile_s, "compile_count": summary.compile_count,
      "step_time": profile_lib.step_time_stats(summary.step_times_s[config.train.profile_warmup:]),
      "trace_dir": None, "traced_steps": traced_steps, "phases": None, "attention_load": None,
      "peak_memory_bytes": summary.peak_memory_bytes}
  xplane = profile_lib.find_xplane(trace_dir) if traced_steps else None
  if xplane is not None and last_args is not None:
    state, arrays, ctx = last_args
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    # Same shapes as the traced step: served from the jit cache, not recompiled.
    hlo = trainer.compiled_text(abstract, arrays, ctx)
    report["trace_dir"] = str(trace_dir)
    report["phases"] = profile_lib.phase_breakdown(xplane, hlo, module="train_step", steps=traced_steps)
  before, after = load_sum
  if before is not None:
    png = profile_lib.plot_loads(before, after, out_dir / "attention_load.png",
                                 title=f"attention load per device, {summary.steps} steps summed",
                                 step_imbalance=(summary.attention_imbalance, summary.attention_imbalance_after))
    report["attention_load"] = {
        "before": [float(x) for x in before], "after": None if after is None else [float(x) for x in after],
        # Mean over steps of each step's max/mean (the sums above even out over steps).
        "imbalance_before": summary.attention_imbalance,
        "imbalance_after": summary.attention_imbalance_after, "png": str(png)}
  profile_lib.write_report(out_dir, report)


def _check_finite(step: int, m) -> None:
  if not math.isfinite(float(m["loss"])):
    raise NonFiniteError(f"step {step + 1}: loss is {float(m['loss'])}")
  if not bool(m["grads_finite"]):
    raise NonFiniteError(f"step {step + 1}: gradients contain NaN or Inf (grad_norm={float(m['grad_norm'])})")


def _tensorboard(out_dir: Path, enabled: bool):
  if not enabled:
    return None
  from tensorboardX import SummaryWriter

  return SummaryWriter(str(out_dir / "tb"))


def _progress(enabled: bool, start: int, total: int):
  if not enabled:
    return None
  from tqdm import tqdm

  return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)


def format_summary(s: Summary) -> str:
  med = float(np.median(s.step_times_s)) if s.step_times_s else float("nan")
  lines = [
      f"devices {s.devices} mesh {s.mesh_shape}; steps {s.steps}; compiled {s.compile_count}x"
      + (f"; pipeline: {s.microbatches} micro-batches, bubble {s.pipeline_bubble:.0%}"
         if s.mesh_shape.get("pipe", 1) > 1 else ""),
      f"loss {s.losses[0]:.4f} -> {s.losses[-1]:.4f}" if s.losses else "no steps run",
      f"compile+init {s.compile_s:.1f}s; median step {med * 1e3:.1f} ms; {s.tokens_per_s:,.0f} tokens/s",
      f"MFU {s.mfu * 100:.1f}%" if s.mfu is not None else "MFU n/a (unknown peak: set train.peak_tflops)",
      f"attention imbalance (max/mean) colocated {s.attention_imbalance:.2f}"
      + (f", scheduled {s.attention_imbalance_after:.2f}" if s.attention_imbalance_after is not None else "")
      + f"; host wait {s.host_wait_s:.2f}s",
  ]
  if s.colocated_steps:
    lines.append(f"CAD on {s.steps - s.colocated_steps} of {s.steps} steps; the others ran "
                 f"colocated attention (predicted saving below attention.min_gain, or imbalance "
                 f"below attention.min_imbalance)")
  if s.peak_memory_bytes:
    lines.append(f"peak memory per device {max(s.peak_memory_bytes) / 2**30:.2f} GiB (max over local devices)")
  return "\n".join(lines)
