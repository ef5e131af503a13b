"""`validate_plan`: a step's dispatch arrays checked against the batch they are used with.

Each check is one function over a `Scope` (the plan, its layout, the devices checked);
`validate_plan` runs them in order. A plan made for another batch (other
document boundaries) fails even when its shapes fit, because the last checks follow every row
through the arrays back to its (document, position) in the batch. Host side, numpy, vectorised:
the work is over the rows the checked devices' plans touch, never a Python loop over tokens nor
the whole batch.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from distca_jax.data.packing import PAD_SEGMENT, Layout
from distca_jax.data.sources import Batch
from distca_jax.dispatch import runs
from distca_jax.dispatch.format import DispatchPlan, PlanMismatchError, rows_selector


class _Tables(dict):
  """`Scope.tables`: each built on first use."""

  def __init__(self, scope: "Scope"):
    super().__init__()
    self.scope = scope

  def __missing__(self, name: str) -> runs.Table:
    s, p = self.scope, self.scope.plan
    whole = lambda a, valid: runs.table_of(a, valid, s.devices, 0, a.shape[-1])
    if name == "local_q":
      table = runs.mask_table(s.mine(p.local_q_valid), s.devices)
    elif name == "server_kv":
      table = whole(p.server_kv_idx, p.server_kv_valid)
    elif name in ("send_q", "send_kv2"):
      r = p.q if name == "send_q" else p.kv2
      table = runs.table_of(r.send_idx, r.send_valid, *runs.send_regions(
          r.send_count, r.send_off, s.devices, s.devices))
    elif name == "shards":
      table = runs.shard_table(s.layout)
    elif name == "prior_shards":
      table = runs.shard_table(s.layout.prior)
    else:
      raise KeyError(name)
    self[name] = table
    return table


@dataclasses.dataclass(frozen=True)
class Scope:
  """What the checks read: the plan, its layout (each row's document and position, looked up
  row by row: a process checking its devices reads the rows their plans touch, not the batch),
  and the devices checked with the index of their rows."""

  plan: DispatchPlan
  layout: Layout
  devices: np.ndarray     # sorted device numbers checked
  rows: object            # index of their rows in an [N, ...] array (`rows_selector`)
  segment: np.ndarray     # [devices, T] the document of each of their home rows (PAD_SEGMENT)

  @property
  def real(self) -> np.ndarray:
    """[devices, T] whether each of their home rows is a real token."""
    return self.segment != PAD_SEGMENT

  @functools.cached_property
  def tables(self) -> dict[str, runs.Table]:
    """The index arrays the row checks follow, as runs (`runs.table_of`), each read once over
    the slots the checked devices' rows pass through."""
    return _Tables(self)

  def kv_send_table(self, receivers) -> runs.Table:
    """The round-1 K/V send slots read by `receivers` (the checked servers, and the relays that
    forward to them), and every slot the checked devices send."""
    r = self.plan.kv
    regions = runs.send_regions(r.send_count, r.send_off, receivers, self.devices)
    return runs.table_of(r.send_idx, r.send_valid, *regions)

  @property
  def N(self) -> int:
    return self.layout.num_buffers

  @property
  def T(self) -> int:
    return self.layout.buffer_len

  @property
  def Tkv(self) -> int:
    return self.layout.kv_rows

  @property
  def Rq(self) -> int:
    return self.plan.q.recv_rows

  @property
  def Rkv(self) -> int:
    return self.plan.kv.recv_rows

  @property
  def Rkv2(self) -> int:
    return self.plan.kv2.recv_rows

  def mine(self, a: np.ndarray) -> np.ndarray:
    """The checked devices' rows of a per-device array."""
    return a[self.rows]



def validate_plan(plan: DispatchPlan, layout: Layout, devices=None, batch: Batch | None = None,
                  prior_batch: Batch | None = None) -> None:
  """Refuses a plan that does not belong to `layout` or breaks its own capacities.

  Follows every row through the plan, vectorised: each real token must sit in exactly one query
  slot (its output returns along the same path, reversed); each task's query rows must be
  consecutive positions of one document ending at position kv_len - 1, and its key rows exactly
  that document's positions 0 .. kv_len - 1. `devices` (default: all) limits the checks to what
  those devices hold,
  send and receive: the slots of those homes, the tasks of those servers, the blocks they send
  and receive (each process checks the devices it feeds, `build_dispatch(devices=...)` fills only
  those). `batch`: the Batch packed by `layout`, whose checked rows must hold the documents and
  positions the layout says (each row is then followed through the layout). `prior_batch` (ping-pong's Pong): Ping's Batch, whose rows the layout's prior
  shards name; each must hold the position the shard says. Raises PlanMismatchError naming what
  is wrong.
  """
  check_shapes(plan, layout)
  scope = _scope(plan, layout, devices, batch)
  check_batch_rows_are_the_layout_s(scope, batch)
  check_prior_rows_hold_their_positions(scope, prior_batch)
  check_indices_in_range(scope)
  check_kv_inverse(scope)
  check_exchange_counts(scope)
  check_each_token_has_one_slot(scope)
  check_tasks_cover_one_document(scope)


def check_shapes(plan: DispatchPlan, layout: Layout) -> None:
  """The plan is for the batch's N buffers of T rows."""
  N, T = layout.num_buffers, layout.buffer_len
  if plan.local_q_valid.shape != (N, T):
    raise PlanMismatchError(f"plan is for buffers {plan.local_q_valid.shape}, the batch has ({N}, {T})")
  if plan.q.send_idx.shape[0] != N or plan.q.send_count.shape != (N, N) or plan.q_start.shape[0] != N:
    raise PlanMismatchError(f"plan is for {plan.q.send_idx.shape[0]} devices, the batch has {N}")


def _scope(plan, layout, devices, batch) -> Scope:
  N = layout.num_buffers
  D = np.arange(N) if devices is None else np.unique(np.asarray(devices, np.int64))
  if D.size and (D[0] < 0 or D[-1] >= N):
    raise ValueError(f"validate_plan: devices {devices} outside the plan's {N} devices")
  if batch is not None and batch.layout is not layout:
    raise ValueError("validate_plan: `batch` is not packed by `layout`")
  return Scope(plan=plan, layout=layout, devices=D, rows=rows_selector(N, D),
               segment=layout.segment_ids(D))


def check_batch_rows_are_the_layout_s(s: Scope, batch: Batch | None) -> None:
  """The checked devices' rows of `batch` hold the documents and positions the layout says: the
  later checks follow rows through the layout."""
  if batch is None:
    return
  if not batch.holds(s.devices):
    raise ValueError(f"validate_plan: the batch does not hold the rows of devices {s.devices}")
  if (batch.positions.shape != (s.N, s.T)
      or not np.array_equal(batch.segment_ids[s.devices], s.segment)
      or not np.array_equal(batch.positions[s.devices], s.layout.positions(s.devices))):
    raise PlanMismatchError("plan does not match the batch: the batch's rows hold other "
                            "documents or positions than its layout says")


def check_prior_rows_hold_their_positions(s: Scope, prior_batch: Batch | None) -> None:
  """Ping's rows that Pong's prior shards name hold the positions the shards say (on the checked
  devices: each process checks the rows it feeds)."""
  prior = s.layout.prior
  if prior is None or prior_batch is None:
    return
  named = prior.segment_ids(s.devices) != PAD_SEGMENT
  if not prior_batch.holds(s.devices):
    raise ValueError(f"validate_plan: the earlier stream's batch does not hold the rows of "
                     f"devices {s.devices}")
  if (prior_batch.positions.shape != (s.N, s.T)
      or (prior_batch.segment_ids[s.devices][named] == PAD_SEGMENT).any()
      or (prior_batch.positions[s.devices][named] != prior.positions(s.devices)[named]).any()):
    raise PlanMismatchError("plan does not match the batch: the rows of the earlier stream that "
                            "its prior shards name hold other positions")


def check_indices_in_range(s: Scope) -> None:
  """Every index points inside the array it indexes."""
  p, T = s.plan, s.T
  server_rows = T + s.Rq  # a server's query rows: its home rows in place, then received
  q_start, q_len, kv_start, kv_len = map(s.mine, (p.q_start, p.q_len, p.kv_start, p.kv_len))
  if (q_start + q_len > server_rows).any() or (kv_start + kv_len > p.server_kv_idx.shape[-1]).any():
    raise PlanMismatchError("plan task table indexes rows past its capacities")
  if (q_len > kv_len).any():
    raise PlanMismatchError("plan has a task with more queries than keys")
  if _outside(s.mine(p.server_kv_idx), s.Tkv + s.Rkv + s.Rkv2):
    raise PlanMismatchError("plan server_kv_idx outside the rows a server receives")
  # The checked devices' own buffers; the rows others send them are followed (and checked) by
  # `check_tasks_cover_one_document`.
  for name, a, limit in (("q.send_idx", s.mine(p.q.send_idx), T),
                         ("kv.send_idx", s.mine(p.kv.send_idx), s.Tkv),
                         ("kv2.send_idx", s.mine(p.kv2.send_idx), s.Tkv + s.Rkv)):
    if _outside(a, limit):
      raise PlanMismatchError(f"plan {name} outside the {limit} rows of a buffer")


def _outside(a: np.ndarray, limit: int) -> bool:
  """Whether an index of `a` is outside [0, limit) (two reductions, no temporary per slot)."""
  return bool(a.size) and (a.min() < 0 or a.max() >= limit)


def check_kv_inverse(s: Scope) -> None:
  """`server_kv_inv` is the exact inverse of `server_kv_idx`: the backward runs the exchange
  transposed, gathering by it (`exchange._kv_grads_to_home`). A map and its exact inverse have
  the same maximal runs (consecutive slots to consecutive rows), turned around: the two arrays'
  runs are compared, not their slots one by one."""
  p = s.plan
  rows = s.Tkv + s.Rkv + s.Rkv2
  if p.server_kv_inv.shape != (s.N, rows) or p.server_kv_inv_valid.shape != (s.N, rows):
    raise PlanMismatchError("plan server_kv_inv is not the inverse of its server_kv_idx")
  gather = s.tables["server_kv"]
  inverse = runs.table_of(p.server_kv_inv, p.server_kv_inv_valid, s.devices, 0, rows)
  # The gather's runs keyed by the rows they read, as the inverse's are.
  turned = np.lexsort((gather.to_row, gather.to_dev))
  key = gather.to_dev[turned] * rows + gather.to_row[turned]
  if (key.size != inverse.key.size or not np.array_equal(key, inverse.key)
      or not np.array_equal(gather.n[turned], inverse.n)
      or not np.array_equal(gather.key[turned] % gather.width, inverse.to_row)):
    end = key + gather.n[turned]
    same = gather.to_dev[turned][1:] == gather.to_dev[turned][:-1]
    if (same & (key[1:] < end[:-1])).any():  # (the failure path only)
      raise PlanMismatchError("plan gathers one K/V row into two server slots")
    raise PlanMismatchError("plan server_kv_inv is not the inverse of its server_kv_idx")


def check_exchange_counts(s: Scope) -> None:
  """The exchange's counts and offsets describe its packed buffers: no row to itself, what s
  receives from d is what d sends, offsets are the exclusive prefix sums of the counts (so the
  valid rows of a send buffer are its first ones), every buffer holds its rows, and the tiled
  exchange's blocks hold theirs."""
  for name, r in s.plan.rounds.items():
    count, valid = r.send_count, r.send_valid
    if count.shape != (s.N, s.N) or (count < 0).any():
      raise PlanMismatchError(f"plan {name}.send_count is not the [N, N] rows of one exchange")
    # What each checked device's rows of the six arrays must be, from the counts: its sends and
    # receives, their exclusive prefix sums, and the sums of the rows (columns) before it, each
    # summed once over the [N, N] counts (no prefix sum of the whole matrix).
    sends, gets = count[s.rows].astype(np.int64), count[:, s.rows].T.astype(np.int64)
    want = {"recv_count": gets, "send_off": _exclusive(sends), "recv_off": _exclusive(gets),
            "peer_off": _sums_before(count, s.devices, axis=0),
            "back_off": _sums_before(count, s.devices, axis=1).T}
    if (count[s.devices, s.devices].any()
        or any(not np.array_equal(s.mine(getattr(r, k)), v) for k, v in want.items())):
      raise PlanMismatchError(f"plan {name}.send_count / {name}.recv_count and their offsets do "
                              f"not describe one packed exchange (recv the transpose, offsets "
                              f"their prefix sums)")
    sent, got = count.sum(1), count.sum(0)
    if sent.max(initial=0) > valid.shape[-1] or got.max(initial=0) > r.recv_rows:
      raise PlanMismatchError(f"plan's {name} rows do not fit its buffers: a device sends "
                              f"{int(sent.max())} of {valid.shape[-1]} / receives "
                              f"{int(got.max())} of {r.recv_rows}")
    if any(not valid[d, :k].all() or valid[d, k:].any()
           for d, k in zip(s.devices.tolist(), sent[s.devices].tolist())):
      raise PlanMismatchError(f"plan {name}.send_valid is not the first {name}.send_count rows "
                              f"of each send buffer")
    if r.block and count.max(initial=0) > r.block:
      raise PlanMismatchError(f"plan sends {int(count.max())} {name} rows between two devices, "
                              f"more than the tiled exchange's blocks of {r.block}")


def _exclusive(a: np.ndarray) -> np.ndarray:
  """Exclusive prefix sums along the rows of `a` [k, N]."""
  out = np.cumsum(a, axis=1)
  out -= a
  return out


def _sums_before(count: np.ndarray, at: np.ndarray, axis: int) -> np.ndarray:
  """The sums of `count`'s rows (axis 0: [len(at), N]) or columns (axis 1: [N, len(at)]) before
  each of the sorted, distinct indices `at`, int64: the blocks between consecutive indices
  summed by `reduceat` (none past the last index), then added up."""
  shape = lambda k: (k, count.shape[1]) if axis == 0 else (count.shape[0], k)
  if not at.size or not at[-1]:
    return np.zeros(shape(at.size), np.int64)
  part = count[:int(at[-1])] if axis == 0 else count[:, :int(at[-1])]
  blocks = np.add.reduceat(part, np.concatenate([[0], at[:-1]]), axis=axis, dtype=np.int64)
  if at[0] == 0:  # reduceat gives an empty block's first element, not zero
    (blocks[0] if axis == 0 else blocks[:, 0])[...] = 0
  return np.cumsum(blocks, axis=axis)


def check_each_token_has_one_slot(s: Scope) -> None:
  """Each real token of a checked home sits in exactly one query slot, a row read in place or a
  slot of its send buffer, and no padding row in any: so the O return, which writes each
  returned row to its home row, is the exact transpose of the Q dispatch, no row is written
  twice, and padding gets zero. Counted over the sent rows' runs, not row by row."""
  T, sent = s.T, s.tables["send_q"]
  own = np.isin(sent.to_dev, s.devices)  # (the table holds the blocks others send them too)
  at = np.searchsorted(s.devices, sent.to_dev[own])
  starts = np.zeros((s.devices.size, T + 1), np.int32)
  np.add.at(starts, (at, sent.to_row[own]), 1)
  np.add.at(starts, (at, sent.to_row[own] + sent.n[own]), -1)
  slots = np.cumsum(starts[:, :T], axis=1) + s.mine(s.plan.local_q_valid)
  wrong = slots != s.real
  if wrong.any():
    i, r = np.argwhere(wrong)[0]
    what = "a real token" if s.real[i, r] else "padding"
    raise PlanMismatchError(f"plan does not match the batch: device {s.devices[i]} row {r}, "
                            f"{what} in the batch, sits in {int(slots[i, r])} query slots")


def _server_query_rows(s: Scope, r: runs.Runs):
  """Runs of a checked server's query rows [local T | received Rq] followed to the home rows
  they hold: (runs on home rows, bad items)."""
  p, T = s.plan, s.T
  r = runs.cut(r, T)
  local = r.row < T
  own, bad1 = runs.follow(r.take(local), s.tables["local_q"], T)
  got = r.take(~local)
  got = got._replace(row=got.row - T)
  recv = runs.exchange_table(p.q.send_count, p.q.recv_off, p.q.send_off, s.devices, max(s.Rq, 1))
  slots, bad2 = runs.follow(got, recv, p.q.send_rows)
  away, bad3 = runs.follow(slots, s.tables["send_q"], T)
  return own.concat(away), np.concatenate([bad1, bad2, bad3])


def _server_kv_rows(s: Scope, r: runs.Runs):
  """Runs of a checked server's gathered K/V slots followed to the local K/V rows of the devices
  that hold them: a round-2 row to the relay's row it was forwarded from, a round-1 row to its
  holder's. (runs on local K/V rows [0, Tkv), bad items)."""
  p, Tkv, first = s.plan, s.Tkv, s.Tkv + s.Rkv
  held, bad = runs.follow(r, s.tables["server_kv"], first + s.Rkv2)
  bad = [bad]
  if s.Rkv2:
    held = runs.cut(held, first)
    second = held.row >= first
    r2 = held.take(second)
    held = held.take(~second)
    recv = runs.exchange_table(p.kv2.send_count, p.kv2.recv_off, p.kv2.send_off, s.devices,
                               s.Rkv2)
    slots, b = runs.follow(r2._replace(row=r2.row - first), recv, p.kv2.send_rows)
    at_relay, b2 = runs.follow(slots, s.tables["send_kv2"], first)
    held = held.concat(at_relay)
    bad += [b, b2]
  held = runs.cut(held, Tkv)
  local = held.row < Tkv
  own, got = held.take(local), held.take(~local)
  if got.n.size:
    recv = runs.exchange_table(p.kv.send_count, p.kv.recv_off, p.kv.send_off,
                               np.unique(got.dev), max(s.Rkv, 1))
    slots, b = runs.follow(got._replace(row=got.row - Tkv), recv, p.kv.send_rows)
    away, b2 = runs.follow(slots, s.kv_send_table(np.unique(got.dev)), Tkv)
    own = own.concat(away)
    bad += [b, b2]
  return own, np.concatenate(bad)


def _positions(s: Scope, r: runs.Runs, kv: bool):
  """Runs on home rows (or, `kv`, local K/V rows: a Pong's rows past T are its prior buffer's)
  to (document, position) runs: `dev` the document, `row` the first position; runs over
  padding are bad. (runs, bad items)."""
  T = s.T
  if not kv or s.layout.prior is None:
    return runs.follow(r, s.tables["shards"], np.iinfo(np.int64).max)
  r = runs.cut(r, T)
  prior = r.row >= T
  own, bad1 = runs.follow(r.take(~prior), s.tables["shards"], np.iinfo(np.int64).max)
  ahead = r.take(prior)
  got, bad2 = runs.follow(ahead._replace(row=ahead.row - T), s.tables["prior_shards"],
                          np.iinfo(np.int64).max)
  return own.concat(got), np.concatenate([bad1, bad2])


def check_tasks_cover_one_document(s: Scope) -> None:
  """Each task of a checked server reads the query rows of consecutive positions of one document
  ending at position kv_len - 1, and as keys exactly that document's positions 0 .. kv_len - 1.
  Each task's rows, and each K/V group's slots, are followed as runs to the (document, position)
  ranges they hold."""
  p = s.plan
  live = (p.q_len > 0) & np.isin(np.arange(s.N), s.devices)[:, None]
  server, slot = np.nonzero(live)
  q_start, q_len = p.q_start[live].astype(np.int64), p.q_len[live].astype(np.int64)
  kv_start, kv_len = p.kv_start[live].astype(np.int64), p.kv_len[live].astype(np.int64)
  tasks = np.arange(q_len.size)

  homed, bad = _server_query_rows(s, runs.Runs.of(tasks, server, q_start, q_len))
  q, bad2 = _positions(s, homed, kv=False)
  bad_q = np.zeros(tasks.size, bool)
  bad_q[bad] = True
  bad_q[bad2] = True
  task_doc = np.full(tasks.size, -2, np.int64)
  head = q.off == 0
  task_doc[q.item[head]] = q.dev[head]  # the document of each task's first query row
  bad_q[q.item[(q.dev != task_doc[q.item]) | (q.row != (kv_len - q_len)[q.item] + q.off)]] = True

  # A server's tasks of one document read prefixes of the same gathered key rows, from one start:
  # each (server, start) group's slots are followed once, over its longest task's keys.
  group = np.unique(server * p.server_kv_idx.shape[-1] + kv_start, return_inverse=True)[1]
  first = np.full(group.max(initial=-1) + 1, q_len.size, np.int64)
  np.minimum.at(first, group, tasks)  # a task standing for its group
  longest = np.zeros(first.size, np.int64)
  np.maximum.at(longest, group, kv_len)
  group_doc = task_doc[first]
  held, bad = _server_kv_rows(s, runs.Runs.of(np.arange(first.size), server[first],
                                              kv_start[first], longest))
  k, bad2 = _positions(s, held, kv=True)
  bad_k = np.zeros(first.size, bool)
  bad_k[bad] = True
  bad_k[bad2] = True
  bad_k[k.item[(k.dev != group_doc[k.item]) | (k.row != k.off)]] = True
  bad_k_task = task_doc != group_doc[group]  # tasks of one start must be of one document

  if bad_q.any() or bad_k.any() or bad_k_task.any() or (task_doc < 0).any():
    t = (int(np.argmax(bad_q)) if bad_q.any() else
         int(first[np.argmax(bad_k)]) if bad_k.any() else
         int(np.argmax(bad_k_task)) if bad_k_task.any() else int(np.argmax(task_doc < 0)))
    raise PlanMismatchError(
        f"plan does not match the batch: task {int(slot[t])} on server {int(server[t])} does not "
        f"cover one document's queries with exactly that document's prefix")
