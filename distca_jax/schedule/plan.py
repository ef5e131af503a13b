"""A step's plan: the scheduler's CA-tasks placed on servers, with their capacities.

Setting. N devices; each device d is the *home* of a buffer of T tokens (rows 0..T-1, the packed
layout) and is also an attention *server*. Every CA-task has one home, and its query rows are a
contiguous range of the home buffer; its keys are its document's prefix. `make_plan` places the
tasks (`planner.balance`) and sizes the dispatch arrays that will carry them
(`capacities.Capacities`, in buckets so XLA recompiles rarely); the dispatch layer lays them out
(`dispatch.build_dispatch` -> `dispatch.DispatchPlan`, the one array format, whose docstring
defines every array).

Capacity feedback. A caller may fix any capacity (`make_plan(..., capacities=Capacities(...))`):
`make_plan` then raises ε step by step until the plan fits, and raises `CapacityError` if even the
colocated plan does not. Below `min_imbalance` (colocated load max / mean) it returns the
colocated plan.

Use (host side, once per nano-batch; numpy only):

  comm = CommModel.for_model(shape, tensor_parallel=tp)     # schedule/cost.py
  plan = make_plan(layout, comm, epsilon=0.1)               # buckets chosen for this step, or
  plan = make_plan(layout, comm, 0.1, Capacities(ctask=64)) # some fixed
  colocated_plan(layout, comm)                              # nothing moves
  plan.tasks, plan.capacities, plan.task_flops, plan.dump_json(path)
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from distca_jax.data.packing import Layout, ranges
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.capacities import Capacities, bucketed, requirements
from distca_jax.schedule.items import Tasks, initial_tasks, validate_layout
from distca_jax.schedule.planner import BalanceStats, balance, check_epsilon
from distca_jax.schedule.relay import Relay
from distca_jax.schedule.traffic import KVRequests, Traffic, kv_requests, traffic

PLAN_FORMAT = "distca-plan-v1"


class CapacityError(ValueError):
  """The plan's arrays do not fit the requested capacities."""


def cumsum_in_groups(values: np.ndarray, group: np.ndarray) -> np.ndarray:
  """Per element: sum of `values` of earlier elements of the same group (input grouped, sorted)."""
  c = np.cumsum(values) - values
  if values.size == 0:
    return c
  starts = np.r_[True, group[1:] != group[:-1]]
  base = np.maximum.accumulate(np.where(starts, c, 0))
  return c - base


def fill_ranges(idx_flat: np.ndarray | None, valid_flat: np.ndarray, dst_start, src_start,
                length) -> None:
  """idx_flat[d : d+l] = s + arange(l), valid_flat[...] = True, for each (d, s, l); with
  `idx_flat` None only the valid flags (`src_start` unread).

  Long ranges are contiguous slice writes, one each; the many short ones (a batch of short
  documents has tens of thousands) one scatter of their rows together. Never a loop over
  tokens, nor over short ranges.
  """
  length = np.asarray(length, np.int64).reshape(-1)
  if not length.size:
    return
  dst = np.asarray(dst_start, np.int64).reshape(-1)
  src = np.broadcast_to(np.asarray(src_start, np.int64).reshape(-1), dst.shape)
  short = length < _LONG_RANGE
  if short.any():
    at = ranges(dst[short], length[short])
    if idx_flat is not None:
      idx_flat[at] = ranges(src[short], length[short])
    valid_flat[at] = True
  long_ = ~short
  if long_.any():
    ramp = None if idx_flat is None else np.arange(int(length[long_].max()), dtype=idx_flat.dtype)
    for d, s_, l in zip(dst[long_].tolist(), src[long_].tolist(), length[long_].tolist()):
      if ramp is not None:
        np.add(ramp[:l], s_, out=idx_flat[d:d + l])
      valid_flat[d:d + l] = True


# Ranges of at least this many rows are written one slice at a time (a Python step each, ~1 µs,
# against ~4 ns a row scattered).
_LONG_RANGE = 512


@dataclasses.dataclass(frozen=True)
class Plan:
  """Tasks (with servers), the capacities of their dispatch arrays, and what the planner reports.

  capacities: the bucketed capacities the tasks' dispatch arrays need, or the fixed ones asked
  for.
  requirements: the smallest capacities the placement needs (unbucketed).
  task_flops: forward FLOPs per task per layer for one server's heads (comm.flops_per_area).
  """

  num_devices: int
  buffer_len: int
  epsilon: float
  capacities: Capacities
  requirements: Capacities
  tasks: Tasks
  task_flops: np.ndarray
  stats: BalanceStats
  traffic: Traffic
  kv: KVRequests | None = None  # the tasks' K/V requests (relayed as the plan was made)

  def server_flops(self) -> np.ndarray:
    """[N] forward attention FLOPs per layer each server computes (one server's heads)."""
    return np.bincount(self.tasks.server, weights=self.task_flops, minlength=self.num_devices)

  def server_ms(self, kernel, backward: bool = True) -> np.ndarray:
    """[N] predicted kernel ms per layer per server: Σ over its tasks of `kernel.fwdbwd_ms` (or
    `fwd_ms`), kernel = cost.AnalyticKernel or a profiled cost.TimeTable for one server's heads."""
    t = self.tasks
    ms = (kernel.fwdbwd_ms if backward else kernel.fwd_ms)(t.q_len, t.kv_len)
    return np.bincount(t.server, weights=ms, minlength=self.num_devices)

  def to_json_dict(self) -> dict:
    """Documented JSON form (see `dump_json`)."""
    t = self.tasks
    return {
        "format": PLAN_FORMAT,
        "num_devices": self.num_devices,
        "buffer_len": self.buffer_len,
        "epsilon": self.epsilon,
        "moves": self.stats.moves,
        "capacities": dataclasses.asdict(self.capacities),
        "requirements": dataclasses.asdict(self.requirements),
        "load_before": self.stats.load_before.tolist(),
        "load_after": self.stats.load_after.tolist(),
        "imbalance_before": self.stats.imbalance_before,
        "imbalance_after": self.stats.imbalance_after,
        "flops_after": self.server_flops().tolist(),
        "send_bytes_per_layer": self.traffic.send.tolist(),
        "recv_bytes_per_layer": self.traffic.recv.tolist(),
        "tasks": {
            "home": t.home.tolist(), "doc": t.doc.tolist(), "q_lo": t.q_lo.tolist(),
            "q_hi": t.q_hi.tolist(), "kv_lo": [0] * t.size, "kv_hi": t.q_hi.tolist(),
            "home_off": t.home_off.tolist(), "server": t.server.tolist(),
            "flops": self.task_flops.tolist(),
        },
    }

  def dump_json(self, path: str | Path) -> None:
    """Writes the plan as JSON. Schema (`format` = "distca-plan-v1"):

    num_devices, buffer_len, epsilon (the tolerance the plan was made with, after capacity
    feedback), moves (planner moves), capacities {c, ckv, skv, ctask} (the
    dispatch arrays' capacities, `Capacities`), requirements (the smallest capacities this
    placement needs), load_before / load_after [N]
    (attention area, query-key pairs, per server before and after scheduling),
    imbalance_before / imbalance_after (max / mean of those), flops_after [N] (forward attention
    FLOPs per layer per server, one server's heads), send_ / recv_bytes_per_layer [N]
    (network bytes per device per layer, one server's heads, KV deduplicated), and tasks: columns
    of equal length, one entry per CA-task: home (device holding its query rows), doc (document
    id), q_lo / q_hi (query positions in the document), kv_lo / kv_hi (key positions: always
    0 / q_hi), home_off (home buffer row of q_lo), server (device computing it), flops (forward
    FLOPs per layer for one server's heads).
    """
    Path(path).write_text(json.dumps(self.to_json_dict()))


def _needs(tasks: Tasks, layout: Layout, relay: Relay | None):
  """(K/V requests, requirements) of a placement, its K/V relayed as `relay` says."""
  kv = kv_requests(tasks, layout, relay)
  return kv, requirements(tasks, layout, kv)


def _finish(tasks, layout, comm, epsilon, stats, caps, kv, req, relay) -> Plan:
  return Plan(num_devices=layout.num_buffers, buffer_len=layout.buffer_len, epsilon=epsilon,
              capacities=bucketed(req, layout.buffer_len, caps), requirements=req, tasks=tasks,
              task_flops=tasks.area() * comm.flops_per_area(backward=False), stats=stats,
              traffic=traffic(tasks, layout, comm, relay=relay, kv=kv), kv=kv)


def make_plan(layout: Layout, comm: CommModel, epsilon: float = 0.1,
              capacities: Capacities = Capacities(), *, epsilon_step: float = 0.05,
              max_epsilon: float = 1.0, min_imbalance: float = 1.0, relay: Relay | None = None,
              **balance_kw) -> Plan:
  """Schedules `layout` and sizes its dispatch arrays, with capacity feedback.

  Below `min_imbalance` (the colocated attention load's max / mean over devices) nothing moves:
  the colocated plan (its exchange carries only the K/V prefixes of documents that continue from
  an earlier buffer, which colocated attention needs too). Otherwise tries epsilon,
  epsilon + epsilon_step, ... up to max_epsilon, then the colocated plan; returns the first that
  fits `capacities` (None fields: chosen from the buckets). `relay`: K/V shards many servers need
  go in a second round (`schedule/relay.py`): the plan's capacities, traffic and K/V requests
  (`Plan.kv`) are those of the relayed exchange, each computed once. Raises CapacityError if none
  fits, ValueError on a bad layout.
  """
  validate_layout(layout)
  check_epsilon(epsilon)
  if not (math.isfinite(epsilon_step) and math.isfinite(max_epsilon)):
    raise ValueError(f"make_plan: epsilon_step and max_epsilon must be finite, got "
                     f"{epsilon_step}, {max_epsilon}")
  if not min_imbalance >= 1.0:
    raise ValueError(f"min_imbalance: a max / mean ratio, must be >= 1, got {min_imbalance}")
  if min_imbalance > 1.0:
    base = initial_tasks(layout, validate=False)
    load = np.bincount(base.server, weights=base.area(), minlength=layout.num_buffers)
    if load.mean() > 0 and load.max() / load.mean() < min_imbalance:
      try:
        return colocated_plan(layout, comm, capacities=capacities, relay=relay)
      except CapacityError:
        pass  # fixed capacities the colocated plan exceeds: a balanced plan may still fit
  tried = []
  eps = float(epsilon)
  max_epsilon = max(max_epsilon, eps)  # the requested tolerance is always tried
  while eps <= max_epsilon + 1e-9:
    tasks, stats = balance(layout, comm, eps, validate=False, **balance_kw)
    kv, req = _needs(tasks, layout, relay)
    if req.fits(capacities):
      return _finish(tasks, layout, comm, eps, stats, capacities, kv, req, relay)
    tried.append((eps, req))
    if epsilon_step <= 0:
      break
    eps = round(eps + epsilon_step, 10)
  plan = colocated_plan(layout, comm, capacities=Capacities(), relay=relay)
  if plan.requirements.fits(capacities):
    return colocated_plan(layout, comm, capacities=capacities, relay=relay)
  last = tried[-1][1] if tried else plan.requirements
  raise CapacityError(
      f"no plan fits the capacities {dataclasses.asdict(capacities)}: tried epsilon "
      f"{[e for e, _ in tried]} and the colocated plan; the colocated plan needs "
      f"{dataclasses.asdict(plan.requirements)}, the last balanced one {dataclasses.asdict(last)}")


def colocated_plan(layout: Layout, comm: CommModel, capacities: Capacities = Capacities(),
                   relay: Relay | None = None) -> Plan:
  """Every task on its home device (no balancing)."""
  tasks = initial_tasks(layout).sorted()
  load = np.bincount(tasks.server, weights=tasks.area(), minlength=layout.num_buffers)
  stats = BalanceStats(epsilon=float("inf"), moves=0, load_before=load, load_after=load,
                       stopped="colocated")
  kv, req = _needs(tasks, layout, relay)
  if not req.fits(capacities):
    raise CapacityError(f"the colocated plan needs {dataclasses.asdict(req)}, more than the "
                        f"capacities {dataclasses.asdict(capacities)}")
  return _finish(tasks, layout, comm, float("inf"), stats, capacities, kv, req, relay)
