"""The training loop: data prefetch, jitted steps, metrics, TensorBoard, checkpoints, summary.

`run` reads as its steps: set up the run (mesh, trainer, data, the run's directory, resume), train
step by step until the last step or a stop, then write the summary.

Host work for step k+1 (sampling documents, packing, the attention context — for CAD the
scheduler's plan) runs in a background thread while the devices run step k; `host_wait_s` in the
summary is the total time the loop waited for it (0 means the host never stalled the devices).

Resuming. The data source is a pure function of the step (`source.batch(step)`), so the data
iterator's state is the step counter, saved in each checkpoint's `extra` with the model shape.
A run resumed from step s therefore trains on exactly the batches and learning rates the
uninterrupted run would have, and its losses are identical. A run into a directory with
checkpoints resumes from the newest good one (`checkpoint.step` picks another); one that is
unreadable, unlike its checksums or not finite is skipped, saying so in one line, and renamed
aside so the run saves that step again. Every check that can refuse a run into an existing
directory runs before anything is written there. Checkpoints are taken every
`checkpoint.every` steps and where the run ends.

Stopping. `train.stop_at_step`, `train.max_seconds`, SIGTERM and SIGINT end a run at a step
boundary with a checkpoint and the summary (`stopping.py`); a signal's run reports it
(`Summary.interrupted`) and the launcher exits with 128 + its number. No state is saved before
its step's update is checked: a NaN or Inf in the loss, the gradients or the updated parameters
or optimizer moments stops the run (`NonFiniteError`, naming the step, the quantity and the first
bad leaf) with the last good checkpoint as the newest.

Multi-process. Every process runs this loop on the same global batch (each supplies the shards
its devices hold) and plans it alike: at the start they check that they run one config, before
each step that they planned the same (`agreement`), and all stop naming a process that differs. Metrics are replicated
scalars, so every process reads the same values. Only
process 0 writes files (config.json, summary.json, TensorBoard, profile); all processes take part
in checkpoint saves (each writes its own shards).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import jax
import numpy as np

from distca_jax.compile_cache import enable_compile_cache
from distca_jax.config import Config
from distca_jax.data.mixture import data_layout
from distca_jax.train import agreement, evaluate
from distca_jax.train import metrics as metrics_lib
from distca_jax.train import profile as profile_lib
from distca_jax.train import stopping
from distca_jax.train.agreement import PlanDisagreementError
from distca_jax.train.finite import NonFiniteError, check_step
from distca_jax.train.job import Job, make_source, set_up
from distca_jax.train.prefetch import Prefetcher, host_item
from distca_jax.train.resume import restore_any_layout
from distca_jax.train.summary import (StepReporter, Summary, format_summary, peak_memory,
                                      write_profile)

__all__ = ["NonFiniteError", "PlanDisagreementError", "Summary", "format_summary", "make_source", "restore_any_layout", "run"]


@dataclasses.dataclass
class Progress:
  """The state and what the loop accumulates step by step for the summary."""

  state: Any
  losses: list[float] = dataclasses.field(default_factory=list)
  times: list[float] = dataclasses.field(default_factory=list)  # steps neither compiled nor traced
  flops_done: float = 0.0
  tokens_done: float = 0.0
  host_wait: float = 0.0
  compile_s: float = 0.0
  imbalances: list[float] = dataclasses.field(default_factory=list)
  imbalances_after: list[float] = dataclasses.field(default_factory=list)
  token_imbalances: list[float] = dataclasses.field(default_factory=list)  # data.packing=wlb
  wlb_cp_steps: dict[int, int] = dataclasses.field(default_factory=dict)  # CP size -> steps
  load_sum: list = dataclasses.field(default_factory=lambda: [None, None])  # before / after
  colocated_steps: int | None = None
  step_sizes: dict[str, int] = dataclasses.field(default_factory=dict)  # capacities as of the step
  saved_step: int | None = None
  interrupted: str | None = None
  tracing: bool = False
  traced_steps: int = 0
  last_args: Any = None     # (state, arrays, ctx) of the last traced step, for the profile
  evals: list = dataclasses.field(default_factory=list)  # evaluate.EvalResult, in step order
  moved_rows: list = dataclasses.field(default_factory=list)  # CAD steps: (query, K/V) rows moved


def run(config: Config, *, devices=None, log=print, name: str = "run") -> Summary:
  """Trains `config` from step 0 or the run directory's newest good checkpoint to
  `config.train.steps` (or an earlier stop), and returns the summary (also in summary.json).

  `name` names the run's directory when `train.out_dir` is unset (`rundir.choose`). SIGTERM and
  SIGINT stop it after the step they arrive in (`Summary.interrupted`). Raises NonFiniteError,
  ConfigError (a directory that cannot be reused, a disk too small) and the checkpoint errors.
  """
  if config.train.compile_cache_dir:
    enable_compile_cache(config.train.compile_cache_dir)
  with stopping.StopSignals() as signals:
    job, state = set_up(config, devices, log, name)
    if job.start_step >= job.last_step:
      log(f"{job.out_dir}: complete at step {job.start_step} (train.steps={config.train.steps}); "
          f"raise train.steps to train on")
      if job.checkpointer is not None:
        job.checkpointer.close()
      return _summary(job, Progress(state=state))
    progress = _train(job, state, signals, log)
  summary = _summary(job, progress)
  if job.main:
    (job.out_dir / "summary.json").write_text(json.dumps(summary.as_dict(), indent=2))
    if config.train.profile:
      write_profile(job.config, job.out_dir, summary, job.trainer, progress.last_args,
                    progress.traced_steps, job.out_dir / "trace", progress.load_sum)
  return summary


# ----------------------------------------------------------------------------- the loop


def _train(job: Job, state, signals: stopping.StopSignals, log) -> Progress:
  """Runs steps start_step .. last_step - 1, checkpointing as configured, until the end or a stop
  every process agrees on; the final checkpoint is taken where the run ends."""
  c = job.config
  colocated = 0 if c.attention.impl == "distca" and job.trainer.pipeline is None else None
  p = Progress(state=state, colocated_steps=colocated)
  report = StepReporter(job.out_dir, main=job.main, tensorboard=c.train.tensorboard,
                        progress=c.train.progress, log_every=c.train.log_every,
                        first_step=job.start_step, last_step=job.last_step,
                        local_devices=_local_devices(job.mesh), log=log)
  prefetch = Prefetcher(lambda step: host_item(job, step), job.start_step, job.last_step)
  run_start = time.perf_counter()
  try:
    for _ in range(job.start_step, job.last_step):
      step, record = _run_step(job, p, prefetch)
      if step == job.start_step and job.main:  # model.remat=auto decides at the first compile
        log(f"remat {job.trainer.remat}: {job.trainer.remat_reason}")
      report(step, record)
      if job.evaluator is not None and evaluate.due(step + 1, c.eval.every, job.last_step):
        _evaluate(job, p, report, step + 1, log)
      if job.checkpointer is not None:
        job.checkpointer.check_saves()  # a background save that failed stops the run now
        if (step + 1) % c.checkpoint.every == 0:
          _save(job, p, step + 1)
      signum, out_of_time = stopping.agree(signals, run_start, c.train.max_seconds)
      if signum or out_of_time:
        p.interrupted = stopping.signal_name(signum)
        if job.main:
          log(f"stopping at step {step + 1}: " + (f"{p.interrupted} received" if signum else
                                                  f"train.max_seconds={c.train.max_seconds} reached"))
        break
    end = job.start_step + len(p.losses)
    if job.evaluator is not None and p.losses and p.interrupted is None and (
        not p.evals or p.evals[-1].step != end):  # where the run ends (train.max_seconds)
      _evaluate(job, p, report, end, log)
    if job.checkpointer is not None and p.losses:
      _save(job, p, end)  # where the run ends (a no-op if just saved)
  except BaseException:
    _close(job, p, prefetch, report, quiet=True)
    raise
  _close(job, p, prefetch, report, quiet=False)
  return p


def _run_step(job: Job, p: Progress, prefetch: Prefetcher) -> tuple[int, dict[str, float]]:
  """One step: its inputs from the prefetcher, the jitted update, the checks on its results
  (before anything of it can be saved), and its record for the log."""
  c, trainer = job.config, job.trainer
  t_wait = time.perf_counter()
  step, batch, ctx, (load_before, load_after), p.step_sizes, digest = prefetch.get()
  p.host_wait += time.perf_counter() - t_wait if step > job.start_step else 0.0
  if digest is not None:  # several processes: they must have planned the same step
    agreement.check_agreement(step, digest)
  if c.train.profile and job.main and step + 1 == c.train.profile_start:
    (job.out_dir / "trace").mkdir(parents=True, exist_ok=True)
    jax.profiler.start_trace(str(job.out_dir / "trace"), profiler_options=profile_lib.trace_options())
    p.tracing = True
  t_step = time.perf_counter()
  compiles_before = trainer.compile_count()
  if trainer.accumulates:
    placed = []  # the last micro-batch's device inputs, for the profile

    def micro_inputs():  # each placed when its turn comes, while the one before runs
      for b, x in zip(ctx.micro, ctx.contexts):
        placed[:] = trainer.put_batch(b, x)
        yield placed

    p.state, m = trainer.accumulate_step(p.state, micro_inputs(), ctx.step_tokens)
    arrays, ctx_dev = placed
  else:
    arrays, ctx_dev = trainer.put_batch(batch, ctx)
    p.state, m = trainer.step(p.state, arrays, ctx_dev)
  m = jax.device_get(m)  # replicated scalars: every process holds them
  dt = time.perf_counter() - t_step
  compiled = trainer.compile_count() != compiles_before
  if p.tracing:
    p.traced_steps += 1
    p.last_args = (p.state, arrays, ctx_dev)
    if p.traced_steps == c.train.profile_steps:
      jax.profiler.stop_trace()
      p.tracing = False
  elif compiled:
    p.compile_s += dt  # this step's time is dominated by compilation
  else:
    p.times.append(dt)
  check_step(step, m, p.state)
  return step, _record(job, p, m, dt, compiled, batch, ctx, load_before, load_after)


def _record(job: Job, p: Progress, m, dt: float, compiled: bool, batch, ctx, load_before,
            load_after) -> dict[str, float]:
  """The step's log record; adds the step to the run's totals in `p`."""
  loss = float(m["loss"])
  p.losses.append(loss)
  flops = metrics_lib.step_flops(job.trainer.shape, batch.layout)
  ran_cad = None
  if p.colocated_steps is not None:  # a distca step the gate stopped runs colocated
    ran_cad = ctx.cad
    p.colocated_steps += not ran_cad
  # A pipelined step's loads are summed over its ticks (an accumulated one's over its
  # micro-batches); each tick waits for its slowest device, so its imbalance is the mean over
  # ticks of each tick's.
  several = job.trainer.pipeline is not None or job.trainer.accumulates
  tick_imbalance = ctx.imbalance() if several else None
  imb = tick_imbalance[0] if tick_imbalance else metrics_lib.imbalance(load_before)
  p.imbalances.append(imb)
  p.load_sum[0] = load_before if p.load_sum[0] is None else p.load_sum[0] + load_before
  record = {"loss": loss, "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
            "step_s": dt, "tokens_per_s": float(m["tokens"]) / dt, "attention_imbalance": imb,
            "compile_count": job.trainer.compile_count()}
  if ran_cad is not None:
    # 1: CAD ran, 0: gated (attention.gate / min_imbalance); accumulating, the share of the
    # micro-batches it ran on.
    record["cad"] = ctx.cad_share if job.trainer.accumulates else float(ran_cad)
  if ran_cad:  # what the gate predicted this step's plans save (a fraction of the step)
    record["cad_predicted_saving"] = ctx.predicted_saving
    record["nano_batches"] = len(ctx.batches)  # streams: 2 with ping-pong
    # 1: a plan stopped short of attention.epsilon (stuck, the move cap, or no gain).
    record["plan_short"] = float(any(p.stats.short for p in ctx.plans))
    # The run's exchange capacities, what the exchange sends.
    record.update(job.config.attention.transport().log_rows(ctx.capacities))
    record.update(metrics_lib.moved_rows(ctx.plans))
    p.moved_rows.append((record["moved_q_rows"], record["moved_kv_rows"]))
  if load_after is not None:
    p.imbalances_after.append(tick_imbalance[1] if tick_imbalance else metrics_lib.imbalance(load_after))
    record["attention_imbalance_after"] = p.imbalances_after[-1]
    p.load_sum[1] = load_after if p.load_sum[1] is None else p.load_sum[1] + load_after
  if job.config.data.packing == "wlb":  # the CP size that ran, how unequal the tokens are
    record.update(ctx.record())  # wlb_attention.WlbStep
    p.token_imbalances.append(record["token_imbalance"])
    cp = int(record["wlb_cp"])
    p.wlb_cp_steps[cp] = p.wlb_cp_steps.get(cp, 0) + 1
  if job.config.data.mixture:  # tokens each source has given the run, through this step
    steps = job.start_step + len(p.losses)
    record.update({f"tokens_{k}": v for k, v in job.tokens_by_source(steps).items()})
  peak = _peak_flops(job)
  if peak is not None:
    record["mfu"] = flops / dt / (peak * job.mesh.size)
  if not compiled:
    p.flops_done += flops
    p.tokens_done += float(m["tokens"])
  return record


def _evaluate(job: Job, p: Progress, report, step: int, log) -> None:
  """The held-out loss of the state after `step` steps, to the log, TensorBoard and the summary."""
  result = job.evaluator(p.state.params, step)
  p.evals.append(result)
  report.scalars("eval", result.scalars(), step)
  if job.main:
    log(result.line())


def _save(job: Job, p: Progress, step: int) -> None:
  """Checkpoints the state as step `step` unless that step is saved already."""
  c = job.config
  extra = {"step": step, "model": job.trainer.shape.record(),
           "pipeline_stages": job.trainer.stages, "step_shapes": p.step_sizes,
           "data": {"layout": data_layout(c.data, job.mesh.shape["data"], c.train.microbatches),
                    "tokens_by_source": job.tokens_by_source(step)}}
  # `extra`: the data iterator's state (the step), the model shape it belongs to, the pipeline
  # stages of its parameter layout, and the step capacities its steps had reached, so a resumed
  # run does not compile its way back up to them; the data layout a resume must continue and the
  # tokens each source gave.
  if p.saved_step != step and (job.checkpointer.maybe_save(step, p.state, extra, force=True)
                               or step in job.checkpointer.all_steps()):
    p.saved_step = step  # saved now, or that step's checkpoint is already there


def _close(job: Job, p: Progress, prefetch: Prefetcher, report, quiet: bool) -> None:
  """Ends the prefetcher, the trace, the reporter and the checkpointer (waiting for its last
  save). `quiet`: an error is already on its way out; a second one must not replace it."""
  prefetch.close()
  if p.tracing:
    jax.profiler.stop_trace()
    p.tracing = False
  report.close()
  if job.checkpointer is not None:
    try:
      job.checkpointer.close()
    except Exception:
      if not quiet:
        raise


# ----------------------------------------------------------------------------- summary


def _summary(job: Job, p: Progress) -> Summary:
  times, trainer, mesh = p.times, job.trainer, job.mesh
  steady = sum(times)
  stats = profile_lib.step_time_stats(times)
  peak = _peak_flops(job)
  bubble = 0.0
  if trainer.pipeline is not None:
    from distca_jax.train import pipeline_host

    bubble = pipeline_host.Schedule(trainer.stages, job.config.train.microbatches).bubble_fraction
  return Summary(
      steps=len(p.losses), losses=p.losses, step_times_s=times, compile_s=p.compile_s + job.init_s,
      compile_count=trainer.compile_count(),
      tokens_per_s=p.tokens_done / steady if steady else float("nan"),
      mfu=(p.flops_done / steady / (peak * mesh.size)) if (peak and steady) else None,
      host_wait_s=p.host_wait,
      attention_imbalance=float(np.mean(p.imbalances)) if p.imbalances else 1.0,
      devices=mesh.size, mesh_shape=dict(mesh.shape), start_step=job.start_step,
      attention_imbalance_after=float(np.mean(p.imbalances_after)) if p.imbalances_after else None,
      step_time_median_s=stats["median_s"], step_time_p90_s=stats["p90_s"],
      peak_memory_bytes=peak_memory(_local_devices(mesh)),
      microbatches=job.config.train.microbatches, pipeline_bubble=bubble,
      colocated_steps=p.colocated_steps, step_shapes=job.shapes.growths,
      attention=job.config.attention.impl, out_dir=str(job.out_dir), saved_step=p.saved_step,
      moved_aside=job.moved_aside or None,
      interrupted=p.interrupted, packing=job.config.data.packing,
      token_imbalance=float(np.mean(p.token_imbalances)) if p.token_imbalances else None,
      wlb_cp_steps=dict(p.wlb_cp_steps) or None,
      remat=f"{trainer.remat} ({trainer.remat_reason})",
      data_tokens=job.tokens_by_source(job.start_step + len(p.losses)),
      **_eval_summary(job, p))


def _eval_summary(job: Job, p: Progress) -> dict[str, Any]:
  """The summary's evaluation and exchange fields."""
  out: dict[str, Any] = {"evals": [e.as_dict() for e in p.evals]}
  if p.evals:
    out["eval_loss"] = p.evals[-1].loss
  if job.evaluator is not None:
    out["eval_compile_count"] = job.evaluator.compile_count()
  if p.moved_rows:
    q, kv = np.mean(p.moved_rows, axis=0)
    out["moved_rows"] = {"query": float(q), "kv": float(kv)}
  return out


# ----------------------------------------------------------------------------- small helpers


def _peak_flops(job: Job) -> float | None:
  return metrics_lib.peak_flops_per_device(job.mesh.devices.flat[0].device_kind,
                                           job.config.train.peak_tflops)


def _local_devices(mesh) -> list:
  return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
