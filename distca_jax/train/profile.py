"""Step profiling: step-time statistics, the per-phase breakdown of an xprof trace, and the
per-device attention load before and after the CAD scheduler.

Per-phase breakdown. The trace (`jax.profiler.trace`, an `.xplane.pb` that TensorBoard's profile
plugin opens) lists every executed HLO op with its duration and the device it ran on (GPU: the
device planes' "XLA Ops" lines; CPU: the host plane's thunk events, stat `device_ordinal`). The op
is mapped to the JAX name stack it came from (its `op_name` metadata, read from the compiled HLO
text, or the event's own `tf_op` stat where the GPU profiler records it), and the name stack to a
phase by these `jax.named_scope` names, the contract with the attention layers:

  core_attention  the attention kernel (both the colocated seam and the CAD servers)
  dispatch        sending Q/K/V rows to the attention servers (gathers + all_to_all)
  return          sending O back to the home devices

A scope counts when it is a whole component of the name stack (`.../dispatch/...`, also inside a
transform such as `transpose(jvp(dispatch))`), so the backward of each phase is counted with it.
`dispatch` and `return` take precedence over an enclosing `core_attention`. Everything else is
"other". Times are *busy* time: the sum of leaf op durations per device (nested events are counted
once, at the innermost level), averaged over devices and traced steps; on CPU XLA runs independent
ops of one device concurrently, so busy time can exceed the step's wall time.
"""

from __future__ import annotations

import collections
import glob
import json
import re
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from distca_jax.train import metrics as metrics_lib

# named_scope name -> phase. Keep in sync with distca_jax/dispatch/exchange.py and attention.py.
SCOPE_PHASES = (("dispatch", "dispatch"), ("return", "return"), ("core_attention", "attention"))
PHASES = ("attention", "dispatch", "return", "other")

_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name="([^"]*)"')


def step_time_stats(times_s: Iterable[float]) -> dict[str, float]:
  """Median and 90th percentile (seconds) of steady-state step times; NaN when there are none."""
  t = np.asarray(list(times_s), np.float64)
  if t.size == 0:
    return {"median_s": float("nan"), "p90_s": float("nan"), "count": 0}
  return {"median_s": float(np.median(t)), "p90_s": float(np.percentile(t, 90)), "count": int(t.size)}


def trace_options():
  """Profiler options: no Python tracer (it records millions of host events and slows the step
  many-fold), host and device tracers on."""
  import jax

  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  options.host_tracer_level = 2
  return options


def op_names(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> its `op_name` metadata (the JAX name stack), from compiled HLO text
  (`jitted.lower(...).compile().as_text()`)."""
  out = {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if m:
      out[m.group(1)] = m.group(2)
  return out


def phase_of(op_name: str) -> str:
  """Phase of an op from its name stack (see the module docstring for the contract)."""
  for scope, phase in SCOPE_PHASES:
    if re.search(rf"(^|[/(]){re.escape(scope)}($|[/)])", op_name):
      return phase
  return "other"


def _leaf_events(events: list[tuple[int, int, Any]]) -> list[tuple[int, int, Any]]:
  """Events (start_ns, duration_ns, payload) of one timeline that contain no other event."""
  events = sorted(events, key=lambda e: (e[0], -e[1]))
  leaves = []
  for i, (start, dur, payload) in enumerate(events):
    nxt = events[i + 1][0] if i + 1 < len(events) else None
    if nxt is None or nxt >= start + dur:
      leaves.append((start, dur, payload))
  return leaves


def find_xplane(trace_dir: str | Path) -> Path | None:
  """The newest `.xplane.pb` under a `jax.profiler.trace` directory."""
  files = sorted(glob.glob(str(Path(trace_dir) / "**" / "*.xplane.pb"), recursive=True))
  return Path(files[-1]) if files else None


# The parts of a one-device step (`step_parts`), by the named scopes of the model, the loss and
# the optimizer (models/llama.py, train/loss.py, train/step.py) and, outside them, the op: a
# matmul (the blocks' projections and MLP) or the rest (residual adds, casts, the embedding).
STEP_SCOPES = (("optimizer", "optimizer"), ("dispatch", "dispatch"), ("return", "return"),
               ("core_attention", "attention"), ("lm_head_loss", "lm_head_loss"),
               ("rmsnorm", "rmsnorm"), ("rope", "rope"), ("swiglu", "swiglu"))
STEP_PARTS = ("attention", "matmul", "lm_head_loss", "rmsnorm", "rope", "swiglu", "optimizer",
              "dispatch", "return", "other")


def step_part_of(op_name: str) -> str:
  """Part of the step an op belongs to (`STEP_PARTS`): its innermost-listed scope of
  `STEP_SCOPES`, else `matmul` for a dot, else `other`."""
  for scope, part in STEP_SCOPES:
    if re.search(rf"(^|[/(]){re.escape(scope)}($|[/)])", op_name):
      return part
  return "matmul" if re.search(r"(^|/)dot_general[^/]*$", op_name) else "other"


def step_parts(xplane_path: str | Path, hlo_text: str = "", module: str = "train_step",
               steps: int = 1, top_ops: int = 15) -> dict[str, Any]:
  """`phase_breakdown` by the parts of a step (`step_part_of`) instead of CAD's phases."""
  return phase_breakdown(xplane_path, hlo_text, module, steps, top_ops,
                         classify=step_part_of, phases=STEP_PARTS)


def phase_breakdown(xplane_path: str | Path, hlo_text: str = "", module: str = "train_step",
                    steps: int = 1, top_ops: int = 15, classify=phase_of,
                    phases: tuple[str, ...] = PHASES) -> dict[str, Any]:
  """Busy milliseconds per step and device of each phase, from a trace of `steps` steps.
  `classify` maps an op's name stack to one of `phases` (default: CAD's, `phase_of`).

  Only ops of HLO modules whose name contains `module` count. Returns {"ms_per_step": {phase:
  ms} (mean over devices), "per_device_ms": {device: {phase: ms}}, "fraction": {phase: share},
  "devices": n, "ops": n, "scoped": bool, "top_ops_ms": {op group: ms} (the `top_ops` largest
  `op_group`s)}; `scoped` is False
  when no op carried any of the contract's scopes (the attention layers were not annotated), so
  everything shows as "other".
  """
  from jax.profiler import ProfileData

  names = op_names(hlo_text)
  # GPU kernels are named after their HLO instruction with '.' -> '_' (loop_add_fusion_3).
  kernel_names = {k.replace(".", "_"): v for k, v in names.items()}
  data = ProfileData.from_file(str(xplane_path))
  busy = collections.defaultdict(float)  # (device, phase) -> ns
  by_op = collections.defaultdict(float)  # op group -> ns summed over devices
  devices = set()
  ops = 0
  for plane in data.planes:
    device_plane = plane.name.startswith("/device:")
    for line in plane.lines:
      # GPU: kernels on the "Stream #N" lines (raw trace) or the derived "XLA Ops" line; not both.
      if device_plane and not (line.name.startswith("Stream") or line.name == "XLA Ops"):
        continue
      per_device: dict[str, list] = collections.defaultdict(list)
      for ev in line.events:
        stats = dict(ev.stats)
        op = stats.get("hlo_op")
        if op is None:
          continue
        mod = str(stats.get("hlo_module", module))
        if module not in mod:
          continue
        device = plane.name if device_plane else f"cpu:{stats.get('device_ordinal', 0)}"
        per_device[device].append((ev.start_ns, ev.duration_ns, _op_name(ev.name, stats, names, kernel_names)))
      for device, events in per_device.items():
        devices.add(device)
        for _, dur, op_name in _leaf_events(events):
          busy[device, classify(op_name)] += dur
          by_op[op_group(op_name)] += dur
          ops += 1
  n_dev = max(1, len(devices))
  per_device = {d: {p: busy.get((d, p), 0.0) / 1e6 / max(1, steps) for p in phases}
                for d in sorted(devices)}
  ms = {p: sum(v[p] for v in per_device.values()) / n_dev for p in phases}
  total = sum(ms.values())
  top = sorted(by_op.items(), key=lambda kv: -kv[1])[:top_ops]
  return {"ms_per_step": ms, "per_device_ms": per_device,
          "fraction": {p: (ms[p] / total if total else 0.0) for p in phases},
          "devices": len(devices), "ops": ops, "scoped": any(ms[p] for p in phases if p != "other"),
          "top_ops_ms": {k: v / 1e6 / n_dev / max(1, steps) for k, v in top}}


def op_group(op_name: str) -> str:
  """A name stack without its step-specific parts (jit(...) and pipeline tick scopes, transform
  wrappers), keeping the last three components: ops of the same kind in every layer and tick
  fall into one group (e.g. `shard_map/jit(_take)/scatter-add`)."""
  parts = [p for p in op_name.split("/")
           if not re.match(r"(jit\(_?train_step\)|pipeline_(forward|backward)_\d+)$", p)]
  parts = [re.sub(r"^(?:\w+\()+|\)+$", "", p) for p in parts]
  parts = [p for p in parts if p]
  return "/".join(parts[-3:]) or "(unattributed)"


def _op_name(event_name: str, stats: dict, names: dict, kernel_names: dict) -> str:
  """The name stack of a traced op: the event's own `tf_op` where the profiler recorded one,
  else its HLO op's metadata; a kernel inside a GPU command buffer (whose `hlo_op` is the
  buffer) by its kernel name. Library kernels in a command buffer (cuBLAS) stay unattributed;
  launch/profile_steps.py turns command buffers off for that reason."""
  tf_op = str(stats.get("tf_op") or "")
  if "/" in tf_op:
    return tf_op
  op = str(stats.get("hlo_op"))
  if op in names:
    return names[op]
  return kernel_names.get(event_name, names.get(event_name, ""))


# ----------------------------------------------------------------------------- attention load


def attention_loads(ctx: Any, layout, shape, attention_config, tensor_parallel: int = 1,
                    plan_after: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
  """Per-device causal attention area (query-key pairs) before and after scheduling.

  "Before" is always the batch's own layout's load: what colocated attention runs, so a
  colocated and a distca run of the same batches log the same imbalance. Hook: a host context
  that carries the scheduler's plans (`ctx.plans`, e.g. `dispatch.StepContext`) reports their
  loads as "after", summed over nano-batches (ping-pong re-packs the batch's documents into two
  half-length layouts, which alone often evens the load out; the plans then balance each).
  Otherwise, when `plan_after`, "after" is what `schedule.make_plan` would reach on this layout
  (planned on the host, not executed); None when not planned.
  """
  before = metrics_lib.attention_load_per_device(layout)
  plans = getattr(ctx, "plans", None)
  if plans:
    return before, sum(np.asarray(p.stats.load_after, np.float64) for p in plans)
  if not plan_after:
    return before, None
  from distca_jax.dispatch.host import planner_nodes
  from distca_jax.schedule.cost import CommModel
  from distca_jax.schedule.plan import make_plan

  comm = CommModel.for_model(shape, tensor_parallel=tensor_parallel)
  plan = make_plan(layout, comm, epsilon=attention_config.epsilon,
                   min_imbalance=attention_config.min_imbalance_for(pipelined=False),
                   nodes=planner_nodes(attention_config, layout))
  return before, np.asarray(plan.stats.load_after, np.float64)


def plot_loads(before: np.ndarray, after: np.ndarray | None, path: str | Path, title: str = "",
               step_imbalance: tuple[float, float | None] | None = None) -> Path:
  """Bar chart of per-device attention load (query-key pairs, summed over the steps given),
  colocated vs scheduled, with max/mean imbalance in the legend: of the bars, or, if given,
  `step_imbalance` (the mean over steps of each step's imbalance, before and after: what sets
  step time, since a sum over steps evens out). Writes a PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  before = np.asarray(before, np.float64)
  x = np.arange(before.size)
  fig, ax = plt.subplots(figsize=(max(5.0, 0.5 * before.size + 2), 3.5), dpi=100)
  width = 0.4 if after is not None else 0.8
  if step_imbalance is not None and (after is None or step_imbalance[1] is not None):
    imb_before, imb_after = step_imbalance
    what = "mean per-step imbalance"
  else:
    imb_before = metrics_lib.imbalance(before)
    imb_after = None if after is None else metrics_lib.imbalance(np.asarray(after, np.float64))
    what = "imbalance"
  ax.bar(x - (width / 2 if after is not None else 0), before, width,
         label=f"without scheduler ({what} {imb_before:.2f})", color="tab:red")
  if after is not None:
    after = np.asarray(after, np.float64)
    ax.bar(x + width / 2, after, width,
           label=f"with scheduler ({what} {imb_after:.2f})", color="tab:blue")
  ax.axhline(float(before.mean()), color="gray", lw=0.8, ls="--")
  ax.set_xlabel("device (data rank)")
  ax.set_ylabel("attention load (query-key pairs)")
  ax.set_xticks(x)
  ax.set_title(title or "per-device core-attention load")
  ax.legend(fontsize=8)
  fig.tight_layout()
  path = Path(path)
  fig.savefig(path)
  plt.close(fig)
  return path


# ----------------------------------------------------------------------------- report


def write_report(out_dir: str | Path, report: dict[str, Any]) -> Path:
  path = Path(out_dir) / "profile.json"
  path.write_text(json.dumps(report, indent=2))
  return path


def format_report(r: dict[str, Any]) -> str:
  """Human-readable profile report (the dict `loop.run` writes to profile.json)."""
  st = r["step_time"]
  lines = [f"compile+init {r['compile_s']:.2f} s ({r['compile_count']} compilation(s) of the step)",
           f"step time after warm-up: median {st['median_s'] * 1e3:.1f} ms, p90 {st['p90_s'] * 1e3:.1f} ms "
           f"over {st['count']} steps"]
  ph = r.get("phases")
  if ph:
    parts = ", ".join(f"{p} {ph['ms_per_step'][p]:.2f} ms ({ph['fraction'][p] * 100:.0f}%)" for p in PHASES)
    lines.append(f"per-phase busy time per device per step: {parts}")
    if not ph["scoped"]:
      lines.append("  (no op carried a core_attention/dispatch/return named scope: all counted as other)")
  if r.get("trace_dir"):
    lines.append(f"trace: {r['trace_dir']} (tensorboard --logdir {r['trace_dir']}, Profile tab)")
  lb = r.get("attention_load")
  if lb:
    after = lb.get("imbalance_after")
    lines.append(f"attention imbalance (max/mean): without scheduler {lb['imbalance_before']:.2f}"
                 + (f", with scheduler {after:.2f}" if after is not None else ""))
    if lb.get("png"):
      lines.append(f"per-device load plot: {lb['png']}")
  return "\n".join(lines)
