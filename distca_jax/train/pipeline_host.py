"""A pipelined step's host side: the lock-step 1F1B tick order and each tick's plan.

`Schedule` is the tick order (docs/METHOD.md, "4D parallelism"); `host_context` plans one step
in the trainer's prefetch thread: every micro-batch (split into Ping and Pong with
`attention.pingpong`), each tick's layout over all S x data rows (`tick_layout`: stage s's rows
hold the micro-batch stage s runs in that tick, an idle stage's rows nothing), its attention
context (colocated tables, or CAD plans from `dispatch.plan_ticks`, which plans a tick's streams
together, `schedule.tick.plan_tick`), and the arrays the device step reads (`device_arrays`).
The device step that runs the ticks is `train/pipeline.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from distca_jax.colocated import colocated_contexts
from distca_jax.data.packing import Layout
from distca_jax.data.sources import Batch
from distca_jax.dispatch.host import plan_ticks, split_pingpong_batch
from distca_jax.gate import attention_load_per_device, imbalance
from distca_jax.mesh import ROW_AXES

# ----------------------------------------------------------------------------- schedule


@functools.partial(jax.tree_util.register_dataclass, data_fields=[],
                   meta_fields=["stages", "microbatches"])
@dataclasses.dataclass(frozen=True)
class Schedule:
  """The lock-step 1F1B tick order for S stages and M micro-batches (a pytree without leaves:
  static under jit)."""

  stages: int
  microbatches: int

  def __post_init__(self):
    if self.stages < 2 or self.microbatches < 1:
      raise ValueError(f"pipeline schedule needs >= 2 stages and >= 1 micro-batch, got "
                       f"{self.stages} stages, {self.microbatches} micro-batches")

  @property
  def num_ticks(self) -> int:
    """Forward ticks (= backward ticks)."""
    return self.microbatches + self.stages - 1

  @property
  def ticks(self) -> tuple[tuple[str, int], ...]:
    S, n = self.stages, self.num_ticks
    order = [("F", f) for f in range(min(S, n))]
    for b in range(n):
      order.append(("B", b))
      if b + S < n:
        order.append(("F", b + S))
    return tuple(order)

  def forward_mb(self, tick: int, stage: int) -> int | None:
    m = tick - stage
    return m if 0 <= m < self.microbatches else None

  def backward_mb(self, tick: int, stage: int) -> int | None:
    m = tick - (self.stages - 1 - stage)
    return m if 0 <= m < self.microbatches else None

  def forward_tick_of(self, mb: int, stage: int) -> int:
    return mb + stage

  @property
  def bubble_fraction(self) -> float:
    """Share of stage-ticks without a micro-batch: (S-1)/(M+S-1), forward and backward alike."""
    return (self.stages - 1) / self.num_ticks

  @property
  def max_in_flight(self) -> int:
    """Most micro-batches whose stage input one stage holds at once (the first stage's)."""
    return min(self.microbatches, 2 * self.stages - 1)



# ----------------------------------------------------------------------------- ticks


def tick_layout(layouts: list[Layout | None], num_buffers: int, buffer_len: int) -> Layout:
  """One layout over S x num_buffers rows: stage s's rows hold micro-batch layout s (or nothing).
  Ping-pong's Pong halves keep their `prior` shards, renumbered alike: each stage's prior buffers
  are that stage's rows of the Ping tick, which `tick_layout` numbers the same way."""
  keys = ("buffer", "buffer_offset", "doc", "doc_offset", "length")
  parts = {k: [] for k in ("doc_lens",) + keys}
  priors = {k: [] for k in keys}
  pong = [lay.prior is not None for lay in layouts if lay is not None]
  if any(pong) and not all(pong):
    raise ValueError("tick_layout: a tick mixes ping-pong's Pong halves with other layouts")
  docs = 0
  for s, lay in enumerate(layouts):
    if lay is None:
      continue
    if (lay.num_buffers, lay.buffer_len) != (num_buffers, buffer_len):
      raise ValueError(f"micro-batch layout is {lay.num_buffers} x {lay.buffer_len}, the "
                       f"pipeline expects {num_buffers} x {buffer_len}")
    for out, part in ((parts, lay),) + (((priors, lay.prior),) if lay.prior is not None else ()):
      out["buffer"].append(part.buffer + s * num_buffers)
      out["buffer_offset"].append(part.buffer_offset)
      out["doc"].append(part.doc + docs)
      out["doc_offset"].append(part.doc_offset)
      out["length"].append(part.length)
    parts["doc_lens"].append(lay.doc_lens)
    docs += lay.doc_lens.size
  cat = lambda d: {k: (np.concatenate(v) if v else np.zeros(0, np.int64)) for k, v in d.items()}
  rows = len(layouts) * num_buffers
  out = cat(parts)
  prior = (Layout(num_buffers=rows, buffer_len=buffer_len, doc_lens=out["doc_lens"], **cat(priors))
           if any(pong) else None)
  return Layout(num_buffers=rows, buffer_len=buffer_len, prior=prior, **out)


@dataclasses.dataclass(frozen=True)
class StepContext:
  """Host inputs of one pipelined step: the micro-batches and, per forward and per backward
  tick, the layout over all stages' rows and its attention context (colocated tables or a CAD
  plan), padded to common shapes across the step's ticks.

  With ping-pong (`num_streams` = 2) every micro-batch runs as its two nano-batches (Ping and Pong,
  `dispatch.split_pingpong_batch`), laid side by side in each row (Ping's half of the row, then
  Pong's), and a tick has one plan per stream: a context is then a (Ping, Pong) tuple."""

  schedule: Schedule
  microbatches: tuple[Batch, ...]
  forward: tuple[Layout, ...]    # each tick's layout of the micro-batches as loaded
  backward: tuple[Layout, ...]
  forward_ctx: Any    # attention context, leaves stacked [num_ticks, S * data, ...]; per stream
  backward_ctx: Any
  plans: tuple = ()   # the scheduler's plans (distca): forward ticks then backward, tick-major
  rows: np.ndarray | None = None  # the rows (stage-major) this process feeds; None: all
  # Per micro-batch, the streams it runs as ((batch,) or (Ping, Pong)); per tick, their layouts.
  streams: tuple[tuple[Batch, ...], ...] = ()
  forward_streams: tuple[tuple[Layout, ...], ...] = ()
  backward_streams: tuple[tuple[Layout, ...], ...] = ()

  @property
  def cad(self) -> bool:
    """Whether the ticks run CAD's exchange (the trainer's step-context protocol,
    `attention.StepContext`)."""
    return bool(self.plans)

  @property
  def num_streams(self) -> int:
    """Nano-batch streams per tick: 2 with ping-pong, else 1."""
    return len(self.streams[0])

  def device_inputs(self, batch: Batch):
    """(per-micro-batch and per-tick arrays, their specs by key), (the forward and backward
    ticks' contexts and the schedule, their spec) for the step; `batch` (`as_batch`) is not read."""
    ctx = {"forward": self.forward_ctx, "backward": self.backward_ctx, "schedule": self.schedule}
    return (self._device_arrays, ARRAY_SPECS), (ctx, CTX_SPEC)

  @functools.cached_property
  def _device_arrays(self) -> dict[str, np.ndarray]:
    # Built once: the prefetch thread asks first, so the training thread finds them ready.
    return device_arrays(self)

  def as_batch(self) -> Batch:
    """The step's micro-batches as one batch of M x data buffers (for token and FLOP counts).
    Its arrays are joined only when read: with ping-pong per tick the step trains on the halves,
    and the micro-batches' own arrays need never be built."""
    mbs = self.microbatches
    N, T = mbs[0].layout.num_buffers, mbs[0].layout.buffer_len
    names = ("tokens", "targets", "loss_mask", "segment_ids", "positions")
    return Batch.deferred(tick_layout([b.layout for b in mbs], N, T), rows=None, stream=None,
                          arrays=lambda: {k: np.concatenate([getattr(b, k) for b in mbs])
                                          for k in names})

  def _tick_loads_after(self) -> list[np.ndarray]:
    """Per forward tick, the per-device attention area its plans leave (its streams summed)."""
    k = self.num_streams
    return [sum(np.asarray(p.stats.load_after, np.float64) for p in self.plans[t * k:(t + 1) * k])
            for t in range(self.schedule.num_ticks)]

  def attention_loads(self) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-device causal attention area (query-key pairs) summed over the forward ticks, before
    scheduling (each stage computes its own rows) and after (the plans; None when colocated).
    Devices in row order: stage-major, data rank minor."""
    before = sum(attention_load_per_device(l).astype(np.float64) for l in self.forward)
    if not self.plans:
      return before, None
    return before, sum(self._tick_loads_after())

  def imbalance(self) -> tuple[float, float]:
    """Attention-area imbalance (max / mean over devices) before and after scheduling: the mean
    over forward ticks of each tick's (a tick waits for its slowest device). Colocated: after =
    before."""
    before = [imbalance(attention_load_per_device(l)) for l in self.forward]
    if not self.plans:
      return float(np.mean(before)), float(np.mean(before))
    return float(np.mean(before)), float(np.mean([imbalance(a) for a in self._tick_loads_after()]))


def host_context(attention_config, microbatches: list[Batch], stages: int, shape,
                 devices=None, shapes=None) -> StepContext:
  """Plans one pipelined step on the host (runs in the trainer's prefetch thread); `devices`:
  the rows (stage-major, as `mesh.ROW_AXES`) whose plans this process checks row by row;
  `shapes`: the run's `schedule.StepShapes`, so steps compile only when a capacity grows.

  CAD with `attention.pingpong` splits every micro-batch into Ping and Pong, and plans each
  tick's Ping rows and Pong rows on their own (two plans a tick, as an unpipelined step has two):
  one's exchange then has the other's projections and MLPs to hide under. Without it (or
  colocated) a tick is one stream and one plan. Every tick of a run has the same streams (their
  contexts stack into one compiled program), so the unpipelined step's fallback to one stream
  (`attention.pingpong_allow_single`) does not apply here."""
  schedule = Schedule(stages, len(microbatches))
  n = schedule.num_ticks
  N, T = microbatches[0].layout.num_buffers, microbatches[0].layout.buffer_len
  pingpong = attention_config.impl == "distca" and attention_config.pingpong
  streams = tuple(split_pingpong_batch(b) if pingpong else (b,) for b in microbatches)
  K = len(streams[0])

  def ticks(mb_of):
    """Per tick: its layout as loaded, and its streams' layouts."""
    whole, parts = [], []
    for t in range(n):
      mbs = [mb_of(t, s) for s in range(stages)]
      pick = lambda k: [None if m is None else streams[m][k].layout for m in mbs]
      whole.append(tick_layout([None if m is None else microbatches[m].layout for m in mbs], N, T))
      parts.append(tuple(tick_layout(pick(k), N, T // K) for k in range(K)))
    return tuple(whole), tuple(parts)

  fwd, fwd_streams = ticks(schedule.forward_mb)
  bwd, bwd_streams = ticks(schedule.backward_mb)
  flat = [lay for tick in fwd_streams + bwd_streams for lay in tick]  # tick-major, then stream
  if attention_config.impl == "colocated":
    ctxs, plans = colocated_contexts(flat, group=N, shapes=shapes), ()
  else:
    plans, ctxs = plan_ticks(attention_config, flat, shape, devices, shapes, streams=K)
  stack = lambda items: jax.tree.map(lambda *xs: np.stack(xs), *items)

  def per_stream(ticks_ctxs):  # [tick][stream] -> one stacked context, or a tuple per stream
    out = tuple(stack([c[k] for c in ticks_ctxs]) for k in range(K))
    return out if K > 1 else out[0]

  by_tick = [ctxs[i * K:(i + 1) * K] for i in range(2 * n)]
  return StepContext(schedule=schedule, microbatches=tuple(microbatches), forward=fwd, backward=bwd,
                     forward_ctx=per_stream(by_tick[:n]), backward_ctx=per_stream(by_tick[n:]),
                     plans=tuple(plans),
                     rows=None if devices is None else np.unique(np.asarray(devices, np.int64)),
                     streams=streams, forward_streams=fwd_streams, backward_streams=bwd_streams)


def device_arrays(ctx: StepContext) -> dict[str, np.ndarray]:
  """Per-micro-batch token arrays [M, data, T] and per-tick positions [ticks, S, data, T]; with
  ping-pong each row is Ping's row then Pong's."""
  S, N = ctx.schedule.stages, ctx.microbatches[0].layout.num_buffers

  def rows(lay):  # the process's rows only (the others zero, never written): its own work
    if ctx.rows is None:
      return lay.positions().reshape(S, N, -1)
    out = np.zeros((S * N, lay.buffer_len), np.int32)
    out[ctx.rows] = lay.positions(ctx.rows)
    return out.reshape(S, N, -1)

  side_by_side = lambda parts: np.concatenate(parts, axis=-1)
  per_mb = lambda name: np.stack([side_by_side([getattr(b, name) for b in mb])
                                  for mb in ctx.streams])
  per_tick = lambda ticks: np.stack([side_by_side([rows(l) for l in tick]) for tick in ticks])
  return {
      "tokens": per_mb("tokens"),
      "targets": per_mb("targets"),
      "loss_mask": per_mb("loss_mask"),
      "forward_positions": per_tick(ctx.forward_streams),
      "backward_positions": per_tick(ctx.backward_streams),
  }


ARRAY_SPECS = {"tokens": P(None, "data"), "targets": P(None, "data"), "loss_mask": P(None, "data"),
               "forward_positions": P(None, "pipe", "data"),
               "backward_positions": P(None, "pipe", "data")}
CTX_SPEC = P(None, ROW_AXES)
