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

import numpy as np

from distca_jax.data.packing import PAD_SEGMENT, Layout, index_in_runs
from distca_jax.data.sources import Batch
from distca_jax.dispatch.format import (DispatchPlan, PlanMismatchError, exchange_offsets,
                                        rows_selector)


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

  def home_row(self, device, row) -> tuple[np.ndarray, np.ndarray]:
    """(document, position) of home rows `row` of `device` (arrays; PAD_SEGMENT: padding)."""
    return self.layout.locate(device, row)

  def kv_row(self, device, row) -> tuple[np.ndarray, np.ndarray]:
    """(document, position) of local K/V rows `row` of `device`: its buffer's, then (a Pong's)
    the rows of its prior buffer in the other stream."""
    doc, pos = self.layout.locate(device, np.minimum(row, self.T - 1))
    if self.layout.prior is None:
      return doc, pos
    prior_doc, prior_pos = self.layout.prior.locate(device, np.maximum(row - self.T, 0))
    own = row < self.T
    return np.where(own, doc, prior_doc), np.where(own, pos, prior_pos)

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
    return self.plan.recv_q

  @property
  def Rkv(self) -> int:
    return self.plan.recv_kv

  @property
  def Rkv2(self) -> int:
    return self.plan.recv_kv2

  def mine(self, a: np.ndarray) -> np.ndarray:
    """The checked devices' rows of a per-device array."""
    return a[self.rows]



def validate_plan(plan: DispatchPlan, layout: Layout, devices=None, batch: Batch | None = None,
                  prior_batch: Batch | None = None) -> None:
  """Refuses a plan that does not belong to `layout` or breaks its own capacities.

  Follows every row through the plan, vectorised: each real token's output must come from a
  query row holding that same token; each task's query rows must be consecutive positions of one
  document ending at position kv_len - 1, and its key rows exactly that document's positions
  0 .. kv_len - 1. `devices` (default: all) limits the checks to what those devices hold,
  send and receive: the outputs of those homes, the tasks of those servers, the blocks they send
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
  check_padding_is_the_batch_s(scope)
  check_indices_in_range(scope)
  check_kv_inverse(scope)
  check_exchange_counts(scope)
  check_each_token_has_one_slot(scope)
  check_outputs_come_from_their_tokens(scope)
  check_tasks_cover_one_document(scope)


def check_shapes(plan: DispatchPlan, layout: Layout) -> None:
  """The plan is for the batch's N buffers of T rows."""
  N, T = layout.num_buffers, layout.buffer_len
  if plan.return_idx.shape != (N, T) or plan.local_q_idx.shape != (N, T):
    raise PlanMismatchError(f"plan is for buffers {plan.return_idx.shape}, the batch has ({N}, {T})")
  if plan.send_q_idx.shape[0] != N or plan.send_q_count.shape != (N, N) or plan.q_start.shape[0] != N:
    raise PlanMismatchError(f"plan is for {plan.send_q_idx.shape[0]} devices, the batch has {N}")


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


def check_padding_is_the_batch_s(s: Scope) -> None:
  """The plan returns an output exactly for the batch's real tokens."""
  got, want = s.mine(s.plan.return_valid), s.real
  if not np.array_equal(got, want):
    i, r = np.argwhere(got != want)[0]
    raise PlanMismatchError(f"plan does not match the batch: device {s.devices[i]} row {r} is "
                            f"{'padding' if not want[i, r] else 'a real token'} in the batch")


def check_indices_in_range(s: Scope) -> None:
  """Every index points inside the array it indexes."""
  p, T = s.plan, s.T
  server_rows = T + s.Rq  # a server's query rows: local, then received
  home_rows = T + p.send_q_idx.shape[-1]  # a home's outputs: local, then returned to send slots
  return_idx = s.mine(p.return_idx)
  if (return_idx < 0).any() or (return_idx >= home_rows).any():
    raise PlanMismatchError(f"plan return_idx outside the {home_rows} rows a home gets back")
  q_start, q_len, kv_start, kv_len = map(s.mine, (p.q_start, p.q_len, p.kv_start, p.kv_len))
  if (q_start + q_len > server_rows).any() or (kv_start + kv_len > p.server_kv_idx.shape[-1]).any():
    raise PlanMismatchError("plan task table indexes rows past its capacities")
  if (q_len > kv_len).any():
    raise PlanMismatchError("plan has a task with more queries than keys")
  server_kv_idx = s.mine(p.server_kv_idx)
  if (server_kv_idx < 0).any() or (server_kv_idx >= s.Tkv + s.Rkv + s.Rkv2).any():
    raise PlanMismatchError("plan server_kv_idx outside the rows a server receives")
  # The checked devices' own buffers; the rows others send them are followed (and checked) by
  # `check_tasks_cover_one_document`.
  for name, a, limit in (("local_q_idx", s.mine(p.local_q_idx), T),
                         ("send_q_idx", s.mine(p.send_q_idx), T),
                         ("send_kv_idx", s.mine(p.send_kv_idx), s.Tkv),
                         ("send_kv2_idx", s.mine(p.send_kv2_idx), s.Tkv + s.Rkv)):
    if a.size and (a.min() < 0 or a.max() >= limit):
      raise PlanMismatchError(f"plan {name} outside the {limit} rows of a buffer")


def check_kv_inverse(s: Scope) -> None:
  """`server_kv_inv` is the exact inverse of `server_kv_idx`: the backward runs the exchange
  transposed, gathering by it (`exchange._kv_grads_to_home`). Every filled slot's row maps back
  to that slot and no other row is marked: then no row fills two slots (O(slots), no inverse
  rebuilt)."""
  p = s.plan
  rows = s.Tkv + s.Rkv + s.Rkv2
  if p.server_kv_inv.shape != (s.N, rows) or p.server_kv_inv_valid.shape != (s.N, rows):
    raise PlanMismatchError("plan server_kv_inv is not the inverse of its server_kv_idx")
  i, slot = np.nonzero(s.mine(p.server_kv_valid))
  d, target = s.devices[i], s.mine(p.server_kv_idx)[i, slot]
  if (int(s.mine(p.server_kv_inv_valid).sum()) != d.size
      or not p.server_kv_inv_valid[d, target].all() or (p.server_kv_inv[d, target] != slot).any()):
    if np.unique(d * rows + target).size < d.size:  # (the failure path only)
      raise PlanMismatchError("plan gathers one K/V row into two server slots")
    raise PlanMismatchError("plan server_kv_inv is not the inverse of its server_kv_idx")


def check_exchange_counts(s: Scope) -> None:
  """The exchange's counts and offsets describe its packed buffers: no row to itself, what s
  receives from d is what d sends, offsets are the exclusive prefix sums of the counts (so the
  valid rows of a send buffer are its first ones), every buffer holds its rows, and the tiled
  exchange's blocks hold theirs."""
  p = s.plan
  for name, valid, recv_rows, block in (
      ("q", p.send_q_valid, s.Rq, p.c), ("kv", p.send_kv_valid, s.Rkv, p.ckv),
      ("kv2", p.send_kv2_valid, s.Rkv2, p.ckv2)):
    count = np.asarray(getattr(p, f"send_{name}_count"), np.int64)
    send_off, recv_off = exchange_offsets(count)
    want = {f"recv_{name}_count": count.T, f"send_{name}_off": send_off,
            f"recv_{name}_off": recv_off, f"peer_{name}_off": recv_off.T,
            f"back_{name}_off": send_off.T}
    if (count.shape != (s.N, s.N) or np.diagonal(count).any() or (count < 0).any()
        or any(not np.array_equal(getattr(p, k), v) for k, v in want.items())):
      raise PlanMismatchError(f"plan send_{name}_count / recv_{name}_count and their offsets do "
                              f"not describe one packed exchange (recv the transpose, offsets "
                              f"their prefix sums)")
    sent, got = count.sum(1), count.sum(0)
    if sent.max(initial=0) > valid.shape[-1] or got.max(initial=0) > recv_rows:
      raise PlanMismatchError(f"plan's {name} rows do not fit its buffers: a device sends "
                              f"{int(sent.max())} of {valid.shape[-1]} / receives "
                              f"{int(got.max())} of {recv_rows}")
    if not np.array_equal(s.mine(valid), np.arange(valid.shape[-1])[None, :] < s.mine(sent)[:, None]):
      raise PlanMismatchError(f"plan send_{name}_valid is not the first send_{name}_count rows "
                              f"of each send buffer")
    if block and count.max(initial=0) > block:
      raise PlanMismatchError(f"plan sends {int(count.max())} {name} rows between two devices, "
                              f"more than the tiled exchange's blocks of {block}")


def check_each_token_has_one_slot(s: Scope) -> None:
  """As many query slots as real tokens: a local row or a row it sends, per checked home (with
  the next check, every real token sits in exactly one slot, so the O return is the exact
  transpose of the Q dispatch)."""
  slots = int(s.mine(s.plan.local_q_valid).sum()) + int(s.mine(s.plan.send_q_valid).sum())
  tokens = int(s.real.sum())
  if slots != tokens:
    raise PlanMismatchError(f"plan places {slots} query rows on servers for {tokens} real tokens")


def _sender(count: np.ndarray, recv_off: np.ndarray, server, row):
  """(sender, its send-buffer slot, valid) of row `row` of server `server`'s receive buffer
  (arrays): the last sender whose rows start at or before it (senders of no rows share the next
  one's offset, and sort before it), `row` past its rows invalid."""
  N = count.shape[0]
  row = np.asarray(row, np.int64)
  span = int(max(recv_off.max(initial=0) + count.max(initial=0), row.max(initial=0))) + 1
  keys = (np.arange(N)[:, None] * span + recv_off).reshape(-1)  # sorted: offsets grow with d
  sender = np.searchsorted(keys, server * span + row, side="right") - 1 - server * N
  sender = np.clip(sender, 0, N - 1)
  j = row - recv_off[server, sender]
  ok = (j >= 0) & (j < count[sender, server])
  return sender, j, ok


def _query_row_source(s: Scope, server, row):
  """(home device, home row, valid) of server `server`'s query row `row` (arrays): rows < T are
  its local rows, row T + r is row r of its receive buffer, which home h sent from its send
  buffer at send_q_off[h, server] + (r - recv_q_off[server, h])."""
  p, T = s.plan, s.T
  local_row = np.minimum(row, T - 1)
  if not s.Rq:  # nothing is exchanged: every row is local
    return server, p.local_q_idx[server, local_row], p.local_q_valid[server, local_row]
  home, j, ok = _sender(p.send_q_count, p.recv_q_off, server, np.maximum(row - T, 0))
  slot = np.clip(p.send_q_off[home, server] + j, 0, p.send_q_idx.shape[-1] - 1)
  sent = p.send_q_idx[home, slot]
  ok &= p.send_q_valid[home, slot] & (sent >= 0) & (sent < T)  # a sender's rows, not checked yet
  local = row < T
  return (np.where(local, server, home),
          np.where(local, p.local_q_idx[server, local_row], np.clip(sent, 0, T - 1)),
          np.where(local, p.local_q_valid[server, local_row], ok))


def _kv_row_source(s: Scope, server, slot):
  """(home device, home K/V row, valid) of slot `slot` of server `server`'s gathered K/V rows:
  a round-2 row is followed to the relay's row it was forwarded from, then as a round-1 row."""
  p = s.plan
  v = p.server_kv_idx[server, slot].astype(np.int64)
  ok = p.server_kv_valid[server, slot]
  server = np.broadcast_to(server, v.shape)
  if s.Rkv2:
    first = s.Tkv + s.Rkv  # a relay's rows it forwards from: [local Tkv | round-1 Rkv]
    relay, row, sent = _received_row(s, "kv2", server, v - first, first)
    second = v >= first
    server, v = np.where(second, relay, server), np.where(second, row, v)
    ok = ok & np.where(second, sent, True)
  if not s.Rkv:
    return server, np.clip(v, 0, s.Tkv - 1), ok & (v < s.Tkv)
  home, row, sent = _received_row(s, "kv", server, v - s.Tkv, s.Tkv)
  local = v < s.Tkv
  return (np.where(local, server, home), np.where(local, v, row),
          ok & np.where(local, True, sent))


def _received_row(s: Scope, name: str, server, r, rows: int):
  """(sender, its row, valid) of row `r` of server `server`'s receive buffer of the K/V round
  `name` ("kv" or "kv2"): the sender's send slot and the row of its `rows` it was gathered from
  (`r` < 0 or past the sender's rows invalid)."""
  p = s.plan
  idx, valid = getattr(p, f"send_{name}_idx"), getattr(p, f"send_{name}_valid")
  sender, j, sent = _sender(getattr(p, f"send_{name}_count"), getattr(p, f"recv_{name}_off"),
                            server, np.maximum(r, 0))
  slot = np.clip(getattr(p, f"send_{name}_off")[sender, server] + j, 0, max(idx.shape[-1] - 1, 0))
  if not idx.shape[-1]:
    return sender, np.zeros_like(slot), np.zeros(slot.shape, bool)
  row = idx[sender, slot]
  sent &= (r >= 0) & valid[sender, slot] & (row >= 0) & (row < rows)
  return sender, np.clip(row, 0, rows - 1), sent


def check_outputs_come_from_their_tokens(s: Scope) -> None:
  """Each real token's output row is the server row that received that same token. Home d's row
  r < T is its local row r; row T + j came back to slot j of its send buffer, from the server
  the query row in that slot went to (the reverse exchange mirrors the forward one)."""
  p, T = s.plan, s.T
  r = s.mine(p.return_idx).astype(np.int64)
  home = np.broadcast_to(s.devices[:, None], r.shape)
  local_row = np.minimum(r, T - 1)
  if p.send_q_idx.shape[-1]:
    slot = np.clip(r - T, 0, p.send_q_idx.shape[-1] - 1)
    got = np.where(r < T, p.local_q_idx[home, local_row], p.send_q_idx[home, slot])
    ok = np.where(r < T, p.local_q_valid[home, local_row], p.send_q_valid[home, slot])
  else:
    got, ok = p.local_q_idx[home, local_row], p.local_q_valid[home, local_row]
  wrong = s.real & ((got != np.arange(T)[None]) | ~ok)
  if wrong.any():
    i, row = np.argwhere(wrong)[0]
    raise PlanMismatchError(f"plan does not match the batch: the output for device "
                            f"{s.devices[i]} row {row} would come from another token")


def _expand(start, length):
  """Rows of ranges [start, start + length): (range of each row, row, offset in its range)."""
  offset = index_in_runs(length)
  return np.repeat(np.arange(length.size), length), np.repeat(start, length) + offset, offset


def check_tasks_cover_one_document(s: Scope) -> None:
  """Each task of a checked server reads the query rows of consecutive positions of one document
  ending at position kv_len - 1, and as keys exactly that document's positions 0 .. kv_len - 1."""
  p = s.plan
  live = (p.q_len > 0) & np.isin(np.arange(s.N), s.devices)[:, None]
  server, slot = np.nonzero(live)
  q_start, q_len = p.q_start[live].astype(np.int64), p.q_len[live].astype(np.int64)
  kv_start, kv_len = p.kv_start[live].astype(np.int64), p.kv_len[live].astype(np.int64)

  task, row, offset = _expand(q_start, q_len)
  home, home_row, q_ok = _query_row_source(s, server[task], row)
  q_doc, q_pos = s.home_row(home, home_row)
  task_doc = np.full(q_len.size, -2, np.int64)
  task_doc[task[::-1]] = q_doc[::-1]  # the document of each task's first query row
  bad_q = ~q_ok | (q_doc != task_doc[task]) | (q_pos != (kv_len - q_len)[task] + offset)

  # A server's tasks of one document read prefixes of the same gathered key rows, from one start:
  # each (server, start) group's slots are followed once, over its longest task's keys (work of
  # the server's K/V buffer, not of every task's prefix again).
  group = np.unique(server * p.server_kv_idx.shape[-1] + kv_start, return_inverse=True)[1]
  first = np.full(group.max(initial=-1) + 1, q_len.size, np.int64)
  np.minimum.at(first, group, np.arange(q_len.size))  # a task standing for its group
  longest = np.zeros(first.size, np.int64)
  np.maximum.at(longest, group, kv_len)
  group_doc = task_doc[first]
  kv_group, kv_slot, kv_offset = _expand(kv_start[first], longest)
  holder, kv_row, k_ok = _kv_row_source(s, server[first][kv_group], kv_slot)
  k_doc, k_pos = s.kv_row(holder, kv_row)
  bad_k = ~k_ok | (k_doc != group_doc[kv_group]) | (k_pos != kv_offset)
  bad_k_task = task_doc != group_doc[group]  # tasks of one start must be of one document

  if bad_q.any() or bad_k.any() or bad_k_task.any() or (task_doc == PAD_SEGMENT).any():
    t = (int(task[np.argmax(bad_q)]) if bad_q.any() else
         int(first[kv_group[np.argmax(bad_k)]]) if bad_k.any() else
         int(np.argmax(bad_k_task)) if bad_k_task.any() else 0)
    raise PlanMismatchError(
        f"plan does not match the batch: task {int(slot[t])} on server {int(server[t])} does not "
        f"cover one document's queries with exactly that document's prefix")
