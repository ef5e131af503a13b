"""What a training run reports: each step's record (TensorBoard, the progress bar or a log line),
and at its end the `Summary` record (summary.json), its text form, and the profile report
(profile.json, attention_load.png) of a profiled run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from distca_jax.train import profile as profile_lib


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
  # Mean max/mean attention imbalance the CAD scheduler reaches (None: not planned). In a
  # colocated run (`attention`) it is what CAD's plan would reach, computed but not run.
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
  # attention.impl of the run: "colocated" or "distca".
  attention: str = "colocated"
  # The run's directory (config.json, summary.json, checkpoints/, tb/).
  out_dir: str = ""
  # The checkpoint of the state the run ended with: committed by this invocation, or that step's
  # checkpoint already there (None: none).
  saved_step: int | None = None
  # Checkpoints newer than the one the run resumed from, renamed (kept) so the run saves those
  # steps again: "step s (why) -> new path" (None: none moved).
  moved_aside: list[str] | None = None
  # The signal that stopped the run at a step boundary ("SIGTERM", "SIGINT"; None: not stopped).
  interrupted: str | None = None
  # data.packing of the run ("in_order", or "wlb": the WLB-LLM baseline, whose attention
  # imbalance above is its own packing's); with wlb, the mean over steps of each step's max /
  # mean real tokens per device, and the steps per CP group size that ran (1: no K/V gather).
  packing: str = "in_order"
  token_imbalance: float | None = None
  wlb_cp_steps: dict[int, int] | None = None
  # The blocks' remat policy the step ran and why (model.remat=auto: which candidates fit).
  remat: str = ""
  # Tokens each data source (data.mixture's by name) gave the run's steps, from step 0.
  data_tokens: dict[str, int] | None = None
  # Held-out evaluations (`evaluate.EvalResult` as dicts, in step order; eval.every) and the
  # last one's loss (None: none ran); the forward step's compilations (one per kind of context).
  evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  eval_loss: float | None = None
  eval_compile_count: int = 0
  # CAD steps: the rows the exchange moved between devices per layer, mean over the steps that
  # ran CAD ({"query": ..., "kv": ...}; `metrics.moved_rows`); None: no CAD step ran.
  moved_rows: dict[str, float] | None = None

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def format_summary(s: Summary) -> str:
  """The summary as the launcher prints it: a few lines, one topic each."""
  med = float(np.median(s.step_times_s)) if s.step_times_s else None
  timing = (f"median step {med * 1e3:.1f} ms; {s.tokens_per_s:,.0f} tokens/s" if med is not None
            else "median step n/a (every step compiled; run more steps to time one)")
  imbalance = f"attention imbalance (max/mean) colocated {s.attention_imbalance:.2f}"
  if s.packing == "wlb":
    groups = ", ".join(f"{k} on {v}" for k, v in sorted((s.wlb_cp_steps or {}).items()))
    imbalance = (f"packing wlb (CP group size: steps {groups}); attention imbalance (max/mean) "
                 f"{s.attention_imbalance:.2f}, tokens {s.token_imbalance or 1.0:.2f}")
  if s.attention_imbalance_after is not None:
    imbalance += (f", CAD-scheduled {s.attention_imbalance_after:.2f}" if s.attention == "distca"
                  else f"; CAD's plan would reach {s.attention_imbalance_after:.2f} "
                       f"(planned, not run: attention.impl=distca runs it)")
  lines = [
      f"devices {s.devices} mesh {s.mesh_shape}; steps {s.steps}; compiled {s.compile_count}x"
      + (f"; pipeline: {s.microbatches} micro-batches, bubble {s.pipeline_bubble:.0%}"
         if s.mesh_shape.get("pipe", 1) > 1 else
         f"; {s.microbatches} micro-batches a step (gradient accumulation)" if s.microbatches > 1
         else ""),
      f"loss {s.losses[0]:.4f} -> {s.losses[-1]:.4f}" if s.losses else "no steps run",
      f"compile+init {s.compile_s:.1f}s; {timing}",
      f"MFU {s.mfu * 100:.1f}%" if s.mfu is not None else "MFU n/a (unknown peak: set train.peak_tflops)",
      imbalance + f"; host wait {s.host_wait_s:.2f}s",
  ]
  if s.data_tokens and len(s.data_tokens) > 1:  # a mixture: what each source gave
    total = sum(s.data_tokens.values()) or 1
    lines.append("data: " + ", ".join(f"{k} {v:,} tokens ({v / total:.1%})"
                                      for k, v in s.data_tokens.items()))
  if s.colocated_steps is not None and s.steps:
    if s.colocated_steps:
      lines.append(f"CAD on {s.steps - s.colocated_steps} of {s.steps} steps; the others ran "
                   f"colocated attention (predicted saving below attention.min_gain, or imbalance "
                   f"below attention.min_imbalance)")
    else:
      lines.append(f"CAD on {s.steps} of {s.steps} steps")
  if s.moved_rows:
    lines.append(f"exchange moved {s.moved_rows['query']:,.0f} query rows and "
                 f"{s.moved_rows['kv']:,.0f} K/V rows a layer per CAD step (mean)")
  if s.evals:
    last = s.evals[-1]
    by_position = ", ".join(f"{name} {loss:.3f}" for name, loss in
                            zip(last["buckets"], last["bucket_loss"]) if loss is not None)
    lines.append(f"eval loss {last['loss']:.4f} (perplexity {last['perplexity']:.2f}) at step "
                 f"{last['step']} on {last['tokens']:,} held-out tokens; by position {by_position}")
  if s.remat:
    lines.append(f"remat {s.remat}")
  if s.peak_memory_bytes:
    lines.append(f"peak memory per device {max(s.peak_memory_bytes) / 2**30:.2f} GiB (max over local devices)")
  if s.interrupted:
    saved = (f"checkpoint at step {s.saved_step}" if s.saved_step is not None
             else "no checkpoint (checkpoint.every=0)")
    lines.append(f"stopped by {s.interrupted} after step {s.start_step + s.steps}; {saved}; "
                 f"resume: the same command with train.out_dir={s.out_dir}")
  return "\n".join(lines)


def peak_memory(devices) -> list[int] | None:
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


def write_profile(config, out_dir: Path, summary: Summary, trainer, last_args, traced_steps: int,
                  trace_dir: Path, load_sum) -> None:
  """profile.json (compile time, step-time stats, per-phase breakdown, attention load) and the
  per-device load PNG."""
  import jax

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


class StepReporter:
  """Each step's record to TensorBoard (`<out_dir>/tb`, every `log_every` steps), the progress
  bar or a log line; only where `main` (process 0). Adds the peak memory of `local_devices`
  (where the backend keeps statistics) to the record."""

  def __init__(self, out_dir: Path, *, main: bool, tensorboard: bool, progress: bool,
               log_every: int, first_step: int, last_step: int, local_devices, log):
    self.main, self.log_every, self.local_devices, self.log = main, log_every, local_devices, log
    self.writer = None
    if tensorboard and main:
      from tensorboardX import SummaryWriter

      self.writer = SummaryWriter(str(out_dir / "tb"))
    self.bar = None
    if progress and main:
      from tqdm import tqdm

      self.bar = tqdm(total=last_step, initial=first_step, desc="train", unit="step",
                      dynamic_ncols=True)

  def __call__(self, step: int, record: dict[str, float]) -> None:
    memory = peak_memory(self.local_devices)
    if memory is not None:
      record["peak_memory_gib"] = max(memory) / 2**30
    if self.writer is not None and step % self.log_every == 0:
      for key, value in record.items():
        self.writer.add_scalar(f"train/{key}", value, step + 1)
      for d, b in zip(self.local_devices, memory or ()):
        self.writer.add_scalar(f"memory/peak_gib/device{d.id}", b / 2**30, step + 1)
    if self.bar is not None:
      self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
      self.bar.update(1)
    elif self.main and step % self.log_every == 0:
      self.log(f"step {step + 1}: " + " ".join(f"{k}={_log_value(v)}" for k, v in record.items()))

  def scalars(self, prefix: str, values: dict[str, float], step: int) -> None:
    """`values` to TensorBoard as `<prefix>/<key>` at `step` (an evaluation's)."""
    if self.writer is not None:
      for key, value in values.items():
        self.writer.add_scalar(f"{prefix}/{key}", value, step)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
    if self.writer is not None:
      self.writer.close()


def _log_value(v) -> str:
  """A step record's value in the log line: counts and capacities exactly (a 4-digit rounding
  printed 12,288 exchange rows as 1.229e+04), measurements to 4 significant digits."""
  return str(int(v)) if isinstance(v, (int, np.integer)) else f"{v:.4g}"
