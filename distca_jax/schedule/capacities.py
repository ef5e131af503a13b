"""A step's array capacities (`Capacities`), what a task placement needs, and capacities that only
grow over a run (`StepShapes`). Numpy only.

The capacities are the static sizes of the dispatch arrays (`dispatch.DispatchPlan`): every
value compiles the step once, so they come from few buckets (`items.row_bucket`,
`items.exchange_capacity`, `items.task_bucket`), and a training run keeps the largest any of its
steps needed (`StepShapes`) so a step compiles only when one grows.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from distca_jax.data.packing import Layout
from distca_jax.schedule.items import Tasks, buffer_bucket, exchange_capacity, row_bucket, task_bucket
from distca_jax.schedule.traffic import KVRequests, exchange_pairs, kv_requests

log = logging.getLogger(__name__)

_SIZES = ("send_q", "recv_q", "send_kv", "recv_kv", "send_kv2", "recv_kv2", "c", "ckv", "ckv2",
          "skv", "ctask")


@dataclasses.dataclass(frozen=True)
class Capacities:
  """The capacities of one step's dispatch arrays, in rows (or tasks):

  send_q, recv_q    query rows of a device's packed send buffer (every row it sends, grouped by
                    server) and of its packed receive buffer (every row it serves for others,
                    grouped by home): the busiest sender's and receiver's rows, bucketed (0:
                    no query row moves, the exchange is skipped)
  send_kv, recv_kv  the same for the deduplicated K/V rows of the first round (every row a
                    holder sends, and without relays every K/V row that moves)
  send_kv2, recv_kv2  the same for the second round: the relayed K/V rows a relay forwards and
                    a server receives from relays (`schedule/relay.py`; 0 without relays, and
                    the round is skipped)
  skv      K/V rows a server gathers (every document prefix it serves, contiguous)
  ctask    tasks per server
  c, ckv, ckv2  the tiled exchange's rows per padded (device, server) block (the largest
           pair's), ckv2 for the second K/V round; 0 for the ragged exchange

  As `make_plan`'s limits, a size that is None is not fixed (the plan takes the bucket it
  needs)."""

  send_q: int | None = None
  recv_q: int | None = None
  send_kv: int | None = None
  recv_kv: int | None = None
  send_kv2: int | None = None
  recv_kv2: int | None = None
  c: int | None = None
  ckv: int | None = None
  ckv2: int | None = None
  skv: int | None = None
  ctask: int | None = None

  def __post_init__(self):
    for name in _SIZES:
      v = getattr(self, name)
      if v is not None and v < 0:
        raise ValueError(f"Capacities.{name}: must be >= 0 or None, got {v}")

  def fits(self, limits: "Capacities") -> bool:
    """Whether every size is within `limits` (None there: any)."""
    return all(getattr(limits, k) is None or getattr(self, k) <= getattr(limits, k)
               for k in _SIZES)


def largest(*records):
  """The elementwise maximum of records of one dataclass type (int fields; None: not known)."""
  out = {}
  for f in dataclasses.fields(records[0]):
    known = [v for v in (getattr(r, f.name) for r in records) if v is not None]
    out[f.name] = max(known) if known else None
  return type(records[0])(**out)


def requirements(tasks: Tasks, layout: Layout, kv: KVRequests | None = None) -> Capacities:
  """The smallest capacities a task placement needs (before bucketing): the most query / K/V rows
  one device sends and one receives, the most between two devices, K/V
  rows on one server, tasks on one server. `kv`: the tasks' `kv_requests` (with relays, the
  second K/V round's sizes are those of its relayed pieces; default: no relays, all zero). Work
  of the pairs that move rows, never [N, N]."""
  n = layout.num_buffers
  kv = kv_requests(tasks, layout) if kv is None else kv
  q, k1, k2 = exchange_pairs(tasks, layout, kv)
  skv = np.bincount(kv.pair_server, weights=kv.pair_need, minlength=n)
  most = lambda a: int(a.max(initial=0))
  return Capacities(
      send_q=most(q.sent(n)), recv_q=most(q.received(n)), send_kv=most(k1.sent(n)),
      recv_kv=most(k1.received(n)), send_kv2=most(k2.sent(n)), recv_kv2=most(k2.received(n)),
      c=q.largest(), ckv=k1.largest(), ckv2=k2.largest(), skv=int(skv.max(initial=0)),
      ctask=int(np.bincount(tasks.server, minlength=n).max(initial=0)))


def bucketed(need: Capacities, buffer_len: int, fixed: Capacities = Capacities()) -> Capacities:
  """`need` in buckets (exchange buffers: `buffer_bucket`, tiled blocks:
  `exchange_capacity`, 0 when nothing moves; the server's K/V rows: `row_bucket`; tasks:
  `task_bucket`), except what `fixed` fixes."""
  pick = lambda name, bucket: getattr(fixed, name) if getattr(fixed, name) is not None else bucket
  # The tiled exchange's blocks keep the coarse buckets it was measured with (the gate's fit
  # prices them); the packed buffers follow the rows more closely.
  block = lambda r: exchange_capacity(r, buffer_len)
  buffer = lambda name: pick(name, buffer_bucket(getattr(need, name)))
  return Capacities(
      send_q=buffer("send_q"), recv_q=buffer("recv_q"), send_kv=buffer("send_kv"),
      recv_kv=buffer("recv_kv"), send_kv2=buffer("send_kv2"), recv_kv2=buffer("recv_kv2"),
      c=pick("c", block(need.c)), ckv=pick("ckv", block(need.ckv)),
      ckv2=pick("ckv2", block(need.ckv2)),
      skv=pick("skv", row_bucket(need.skv, buffer_len)), ctask=pick("ctask", task_bucket(need.ctask)))


class StepShapes:
  """The array capacities a training run's steps have compiled with, grown and never shrunk.

  Every step's plan needs its own buckets (rows per exchanged block, K/V rows and tasks per
  server; a colocated step's task capacity and K/V window). Taken step by step, most steps of a
  run land on a combination no earlier step had, and each new combination compiles the step
  again (seconds each, and most steps of a run early on). Kept here, each
  capacity is the largest any step of the run has needed: a step compiles only when one of
  them grows, a few times early in a run, and never for a shape an earlier step had. The cost
  is padding: a step whose plan needs less still sends and holds the grown capacity (the tiled
  exchange moves whole blocks).

  One per run, used from the trainer's one prefetch thread; every process sees the same global
  plans in the same order, so every process grows the same capacities at the same step.

  `sizes` is what a checkpoint keeps: "<kind>.<field>" -> rows, e.g.
  "cad@65536.c"."""

  def __init__(self):
    self.sizes: dict[str, Any] = {}
    self.growths = 0  # shapes this process has used: each compiles the step once
    self._used: set[str] = set()

  def count_from_here(self) -> None:
    """Keeps the sizes but counts no shape as used: after sizing a run's capacities by planning
    its first steps ahead (`train.shape_steps`), each kind's first real step counts as the new
    shape it compiles."""
    self.growths = 0
    self._used.clear()

  def stored(self, kind: str, record_type):
    """The capacities of `kind` kept so far, as a `record_type`, or None."""
    prefix = f"{kind}."
    own = {k[len(prefix):]: v for k, v in self.sizes.items() if k.startswith(prefix)}
    if not own:
      return None
    names = {f.name for f in dataclasses.fields(record_type)}
    return record_type(**{k: v for k, v in own.items() if k in names})

  def fit(self, kind: str, need, commit: bool = True):
    """The capacities of `kind` ("cad@T", "colocated@T") for a step that needs `need` (a record
    of capacities, each already a bucket): the elementwise maximum of `need` and what earlier
    steps needed; kept for later steps unless `commit` is false (a step the gate may still turn
    away)."""
    before = self.stored(kind, type(need))
    grown = need if before is None else largest(need, before)
    if not commit:
      return grown
    if grown != before or kind not in self._used:  # a new shape (or restored sizes, first used here)
      self.growths += 1
      if before is not None and grown != before:
        log.info("%s step capacities grew to %s: the step compiles again", kind, grown)
      prefix = f"{kind}."
      self.sizes = {k: v for k, v in self.sizes.items() if not k.startswith(prefix)}
      self.sizes.update({f"{prefix}{k}": v for k, v in dataclasses.asdict(grown).items()})
      self._used.add(kind)
    return grown
