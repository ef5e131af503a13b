"""The host's planning of one CAD step: batch -> ping/pong split -> plans -> gate -> arrays -> check.

Runs in the trainer's prefetch thread, one step ahead of the devices, numpy only (the arrays
are host numpy; `DispatchPlan` is a JAX pytree only to travel to the devices). `plan_step` is the
whole path of an unpipelined step; `plan_ticks` plans a pipelined step's ticks
(`pipeline_host.host_context`). Both size the arrays of all their plans alike (they stack) and, given
the run's `StepShapes`, at the largest capacities any earlier step needed (a step compiles only
when one grows).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import PartitionSpec as P

from distca_jax import gate
from distca_jax.colocated import colocated_contexts, stream_arrays
from distca_jax.data.packing import Layout, run_values
from distca_jax.data.sources import Batch
from distca_jax.dispatch.checks import validate_plan
from distca_jax.dispatch.format import DispatchPlan, build_dispatch, rows_selector
from distca_jax.schedule.capacities import Capacities, StepShapes, largest
from distca_jax.schedule.pingpong import pingpong_layouts
from distca_jax.schedule.plan import Plan, make_plan
from distca_jax.schedule.gate_cost import attention_load_per_device, imbalance
from distca_jax.schedule.relay import Relay
from distca_jax.schedule.tick import plan_tick
from distca_jax.schedule.transport import relay_for


@dataclasses.dataclass(frozen=True)
class StepContext:
  """Host-side inputs of one CAD step (not a pytree): the nano-batches the step trains on (one,
  or Ping and Pong), their dispatch plans, and the scheduler's plans for reporting. Follows the
  trainer's step-context protocol (`attention.StepContext`)."""

  batches: tuple[Batch, ...]
  dispatch: tuple[DispatchPlan, ...]
  plans: tuple[Plan, ...]
  # What the gate's cost model predicts the step saves (`gate.predicted_cad_saving`, with the
  # exchange at the capacities the step runs with), whether or not the gate is on.
  predicted_saving: float = float("nan")
  # Per device, the batch's attention area as loaded (what colocated attention runs), before
  # any split; None: the nano-batches' own loads stand in for it.
  load_before: np.ndarray | None = None

  cad = True  # the step runs CAD's exchange

  @property
  def capacities(self) -> Capacities:
    """The capacities its dispatch arrays have."""
    return self.dispatch[0].capacities

  def imbalance(self) -> tuple[float, float]:
    """Attention-area imbalance (max/mean over servers) before scheduling (the batch as loaded,
    not its ping-pong halves, which the split alone often evens out) and after (the plans'
    loads, summed over nano-batches)."""
    before = (sum(p.stats.load_before for p in self.plans) if self.load_before is None
              else self.load_before)
    return imbalance(before), imbalance(sum(p.stats.load_after for p in self.plans))

  def device_inputs(self, batch: Batch):
    """(per-token arrays, their spec), (dispatch plans, their spec) for the step: one stream's
    as they are, several streams' as tuples over the streams (ping-pong re-packs the batch, so
    `batch` itself is not read)."""
    if len(self.batches) == 1:
      return (stream_arrays(self.batches[0]), P("data")), (self.dispatch[0], P("data"))
    per_stream = [stream_arrays(b) for b in self.batches]
    arrays = {k: tuple(a[k] for a in per_stream) for k in per_stream[0]}
    return (arrays, P("data")), (tuple(self.dispatch), P("data"))


@dataclasses.dataclass(frozen=True)
class _Option:
  """One way to run the step: its streams, their plans, the capacities they need together, and
  the gate's predicted saving."""

  batches: tuple[Batch, ...]
  plans: tuple[Plan, ...]
  kvs: tuple
  capacities: Capacities
  saving: float

  @property
  def layouts(self) -> list[Layout]:
    return [b.layout for b in self.batches]


def plan_step(attention_config, batch: Batch, shape, devices=None, shapes: StepShapes | None = None):
  """The host context of one unpipelined CAD step (`StepContext`), or colocated attention's
  (`colocated.ColocatedContext`: one stream, no exchange, no ping-pong split; compiled once
  beside the distca step) for a step with nothing worth moving.

  `devices`: the rows this process builds and checks (`mesh.local_rows`; the plans and the gate's
  decision are global, the same on every process). `shapes`: the run's `StepShapes` (a trainer
  passes one, so its steps compile only when a capacity grows); without it each step takes the
  buckets it needs.

  The gate (`attention.gate`, `gate.py`): a batch whose colocated attention imbalance is below
  `attention.min_imbalance`, or that cannot reach `attention.min_gain` even perfectly balanced,
  is not planned; one whose plans are predicted to save less than `min_gain` of the step, net of
  the exchange at the capacities it would run with, runs colocated. The gate decides on the
  plans alone, before their dispatch arrays are built and checked (the costly part at scale)."""
  colocated = lambda: colocated_contexts([batch.layout], shapes=shapes)[0]
  if not gate.worth_planning(attention_config, shape, batch.layout):
    return colocated()
  splits = stream_options(attention_config, batch)
  options = [_plan_option(attention_config, shape, batch.layout, streams, shapes)
             for streams in splits]
  best = max(options, key=lambda o: o.saving)  # the first of equals
  if gate.gate_refuses(attention_config, best.saving):
    return colocated()
  dispatch = _arrays(best.plans, best.layouts, best.kvs, best.capacities, devices, shapes)
  _check(dispatch, best.layouts, devices, best.batches)
  return StepContext(batches=best.batches, plans=best.plans, dispatch=tuple(dispatch),
                     predicted_saving=best.saving,
                     load_before=attention_load_per_device(batch.layout))


def stream_options(attention_config, batch: Batch) -> list[tuple[Batch, ...]]:
  """The streams the step may run as: ping-pong's Ping and Pong (`attention.pingpong`), or the
  batch as one stream. A split that cuts a document longer than half the step gives halves of
  unequal attention (Ping all prefix, Pong the suffix over the whole prefix), each balanced on
  its own, and one stream can then beat two: such a step is planned both ways and runs the one
  the gate predicts saves more, unless `attention.pingpong_allow_single` is off."""
  if not attention_config.pingpong:
    return [(batch,)]
  halves = split_pingpong_batch(batch)
  single = attention_config.pingpong_allow_single and _cuts_long_document(halves[1].layout)
  return [halves] + ([(batch,)] if single else [])


def _plan_option(attention_config, shape, layout: Layout, batches,
                 shapes: StepShapes | None) -> _Option:
  """Plans each stream of the batch (`layout`: the whole batch's); their capacities together (the
  run's, if larger, uncommitted: the gate may still turn the step away) and what the gate
  predicts they save at those capacities."""
  layouts = [b.layout for b in batches]
  plans, kvs = _plans_and_kv(attention_config, layouts, shape)
  caps = step_capacities(attention_config, plans, layouts[0].buffer_len, shapes)
  saving = gate.predicted_cad_saving(shape, layout, plans, attention_config,
                                     gate.exchange_bytes(attention_config, shape, plans, caps))
  return _Option(batches=tuple(batches), plans=plans, kvs=kvs, capacities=caps, saving=saving)


def plan_ticks(attention_config, layouts, shape, devices=None, shapes: StepShapes | None = None,
               streams: int = 1) -> tuple[list[Plan], list[DispatchPlan]]:
  """A pipelined step's ticks planned into checked dispatch arrays of one shape (they stack):
  `layouts`, tick-major, each tick's `streams` layouts over all stages' rows (with ping-pong, its
  Ping and its Pong layout); a tick's plans made together by `schedule.tick.plan_tick` (how far
  warm-up and drain ticks spread over idle stages, the tick gate `attention.min_imbalance`; no
  step gate, no single-stream fallback)."""
  comm, costs = gate.comm_model(shape, attention_config), gate.tick_costs(shape, attention_config)
  plans = tuple(p for i in range(0, len(layouts), streams) for p in plan_tick(
      layouts[i:i + streams], comm, costs, epsilon=attention_config.epsilon,
      min_imbalance=attention_config.min_imbalance_for(pipelined=True),
      relay=relay_of(attention_config)))
  kvs = tuple(p.kv for p in plans)
  caps = step_capacities(attention_config, plans, layouts[0].buffer_len, shapes)
  dispatch = _arrays(plans, layouts, kvs, caps, devices, shapes)
  _check(dispatch, layouts, devices)
  return list(plans), dispatch


def _schedule(attention_config, layout: Layout, shape) -> Plan:
  """The scheduler's plan for one nano-batch (global: the same on every process), with
  its K/V relayed as `attention.kv_relay_fanout` asks (its capacities, traffic and K/V requests
  those of the relayed exchange, which the gate and the reports then see)."""
  return make_plan(layout, gate.comm_model(shape, attention_config),
                   epsilon=attention_config.epsilon,
                   min_imbalance=attention_config.min_imbalance_for(pipelined=False),
                   nodes=planner_nodes(attention_config, layout), relay=relay_of(attention_config))


def planner_nodes(attention_config, layout: Layout):
  """The node of each of `layout`'s buffers for the planner (`attention.data_rank_nodes`, one per data
  rank), or None: unknown. (A pipelined tick is planned as one node, `schedule/tick.py`.)"""
  nodes = attention_config.data_rank_nodes
  return nodes if nodes is not None and len(nodes) == layout.num_buffers else None


def relay_of(attention_config) -> Relay | None:
  """The K/V relay `attention.kv_relay_fanout` asks for on the servers' nodes
  (`attention.data_rank_nodes`; None: off)."""
  return relay_for(attention_config.kv_relay_fanout, attention_config.transport(),
                   attention_config.data_rank_nodes)


def _plans_and_kv(attention_config, layouts, shape):
  """(plans, their `kv_requests`) of each nano-batch."""
  plans = tuple(_schedule(attention_config, l, shape) for l in layouts)
  return plans, tuple(p.kv for p in plans)


def step_capacities(attention_config, plans, buffer_len: int,
                    shapes: StepShapes | None = None) -> Capacities:
  """The capacities the plans of one step need together (each the largest any of them needs;
  only the sizes the exchange's transport uses: `Transport.capacities`), grown to the run's
  (`shapes`, not committed) when given."""
  caps = attention_config.transport().capacities(largest(*(p.capacities for p in plans)))
  return caps if shapes is None else shapes.fit(f"cad@{buffer_len}", caps, commit=False)


def _arrays(plans, layouts, kvs, caps: Capacities, devices,
            shapes: StepShapes | None) -> list[DispatchPlan]:
  """The plans' dispatch arrays at `caps`, kept as the run's capacities (`shapes`), filled for
  `devices` (default: all)."""
  if shapes is not None:
    caps = shapes.fit(f"cad@{layouts[0].buffer_len}", caps)
  return [build_dispatch(p.tasks, l, caps, devices=devices, kv=kv)
          for p, l, kv in zip(plans, layouts, kvs)]


def _check(dispatch, layouts, devices, batches=None) -> None:
  """Each plan's arrays checked row by row for `devices` against its layout (and its nano-batch,
  when at hand: Pong against Ping too)."""
  batches = batches or [None] * len(dispatch)
  for i, (d, l, b) in enumerate(zip(dispatch, layouts, batches)):
    validate_plan(d, l, devices, b, batches[i - 1] if l.prior is not None and i else None)


def _cuts_long_document(pong: Layout) -> bool:
  """Whether the ping-pong split behind Pong's layout cut a document longer than half the step's
  tokens (Pong holds the smaller half)."""
  prior = pong.prior
  return bool(prior.num_shards) and int(pong.doc_lens[prior.doc[0]]) > int(pong.length.sum())


def split_pingpong_batch(batch: Batch) -> tuple[Batch, Batch]:
  """Ping and Pong: the batch's documents split into two halves of equal tokens and balanced
  attention (`schedule/pingpong.py`), each packed into buffers of half the length. Every token
  keeps its target, loss weight and position: the two halves train exactly the batch (Pong's
  layout lists the cut document's prefix in Ping as `prior` shards, which its attention reads).
  Each half holds the buffers the batch holds (`Batch.rows`), their tokens read wherever they sit
  in the batch (`Batch.take`): a process re-packs only its own rows."""
  layout = batch.layout
  N, T = layout.num_buffers, layout.buffer_len
  if T % 2:
    raise ValueError(f"ping-pong needs an even buffer length, got {T}")
  ping, pong, split = pingpong_layouts(layout.doc_lens, N, T)
  # A packed batch holds each document at consecutive flat rows (buffer * T + offset).
  doc_start = np.cumsum(layout.doc_lens) - layout.doc_lens
  if not np.array_equal(layout.buffer * T + layout.buffer_offset,
                        doc_start[layout.doc] + layout.doc_offset):
    raise ValueError("ping-pong: the batch's layout is not packed in document order")
  held = np.arange(N) if batch.rows is None else batch.rows
  return tuple(_half(batch, lay, lens, doc_start[source[:, 0]] + source[:, 1], held, T // 2)
               for lay, lens, source in zip((ping, pong), split.lens, split.source))


def _half(batch: Batch, lay: Layout, lens: np.ndarray, starts: np.ndarray, held: np.ndarray,
          half: int) -> Batch:
  """One half of the ping-pong split as a batch of `held`'s rows: its document pieces
  (`lens`, each starting at flat position `starts` of the batch) packed in order from the first
  row, their tokens read from `batch`."""
  N = lay.num_buffers
  # The held rows' positions in the half, in order, those holding a token first.
  flat = (held[:, None] * half + np.arange(half)).reshape(-1)
  ends = np.cumsum(lens)
  j = flat[:np.searchsorted(flat, ends[-1] if ends.size else 0)]
  # Half position j lies in piece k of the half, which starts at `starts[k]` in the batch, so
  # at batch position j + starts[k] - (ends[k] - lens[k]).
  shift, = run_values(ends, j, starts - (ends - lens))
  rows = rows_selector(N, held)
  dtypes = {"tokens": np.int32, "targets": np.int32, "loss_mask": np.float32,
            "positions": np.int32}
  arrays = {k: np.zeros((N, half), t) for k, t in dtypes.items()}
  if isinstance(rows, slice):  # consecutive rows: their tokens written in place
    batch.take(j + shift, {k: a[rows].reshape(-1)[:j.size] for k, a in arrays.items()})
  else:
    for k, a in batch.take(j + shift).items():
      flat_rows = np.zeros(flat.size, a.dtype)
      flat_rows[:j.size] = a
      arrays[k][held] = flat_rows.reshape(held.size, half)
  segment_ids = np.zeros((N, half), np.int32)
  segment_ids[rows] = lay.segment_ids(held)
  return Batch(**arrays, segment_ids=segment_ids, layout=lay, rows=batch.rows)
