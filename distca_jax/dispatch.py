"""Core attention disaggregation (CAD): dispatch CA-tasks to attention servers and back.

Every device of the server pool `ROW_AXES` = (pipe, data) is both the home of a buffer of T
tokens and an attention server (without pipeline parallelism `pipe` has size 1: the pool is
`data`; with it, every stage's rows are balanced together, idle stages only serve). Per layer,
inside one `shard_map` over (pipe, data, tensor) — each tensor rank serves its own heads among
the devices that share its tensor rank — a device:

  1. gathers the Q rows and the (deduplicated) K/V rows each server needs into per-server send
     blocks of fixed capacity,
  2. exchanges them with one `all_to_all` over the pool: tiled, every block padded to the plan's
     capacity (CPU and GPU), or with `attention.exchange: ragged` only the rows that move
     (`jax.lax.ragged_all_to_all`, GPU only; slower on XLA 0.11, whose NCCL implementation
     waits for the stream on the host before every call: docs/PERFORMANCE.md),
  3. as a server, gathers its K/V rows so every document prefix is contiguous and runs the
     kernel over its fused task batch (`kernels.attention`),
  4. returns O by the reverse `all_to_all`, and each home row picks its output.

Which task runs where comes from the scheduler (`distca_jax.schedule`); `build_dispatch` lays
its tasks out as static int32 arrays (`DispatchPlan`). Rows that stay home are copied locally
rather than sent, so the all_to_all carries only rows that really move, each (device, server)
block padded to a small bucket.

Gradients: the row movements are linear maps with explicit transposes (custom VJPs): the Q
dispatch and the O return are each other's transpose (gathers and the reverse all_to_all); the
K/V gradients gather back by the inverse of the server's K/V gather, return by the reverse
all_to_all and are summed onto their home rows — which is exactly the summing of the gradients
of K/V rows that several servers received. Memory modes: `keep` lets autodiff keep what the
server received for the backward; `resend` wraps the exchange and the kernel in `jax.checkpoint`
so the server keeps nothing and the backward sends Q, K, V again (and recomputes the server's
forward: one more attention forward per layer, traded for the memory).

Ping-pong: with `attention.pingpong`, each micro-batch is split into two nano-batches (Ping and
Pong, `schedule/pingpong.py`), each with its own plan; the model runs them as two data-independent
streams (models/llama.py), so XLA can overlap one stream's all_to_all with the other's compute.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from distca_jax import kernels
from distca_jax.data.packing import PAD_SEGMENT, Layout
from distca_jax.data.sources import Batch
from distca_jax.kernels import TaskTable
from distca_jax.mesh import ROW_AXES
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.pingpong import pingpong_layouts
from distca_jax.schedule.items import Tasks, exchange_capacity
from distca_jax.schedule.plan import Plan, cumsum_in_groups, fill_ranges, make_plan
from distca_jax.schedule.planner import kv_requests, pair_rows

log = logging.getLogger(__name__)

_ARRAY_FIELDS = ("local_q_idx", "local_q_valid", "send_q_idx", "send_q_valid", "send_kv_idx",
                 "send_kv_valid", "server_kv_idx", "server_kv_valid", "server_kv_inv",
                 "server_kv_inv_valid", "q_start", "q_len", "kv_start", "kv_len", "return_idx",
                 "return_valid", "send_q_count", "recv_q_count", "send_kv_count", "recv_kv_count")


class PlanMismatchError(ValueError):
  """A dispatch plan does not belong to the batch it is used with, or breaks its capacities."""


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(_ARRAY_FIELDS),
                   meta_fields=["shift_q", "shift_kv"])
@dataclasses.dataclass(frozen=True)
class DispatchPlan:
  """One step's dispatch arrays, leading dim N (one row per device, sharded over `ROW_AXES`).

  Server-side rows are laid out as [local rows | rows received from each device (N * C)]; the
  local K/V rows are the device's T rows, or for ping-pong's Pong 2T: its own, then Ping's
  (`Layout.prior`: the prefix of the document the split cut is in Ping's buffers):

  local_q_idx   [N, T]       home rows kept for local tasks, in the order the tasks expect
  local_q_valid [N, T]       bool (unused local rows: 0 and False; no task reads them)
  send_q_idx    [N, N, C]    home rows sent to each server (the diagonal block is unused)
  send_q_valid  [N, N, C]    bool
  send_kv_idx   [N, N, Ckv]  local K/V rows sent to each server (diagonal unused)
  send_kv_valid [N, N, Ckv]
  server_kv_idx [N, Skv]     server-side K/V gather over [local Tkv | received N*Ckv] rows
  server_kv_valid [N, Skv]
  server_kv_inv [N, Tkv + N*Ckv]  its inverse (each K/V row a server holds sits in at most one
  server_kv_inv_valid           slot): the backward gathers K/V gradients instead of scattering
  q_start, q_len, kv_start, kv_len [N, Ctask]  the server's task table (kernels/tasks.py) over
                             its [local T | received N*C] query rows and gathered K/V rows
  return_idx    [N, T]       where home row r's output is in [local T | returned N*C] rows
  return_valid  [N, T]       False for padding tokens (output zero)
  send_q_count  [N, N]       rows of each send block that are real (valid rows are packed from
  recv_q_count  [N, N]       the block's start); rows received from each device (the transpose)
  send_kv_count, recv_kv_count [N, N]  the same for K/V. With `attention.exchange: ragged` only
                             these rows travel (`jax.lax.ragged_all_to_all`, GPU)
  shift_q, shift_kv          static: with `attention.exchange: shifted`, the rows that travel
                             per shift k = 1 .. N-1 (device d's block for server d + k mod N,
                             one `ppermute` each; every block of a shift at that shift's
                             largest); () for the other exchanges
  """

  local_q_idx: Any
  local_q_valid: Any
  send_q_idx: Any
  send_q_valid: Any
  send_kv_idx: Any
  send_kv_valid: Any
  server_kv_idx: Any
  server_kv_valid: Any
  server_kv_inv: Any
  server_kv_inv_valid: Any
  q_start: Any
  q_len: Any
  kv_start: Any
  kv_len: Any
  return_idx: Any
  return_valid: Any
  send_q_count: Any
  recv_q_count: Any
  send_kv_count: Any
  recv_kv_count: Any
  shift_q: tuple = ()
  shift_kv: tuple = ()


# ----------------------------------------------------------------------------- host side


def build_dispatch(tasks: Tasks, layout: Layout, skv: int, ctask: int, c: int | None = None,
                   ckv: int | None = None, devices=None, kv=None) -> DispatchPlan:
  """The dispatch arrays of a task placement (`DispatchPlan`), straight from the scheduler's
  tasks: stay-home rows local, every off-diagonal (device, server) block padded to the smallest
  bucket that holds the rows that really move (or to `c` / `ckv` when given: several plans of one
  shape). `skv` / `ctask`: the server's K/V-buffer and task-table capacities (the scheduler's
  `Plan.capacities`). `devices` (default: all): fill only what those devices hold, send and
  receive (their rows, and the blocks they send or receive); the other rows stay zero, never
  touched (numpy's zeros are not committed until written), so a process of a large job pays
  for its own devices; shapes and counts are those of the whole plan on every process. Work is a
  loop over tasks and K/V pieces, never over tokens. `kv`: the tasks' `kv_requests`, when
  already at hand. Raises PlanMismatchError when a capacity is too small."""
  n, t = layout.num_buffers, layout.buffer_len
  tkv = layout.kv_rows  # K/V rows per device: its buffer, then a ping-pong prior buffer's
  mine = np.ones(n, bool) if devices is None else np.isin(np.arange(n), devices)
  kv = kv_requests(tasks, layout) if kv is None else kv
  # Rows per block of the whole plan (every process agrees on them, whatever it fills).
  q_pairs, kv_pairs = pair_rows(tasks, layout, kv)
  moved_q, moved_kv = int(q_pairs.max(initial=0)), int(kv_pairs.max(initial=0))
  c = exchange_capacity(moved_q, t) if c is None else c
  ckv = exchange_capacity(moved_kv, t) if ckv is None else ckv
  if moved_q > c or moved_kv > ckv:
    raise PlanMismatchError(f"plan moves {moved_q} query / {moved_kv} K/V rows between two "
                            f"devices, more than the capacities {c} / {ckv}")

  # Queries, grouped by (home, server) block in home-row order: a block's rows are packed from
  # its start; the diagonal block is the server's local rows [0, T), the others are sent.
  block = tasks.home * n + tasks.server
  order = np.lexsort((tasks.home_off, block))
  home, server = tasks.home[order], tasks.server[order]
  hoff, ql, qhi, doc = (tasks.home_off[order], tasks.q_len[order], tasks.q_hi[order],
                        tasks.doc[order])
  pos = cumsum_in_groups(ql, block[order])
  local = home == server
  if np.bincount(home[local], weights=ql[local], minlength=n).max(initial=0) > t:
    raise PlanMismatchError("plan keeps more than T rows at home")
  local_q_idx = np.zeros(n * t, np.int32)
  local_q_valid = np.zeros(n * t, bool)
  w = local & mine[home]
  fill_ranges(local_q_idx, local_q_valid, home[w] * t + pos[w], hoff[w], ql[w])
  send_q_idx = np.zeros(n * n * c, np.int32)
  send_q_valid = np.zeros(n * n * c, bool)
  w = ~local & (mine[home] | mine[server])
  fill_ranges(send_q_idx, send_q_valid, block[order][w] * c + pos[w], hoff[w], ql[w])
  # Server-side query row of a task's first row: local rows first, then T + home * c + j.
  q_start = np.where(local, pos, t + home * c + pos)
  # Home-side row of each output: local rows, then T + server * c + j of the returned blocks.
  return_idx = np.zeros(n * t, np.int32)
  return_valid = np.zeros(n * t, bool)
  w = mine[home]
  fill_ranges(return_idx, return_valid, home[w] * t + hoff[w],
              np.where(local, pos, t + server * c + pos)[w], ql[w])

  # Keys/values: deduplicated prefix pieces (one per server, document and holding shard). A
  # server reads its own pieces from its buffer; the others arrive in (source, server) blocks.
  dst = kv.pair_server[kv.piece_pair]
  kblk = kv.piece_src * n + dst
  korder = np.lexsort((kv.piece_doc_off, kv.piece_pair, kblk))
  src, kdst, rows = kv.piece_src[korder], dst[korder], kv.piece_rows[korder]
  src_off = kv.piece_src_off[korder]
  kpos = cumsum_in_groups(rows, kblk[korder])
  own = src == kdst
  send_kv_idx = np.zeros(n * n * ckv, np.int32)
  send_kv_valid = np.zeros(n * n * ckv, bool)
  w = ~own & (mine[src] | mine[kdst])
  fill_ranges(send_kv_idx, send_kv_valid, kblk[korder][w] * ckv + kpos[w], src_off[w], rows[w])
  # The server's K/V buffer: each (server, document) pair a contiguous prefix region.
  need = np.bincount(kv.pair_server, weights=kv.pair_need, minlength=n).max(initial=0)
  if need > skv:
    raise PlanMismatchError(f"plan gathers {int(need)} K/V rows on one server, more than the "
                            f"capacity {skv}")
  pair_base = cumsum_in_groups(kv.pair_need, kv.pair_server)
  server_kv_idx = np.zeros(n * skv, np.int32)
  server_kv_valid = np.zeros(n * skv, bool)
  pair = kv.piece_pair[korder]
  w = mine[kdst]
  fill_ranges(server_kv_idx, server_kv_valid,
              (kdst * skv + pair_base[pair] + kv.piece_doc_off[korder])[w],
              np.where(own, src_off, tkv + src * ckv + kpos)[w], rows[w])

  # Task tables: per server, in order of their query rows.
  num_docs = max(int(np.asarray(layout.doc_lens).size), 1)
  tpair = np.searchsorted(kv.pair_server * num_docs + kv.pair_doc, server * num_docs + doc)
  torder = np.lexsort((q_start, server))
  srv = server[torder]
  slot = cumsum_in_groups(np.ones_like(srv), srv)
  if srv.size and slot.max() >= ctask:
    raise PlanMismatchError(f"plan has {int(slot.max()) + 1} tasks on one server, more than the "
                            f"capacity {ctask}")
  w = mine[srv]
  flat, torder = (srv * ctask + slot)[w], torder[w]
  tab = {k: np.zeros(n * ctask, np.int32) for k in ("q_start", "q_len", "kv_start", "kv_len")}
  tab["q_start"][flat] = q_start[torder]
  tab["q_len"][flat] = ql[torder]
  tab["kv_start"][flat] = pair_base[tpair[torder]]
  tab["kv_len"][flat] = qhi[torder]

  server_kv_idx = server_kv_idx.reshape(n, skv)
  server_kv_valid = server_kv_valid.reshape(n, skv)
  kv_inv, kv_inv_valid = _kv_inverse(server_kv_idx, server_kv_valid, tkv + n * ckv, devices)
  send_q_valid = send_q_valid.reshape(n, n, c)
  send_kv_valid = send_kv_valid.reshape(n, n, ckv)
  send_q_count, send_kv_count = q_pairs.astype(np.int32), kv_pairs.astype(np.int32)
  return DispatchPlan(
      local_q_idx=local_q_idx.reshape(n, t), local_q_valid=local_q_valid.reshape(n, t),
      send_q_idx=send_q_idx.reshape(n, n, c), send_q_valid=send_q_valid,
      send_kv_idx=send_kv_idx.reshape(n, n, ckv), send_kv_valid=send_kv_valid,
      server_kv_idx=server_kv_idx, server_kv_valid=server_kv_valid,
      server_kv_inv=kv_inv, server_kv_inv_valid=kv_inv_valid,
      **{k: v.reshape(n, ctask) for k, v in tab.items()},
      return_idx=return_idx.reshape(n, t), return_valid=return_valid.reshape(n, t),
      send_q_count=send_q_count, recv_q_count=np.ascontiguousarray(send_q_count.T),
      send_kv_count=send_kv_count, recv_kv_count=np.ascontiguousarray(send_kv_count.T))


def _kv_inverse(server_kv_idx: np.ndarray, server_kv_valid: np.ndarray, rows: int,
                servers=None) -> tuple[np.ndarray, np.ndarray]:
  """For each of a server's `rows` K/V rows, the slot of its gathered K/V buffer holding it
  (`server_kv_idx`'s inverse), and whether one does; for `servers` only (default: all, the
  others' rows stay zero). Raises if a row fills two slots."""
  N = server_kv_idx.shape[0]
  sel = _rows_selector(N, servers)
  d, j = np.nonzero(server_kv_valid[sel])
  d = np.arange(N)[sel][d]
  target = server_kv_idx[d, j]
  inv = np.zeros((N, rows), np.int32)
  valid = np.zeros((N, rows), bool)
  inv[d, target] = j
  # Slots (d, j) are distinct, so a row written from two slots keeps only the last one.
  if (inv[d, target] != j).any():
    raise PlanMismatchError("plan gathers one K/V row into two server slots")
  valid[d, target] = True
  return inv, valid


def _rows_selector(n: int, devices):
  """An index for the rows `devices` (default: all) of an [n, ...] array: a slice when they are
  consecutive, as a process's devices usually are (a view, no copy), else the sorted rows."""
  if devices is None:
    return slice(None)
  d = np.unique(np.asarray(devices, np.int64))
  return slice(int(d[0]), int(d[-1]) + 1) if d.size and d[-1] - d[0] + 1 == d.size else d


def validate_plan(plan: DispatchPlan, layout: Layout, devices=None, batch: Batch | None = None,
                  prior_batch: Batch | None = None) -> None:
  """Refuses a plan that does not belong to `layout` or breaks its own capacities.

  Follows every row through the plan, vectorised: each real token's output must come from a
  query row holding that same token; each task's query rows must be consecutive positions of one
  document ending at position kv_len - 1, and its key rows exactly that document's positions
  0 .. kv_len - 1. A plan made for another batch (other document boundaries) therefore fails even
  when its shapes fit. `devices` (default: all) limits the checks to what those devices hold,
  send and receive: the outputs of those homes, the tasks of those servers, the blocks they send
  and receive (each process checks the devices it feeds, `build_dispatch(devices=...)` fills only
  those). `batch`: the Batch packed by `layout`, whose segment ids and positions are then not
  computed again. `prior_batch` (ping-pong's Pong): Ping's Batch, whose rows the layout's prior
  shards name; each must hold the position the shard says. Raises PlanMismatchError naming what
  is wrong.
  """
  N, T = layout.num_buffers, layout.buffer_len
  p = plan
  if p.return_idx.shape != (N, T) or p.local_q_idx.shape != (N, T):
    raise PlanMismatchError(f"plan is for buffers {p.return_idx.shape}, the batch has ({N}, {T})")
  if p.send_q_idx.shape[:2] != (N, N) or p.q_start.shape[0] != N:
    raise PlanMismatchError(f"plan is for {p.send_q_idx.shape[0]} devices, the batch has {N}")
  D = np.arange(N) if devices is None else np.unique(np.asarray(devices, np.int64))
  if D.size and (D[0] < 0 or D[-1] >= N):
    raise ValueError(f"validate_plan: devices {devices} outside the plan's {N} devices")
  # Rows of per-device arrays, and the (device, server) blocks, that the devices D read or fill:
  # their own rows, the blocks they send and the blocks they receive.
  sel = _rows_selector(N, D)
  rows_of = lambda a: a[sel]
  blocks_of = lambda a: (a[sel], a[:, sel])
  if batch is not None and batch.layout is not layout:
    raise ValueError("validate_plan: `batch` is not packed by `layout`")
  seg = layout.segment_ids() if batch is None else batch.segment_ids
  pos = layout.positions() if batch is None else batch.positions
  real = seg != PAD_SEGMENT
  TKV = layout.kv_rows  # K/V rows: the buffer's, then (ping-pong's Pong) the prior buffer's
  seg_kv, pos_kv = seg, pos
  if layout.prior is not None:
    prior_seg, prior_pos = layout.prior.segment_ids(), layout.prior.positions()
    named = prior_seg != PAD_SEGMENT
    if prior_batch is not None and (prior_batch.positions.shape != (N, T)
                                    or (prior_batch.segment_ids[named] == PAD_SEGMENT).any()
                                    or (prior_batch.positions[named] != prior_pos[named]).any()):
      raise PlanMismatchError("plan does not match the batch: the rows of the earlier stream that "
                              "its prior shards name hold other positions")
    seg_kv = np.concatenate([seg, prior_seg], axis=1)
    pos_kv = np.concatenate([pos, prior_pos], axis=1)
  if not np.array_equal(rows_of(p.return_valid), real[D]):
    i, r = np.argwhere(rows_of(p.return_valid) != real[D])[0]
    raise PlanMismatchError(f"plan does not match the batch: device {D[i]} row {r} is "
                            f"{'padding' if not real[D[i], r] else 'a real token'} in the batch")
  c, ckv = p.send_q_idx.shape[-1], p.send_kv_idx.shape[-1]
  rows = T + N * c
  if (rows_of(p.return_idx) < 0).any() or (rows_of(p.return_idx) >= rows).any():
    raise PlanMismatchError(f"plan return_idx outside the {rows} rows of a server's output")
  q_start, q_len, kv_start, kv_len = map(rows_of, (p.q_start, p.q_len, p.kv_start, p.kv_len))
  if (q_start + q_len > rows).any() or (kv_start + kv_len > p.server_kv_idx.shape[-1]).any():
    raise PlanMismatchError("plan task table indexes rows past its capacities")
  if (q_len > kv_len).any():
    raise PlanMismatchError("plan has a task with more queries than keys")
  server_kv_idx = rows_of(p.server_kv_idx)
  if (server_kv_idx < 0).any() or (server_kv_idx >= TKV + N * ckv).any():
    raise PlanMismatchError("plan server_kv_idx outside the rows a server receives")
  for name, parts, limit in (("local_q_idx", (rows_of(p.local_q_idx),), T),
                             ("send_q_idx", blocks_of(p.send_q_idx), T),
                             ("send_kv_idx", blocks_of(p.send_kv_idx), TKV)):
    if any(a.size and (a.min() < 0 or a.max() >= limit) for a in parts):
      raise PlanMismatchError(f"plan {name} outside the {limit} rows of a buffer")
  # The backward runs the exchange transposed (gathers by these inverses, `_server_exchange`):
  # exact only if every query row sits in at most one server slot and the K/V inverse matches.
  # Every filled slot's row maps back to that slot, and no other row is marked: then no row
  # fills two slots and the inverse is exact (O(slots), no inverse rebuilt).
  if p.server_kv_inv.shape != (N, TKV + N * ckv) or p.server_kv_inv_valid.shape != (N, TKV + N * ckv):
    raise PlanMismatchError("plan server_kv_inv is not the inverse of its server_kv_idx")
  i_, j_ = np.nonzero(rows_of(p.server_kv_valid))
  d_, target = D[i_], server_kv_idx[i_, j_]
  if (int(rows_of(p.server_kv_inv_valid).sum()) != d_.size
      or not p.server_kv_inv_valid[d_, target].all() or (p.server_kv_inv[d_, target] != j_).any()):
    if np.unique(d_ * (TKV + N * ckv) + target).size < d_.size:  # (the failure path only)
      raise PlanMismatchError("plan gathers one K/V row into two server slots")
    raise PlanMismatchError("plan server_kv_inv is not the inverse of its server_kv_idx")
  # The exchange's counts: valid rows packed from each block's start (a ragged exchange sends
  # rows [0, count) of a block), none on the diagonal, and what s receives from d is what d sends.
  for name, valid, send, recv in (("q", p.send_q_valid, p.send_q_count, p.recv_q_count),
                                  ("kv", p.send_kv_valid, p.send_kv_count, p.recv_kv_count)):
    ramp = np.arange(valid.shape[-1])
    if (send.shape != (N, N) or not np.array_equal(recv, send.T) or np.diagonal(send).any()
        or not all(np.array_equal(v, ramp < n[..., None])
                   for v, n in zip(blocks_of(valid), blocks_of(send)))):
      raise PlanMismatchError(f"plan send_{name}_count / recv_{name}_count do not describe its "
                              f"send blocks (rows packed from the start, recv the transpose)")
    # A shifted exchange sends rows [0, shift[k - 1]) of each block d -> d + k: none may lie past.
    shift = p.shift_q if name == "q" else p.shift_kv
    if shift:
      if len(shift) != N - 1 or max(shift) > valid.shape[-1]:
        raise PlanMismatchError(f"plan shift_{name} {shift} is not one capacity <= "
                                f"{valid.shape[-1]} per shift of {N} devices")
      k = (np.arange(N)[None, :] - np.arange(N)[:, None]) % N  # [d, s]: the shift of block d -> s
      cap = np.asarray((0,) + tuple(shift))[k]
      if (send > cap).any():
        d, s_ = np.argwhere(send > cap)[0]
        raise PlanMismatchError(f"plan sends {int(send[d, s_])} {name} rows from device {d} to "
                                f"{s_}, more than shift {int(k[d, s_])}'s capacity {int(cap[d, s_])}")
  # Every real token of a home in D sits in exactly one slot: a local row or a row it sends.
  off_diag = D[:, None] != np.arange(N)[None, :]
  slots = int(rows_of(p.local_q_valid).sum()) + int((rows_of(p.send_q_valid) & off_diag[..., None]).sum())
  if slots != int(real[D].sum()):
    raise PlanMismatchError(f"plan places {slots} query rows on servers for "
                            f"{int(real[D].sum())} real tokens")

  # Outputs: each real token's output row holds that token. Home d's row r < T is its local
  # row r; row T + s*c + j comes back from server s, which received it as row j of d's block.
  homes = D
  r = rows_of(p.return_idx).astype(np.int64)
  c1 = max(c, 1)  # c = 0: nothing is exchanged, every row is local (r < T)
  hb = np.broadcast_to(homes[:, None], r.shape)
  rl, s_, j_ = np.minimum(r, T - 1), np.maximum(r - T, 0) // c1, np.maximum(r - T, 0) % c1
  if c:
    got = np.where(r < T, p.local_q_idx[hb, rl], p.send_q_idx[hb, s_, j_])
    ok = np.where(r < T, p.local_q_valid[hb, rl], p.send_q_valid[hb, s_, j_])
  else:
    got, ok = p.local_q_idx[hb, rl], p.local_q_valid[hb, rl]
  wrong = real[homes] & ((got != np.arange(T)[None]) | ~ok)
  if wrong.any():
    bad = np.argwhere(wrong)[0]
    raise PlanMismatchError(f"plan does not match the batch: the output for device "
                            f"{homes[bad[0]]} row {bad[1]} would come from another token")

  def q_identity(srv, row):
    """(home device, home row, valid) of server `srv`'s query row `row` (arrays)."""
    local = row < T
    rl, h, j = np.minimum(row, T - 1), np.maximum(row - T, 0) // c1, np.maximum(row - T, 0) % c1
    if not c:
      return srv, p.local_q_idx[srv, rl], p.local_q_valid[srv, rl]
    return (np.where(local, srv, h), np.where(local, p.local_q_idx[srv, rl], p.send_q_idx[h, srv, j]),
            np.where(local, p.local_q_valid[srv, rl], p.send_q_valid[h, srv, j]))

  def kv_identity(srv, slot):
    """(home device, home row, valid) of the K/V row in slot `slot` of server `srv`."""
    v = p.server_kv_idx[srv, slot].astype(np.int64)
    local = v < TKV
    ck1 = max(ckv, 1)
    h, j = np.maximum(v - TKV, 0) // ck1, np.maximum(v - TKV, 0) % ck1
    ok = p.server_kv_valid[srv, slot]
    if not ckv:
      return srv, v, ok
    return (np.where(local, srv, h), np.where(local, v, p.send_kv_idx[h, srv, j]),
            ok & np.where(local, True, p.send_kv_valid[h, srv, j]))

  # Tasks: rows expanded per task (vectorised), checked against the layout's documents.
  live = p.q_len > 0
  if devices is not None:
    live &= np.isin(np.arange(N), D)[:, None]
  t_srv, t_idx = np.nonzero(live)
  qs, ql = p.q_start[live].astype(np.int64), p.q_len[live].astype(np.int64)
  ks, kl = p.kv_start[live].astype(np.int64), p.kv_len[live].astype(np.int64)

  def expand(start, length):
    owner = np.repeat(np.arange(length.size), length)
    offset = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    return owner, np.repeat(start, length) + offset, offset

  o, row, off = expand(qs, ql)
  qd, qr, q_ok = q_identity(t_srv[o], row)
  q_doc, q_pos = seg[qd, qr], pos[qd, qr]
  task_doc = np.full(ql.size, -2, np.int64)
  task_doc[o[::-1]] = q_doc[::-1]  # document of each task's first query row
  bad_q = ~q_ok | (q_doc != task_doc[o]) | (q_pos != (kl - ql)[o] + off)
  o2, row2, off2 = expand(ks, kl)
  kd, kr, k_ok = kv_identity(t_srv[o2], row2)
  k_doc, k_pos = seg_kv[kd, kr], pos_kv[kd, kr]
  bad_k = ~k_ok | (k_doc != task_doc[o2]) | (k_pos != off2)
  if bad_q.any() or bad_k.any() or (task_doc == PAD_SEGMENT).any():
    t = int(o[np.argmax(bad_q)]) if bad_q.any() else int(o2[np.argmax(bad_k)]) if bad_k.any() else 0
    raise PlanMismatchError(
        f"plan does not match the batch: task {int(t_idx[t])} on server {int(t_srv[t])} does not "
        f"cover one document's queries with exactly that document's prefix")


def comm_model(shape, attention_config) -> CommModel:
  return CommModel.for_model(shape, resend=attention_config.memory_mode == "resend")


def schedule_layout(attention_config, layout: Layout, shape) -> Plan:
  """The scheduler's plan for one nano-batch (global: the same on every process)."""
  return make_plan(layout, comm_model(shape, attention_config), epsilon=attention_config.epsilon,
                   min_imbalance=attention_config.min_imbalance_for(pipelined=False),
                   with_arrays=False)


class StepShapes:
  """The array capacities a training run's steps have compiled with, grown and never shrunk.

  Every step's plan needs its own buckets (rows per exchanged block, K/V rows and tasks per
  server; a colocated step's task capacity and K/V window). Taken step by step, most steps of a
  run land on a combination no earlier step had, and each new combination compiles the step
  again (4 x H100, Pretrain 64K: 17 compilations in 21 steps, ~9 s each). Kept here, each
  capacity is the largest any step of the run has needed: a step compiles only when one of
  them grows, a few times early in a run, and never for a shape an earlier step had. The cost
  is padding: a step whose plan needs less still sends and holds the grown capacity (the tiled
  exchange moves whole blocks).

  One per run, used from the trainer's one prefetch thread; every process sees the same global
  plans in the same order, so every process grows the same capacities at the same step."""

  def __init__(self):
    self.sizes: dict[str, int] = {}  # "<kind>.<capacity>" -> rows (a checkpoint keeps them)
    self.growths = 0  # shapes this process has used: each compiles the step once
    self._used: set[str] = set()

  def fit(self, kind: str, *, commit: bool = True, **need: int) -> dict[str, int]:
    """The capacities of `kind` ("cad@T", "colocated@T") for a step that needs `need` (each
    already a bucket): the elementwise maximum of `need` and what earlier steps needed; kept
    for later steps unless `commit` is false (a step the gate may still turn away)."""
    keys = {name: f"{kind}.{name}" for name in need}
    grown = {name: max(int(value), self.sizes.get(keys[name], 0)) for name, value in need.items()}
    if not commit:
      return grown
    changed = any(grown[name] != self.sizes.get(key) for name, key in keys.items())
    if changed or kind not in self._used:  # a new shape (or restored sizes, first used here)
      self.growths += 1
      if changed and any(key in self.sizes for key in keys.values()):
        log.info("%s step capacities grew to %s: the step compiles again", kind, grown)
      self.sizes.update({keys[name]: value for name, value in grown.items()})
      self._used.add(kind)
    return grown


def step_capacities(plans, layouts, kvs, shifted: bool = False) -> dict[str, int]:
  """The bucketed capacities the plans of one step need together (`build_dispatch`'s c, ckv,
  skv, ctask; with `shifted`, also each shift's rows, q1 .. q{N-1} and kv1 .. kv{N-1}: the
  largest block d -> d + k mod N); `kvs`: their `kv_requests`."""
  T, n = layouts[0].buffer_len, layouts[0].num_buffers
  pairs = [pair_rows(p.tasks, l, kv) for p, l, kv in zip(plans, layouts, kvs)]
  q = np.max([x[0] for x in pairs], axis=0)  # [N, N] rows per (device, server), over the plans
  kv = np.max([x[1] for x in pairs], axis=0)
  caps = dict(c=exchange_capacity(int(q.max(initial=0)), T),
              ckv=exchange_capacity(int(kv.max(initial=0)), T),
              skv=max(p.capacities.skv for p in plans),
              ctask=max(p.capacities.ctask for p in plans))
  if shifted:
    d = np.arange(n)
    for k in range(1, n):
      caps[f"q{k}"] = exchange_capacity(int(q[d, (d + k) % n].max()), T)
      caps[f"kv{k}"] = exchange_capacity(int(kv[d, (d + k) % n].max()), T)
  return caps


def _shifts(caps: dict[str, int], name: str) -> tuple[int, ...]:
  """A shifted exchange's rows per shift from `step_capacities` (`name`1, `name`2, ...); () when
  the step's exchange is not shifted."""
  out = []
  while f"{name}{len(out) + 1}" in caps:
    out.append(caps[f"{name}{len(out) + 1}"])
  return tuple(out)


def exchange_bytes(attention_config, shape, plans, capacities: dict[str, int]) -> np.ndarray:
  """Per device, the bytes one layer's exchange sends plus receives over the step's plans, in
  NVLink bytes. Tiled (`attention.exchange`): every off-diagonal (device, server) block travels
  whole, padded to the capacities (`c` query rows, `ckv` K/V rows), whatever the plan moves;
  shifted: each shift's blocks at that shift's capacity (`q1`.., `kv1`..); ragged: the rows that
  move (the plans' traffic, spread evenly over the device's peers). With data ranks on several
  nodes (`attention.gate_nodes`) a device's bytes within its node and across nodes move at once
  over different links: the busier link counts, bytes across nodes at
  `attention.gate_network_byte_cost` NVLink bytes each (as the simulator's exchange model)."""
  n = plans[0].stats.load_after.size
  same = same_node(attention_config, n)
  if attention_config.exchange == "ragged":
    moved = sum(p.traffic.send + p.traffic.recv for p in plans)
    if same.all():
      return moved
    off = (~same).sum(axis=1) / (n - 1)  # the share of the device's peers on other nodes
    return np.maximum(moved * (1 - off), attention_config.gate_network_byte_cost * moved * off)
  comm = comm_model(shape, attention_config)
  pair = np.zeros((n, n))  # one layer's bytes per plan, [sender, receiver]
  if attention_config.exchange == "shifted":  # shift k: block d -> d + k
    d = np.arange(n)
    for k, (q, kv) in enumerate(zip(_shifts(capacities, "q"), _shifts(capacities, "kv")), start=1):
      pair[d, (d + k) % n] = q * comm.q_row_bytes + kv * comm.kv_row_bytes
  else:
    pair[:] = capacities["c"] * comm.q_row_bytes + capacities["ckv"] * comm.kv_row_bytes
    np.fill_diagonal(pair, 0.0)
  pair *= len(plans)
  within = np.where(same, pair, 0.0)
  across = pair - within
  return np.maximum(within.sum(1) + within.sum(0),
                    attention_config.gate_network_byte_cost * (across.sum(1) + across.sum(0)))


def same_node(attention_config, n: int) -> np.ndarray:
  """[n, n] bool: whether data ranks i and j share a node (`attention.gate_nodes`; unset: one
  node)."""
  nodes = attention_config.gate_nodes
  if nodes is None:
    return np.ones((n, n), bool)
  if len(nodes) != n:
    raise ValueError(f"attention.gate_nodes: {len(nodes)} node numbers for {n} data ranks")
  nodes = np.asarray(nodes)
  return nodes[:, None] == nodes[None, :]


def dispatch_for_plans(plans, layouts, devices=None, batches=None, shapes: StepShapes | None = None,
                       kvs=None, shifted: bool = False, caps=None) -> list[DispatchPlan]:
  """The dispatch arrays of several plans of one step (its nano-batches, or a pipelined step's
  ticks), in one shape so they stack: each capacity the largest any of them needs, or with
  `shapes` the largest any step of the run has needed. Each is checked row by row for `devices`
  (default: all; a process passes the rows it feeds, `mesh.local_rows`). `batches`: the
  nano-batches themselves, when at hand (see `validate_plan`); `kvs`: the plans'
  `kv_requests`, when at hand; `shifted`: for `attention.exchange: shifted` (per-shift rows);
  `caps`: their `step_capacities`, when at hand."""
  kvs = [kv_requests(p.tasks, l) for p, l in zip(plans, layouts)] if kvs is None else kvs
  caps = step_capacities(plans, layouts, kvs, shifted) if caps is None else caps
  if shapes is not None:
    caps = shapes.fit(f"cad@{layouts[0].buffer_len}", **caps)
  sizes = {k: caps[k] for k in ("c", "ckv", "skv", "ctask")}
  dispatch = [dataclasses.replace(build_dispatch(p.tasks, l, devices=devices, kv=kv, **sizes),
                                  shift_q=_shifts(caps, "q"), shift_kv=_shifts(caps, "kv"))
              for p, l, kv in zip(plans, layouts, kvs)]
  batches = batches or [None] * len(plans)
  for i, (d, l, b) in enumerate(zip(dispatch, layouts, batches)):
    validate_plan(d, l, devices, b, batches[i - 1] if l.prior is not None and i else None)
  return dispatch


def dispatch_for_plan(plan: Plan, layout: Layout, devices=None,
                      batch: Batch | None = None) -> DispatchPlan:
  """One plan's checked dispatch arrays (`dispatch_for_plans`)."""
  return dispatch_for_plans([plan], [layout], devices, [batch])[0]


def plan_for_layout(attention_config, layout: Layout, shape, devices=None,
                    batch: Batch | None = None) -> tuple[Plan, DispatchPlan]:
  """Schedules one nano-batch and returns the scheduler's plan and its checked dispatch arrays
  (`schedule_layout`, then `dispatch_for_plan`)."""
  plan = schedule_layout(attention_config, layout, shape)
  return plan, dispatch_for_plan(plan, layout, devices, batch)


def plan_layouts(attention_config, layouts, shape, devices=None,
                 shapes: StepShapes | None = None) -> tuple[list[Plan], list[DispatchPlan]]:
  """Plans several layouts of one shape (a pipelined step's ticks) into dispatch plans of one
  shape (`dispatch_for_plans`), so the plans stack."""
  plans = [make_plan(l, comm_model(shape, attention_config), epsilon=attention_config.epsilon,
                     min_imbalance=attention_config.min_imbalance_for(pipelined=True),
                     with_arrays=False)
           for l in layouts]
  return plans, dispatch_for_plans(plans, layouts, devices, shapes=shapes,
                                   shifted=attention_config.exchange == "shifted")


@dataclasses.dataclass(frozen=True)
class StepContext:
  """Host-side inputs of one CAD step (not a pytree): the nano-batches the step trains on (one,
  or Ping and Pong), their dispatch plans, and the scheduler's plans for reporting."""

  batches: tuple[Batch, ...]
  dispatch: tuple[DispatchPlan, ...]
  plans: tuple[Plan, ...]
  # What the gate's cost model predicts the step saves (`metrics.predicted_cad_saving`, with
  # the exchange at the capacities the step runs with), whether or not the gate is on.
  predicted_saving: float = float("nan")
  # Per device, the batch's attention area as loaded (what colocated attention runs), before
  # any split; None: the nano-batches' own loads stand in for it.
  load_before: np.ndarray | None = None

  @property
  def capacities(self) -> dict[str, int]:
    """The capacities its dispatch arrays have (`build_dispatch`'s c, ckv, skv, ctask)."""
    d = self.dispatch[0]
    return dict(c=d.send_q_idx.shape[-1], ckv=d.send_kv_idx.shape[-1],
                skv=d.server_kv_idx.shape[-1], ctask=d.q_start.shape[-1],
                **{f"q{k}": c for k, c in enumerate(d.shift_q, 1)},
                **{f"kv{k}": c for k, c in enumerate(d.shift_kv, 1)})

  def imbalance(self) -> tuple[float, float]:
    """Attention-area imbalance (max/mean over servers) before scheduling (the batch as loaded,
    not its ping-pong halves, which the split alone often evens out) and after (the plans'
    loads, summed over nano-batches)."""
    before = (sum(p.stats.load_before for p in self.plans) if self.load_before is None
              else self.load_before)
    after = sum(p.stats.load_after for p in self.plans)
    ratio = lambda x: float(np.max(x) / np.mean(x)) if np.mean(x) > 0 else 1.0
    return ratio(before), ratio(after)


def host_context(attention_config, batch: Batch, shape, devices=None,
                 shapes: StepShapes | None = None):
  """Splits the batch into nano-batches (if ping-pong; a split that cuts a document longer than
  half the step is also planned as one stream, and the step runs the option predicted to save
  more) and plans each; runs on the host, in the trainer's prefetch thread, one step ahead of
  the devices. `devices`: the rows this process builds and checks (`dispatch_for_plans`).
  `shapes`: the run's `StepShapes` (a trainer passes one, so its steps compile only when a
  capacity grows); without it each step takes the buckets it needs.

  The gate (`attention.gate`): a batch whose plans are predicted to save less than
  `attention.min_gain` of the step, net of the exchange (`metrics.predicted_cad_saving`, from the
  global plans, so every process decides alike), or whose colocated attention imbalance is below
  `attention.min_imbalance`, has nothing worth moving: the step runs colocated attention instead
  (its `ColocatedContext`: one stream, no exchange, no ping-pong split; compiled once beside the
  distca step). The gate decides on the plans alone, before their dispatch arrays are built and
  checked (the costly part at scale); a batch whose saving cannot reach `min_gain` even with
  perfect balance (`metrics.predicted_cad_gain` less the exchange's fixed part) is not planned
  at all."""
  from distca_jax.attention import colocated_contexts
  from distca_jax.train import metrics

  layout = batch.layout
  colocated = lambda: colocated_contexts([layout], shapes=shapes)[0]
  min_imbalance = attention_config.min_imbalance_for(pipelined=False)
  load = metrics.attention_load_per_device(layout)
  if metrics.imbalance(load) < min_imbalance:
    return colocated()
  gate = attention_config.gate
  if gate and metrics.predicted_cad_gain(shape, layout, exchange=True,
                                         attention_config=attention_config) < attention_config.min_gain:
    return colocated()
  # Ping-pong's two streams, or one. A split that cuts a document longer than half the step
  # gives halves of unequal attention (Ping all prefix, Pong the suffix over the whole prefix),
  # each balanced on its own: such a step is planned both ways and runs the one predicted to
  # save more (2 x H100, a 104K-token document in 2 x 64K: one stream 1.134x colocated, two
  # 1.096x; predicted +12.6% / +10.3%), unless `attention.pingpong_allow_single` is off.
  options = [(batch,)]
  if attention_config.pingpong:
    halves = split_pingpong_batch(batch)
    single = attention_config.pingpong_allow_single and _cuts_long_document(halves[1].layout)
    options = [halves] + ([(batch,)] if single else [])
  shifted = attention_config.exchange == "shifted"
  best = None
  for batches in options:
    layouts = [b.layout for b in batches]
    plans = tuple(schedule_layout(attention_config, l, shape) for l in layouts)
    kvs = [kv_requests(p.tasks, l) for p, l in zip(plans, layouts)]
    caps = step_capacities(plans, layouts, kvs, shifted)
    if shapes is not None:  # the run's capacities, should this step run CAD
      caps = shapes.fit(f"cad@{layouts[0].buffer_len}", commit=False, **caps)
    saving = metrics.predicted_cad_saving(shape, layout, plans, attention_config,
                                          exchange_bytes(attention_config, shape, plans, caps))
    if best is None or saving > best[0]:
      best = (saving, batches, layouts, plans, kvs, caps)
  saving, batches, layouts, plans, kvs, caps = best
  if gate and saving < attention_config.min_gain:
    return colocated()
  dispatch = dispatch_for_plans(plans, layouts, devices, batches, shapes, kvs, shifted, caps)
  return StepContext(batches=batches, plans=plans, dispatch=tuple(dispatch), predicted_saving=saving,
                     load_before=load)


def _cuts_long_document(pong: Layout) -> bool:
  """Whether the ping-pong split behind Pong's layout cut a document longer than half the step's
  tokens (Pong holds the smaller half)."""
  prior = pong.prior
  return bool(prior.num_shards) and int(pong.doc_lens[prior.doc[0]]) > int(pong.length.sum())


def split_pingpong_batch(batch: Batch) -> tuple[Batch, Batch]:
  """Ping and Pong: the batch's documents split into two halves of equal tokens and balanced
  attention (`schedule/pingpong.py`), each packed into buffers of half the length. Every token
  keeps its target, loss weight and position: the two halves train exactly the batch (Pong's
  layout lists the cut document's prefix in Ping as `prior` shards, which its attention reads)."""
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
  halves = []
  for lay, lens, source in zip((ping, pong), split.lens, split.source):
    starts = doc_start[source[:, 0]] + source[:, 1] if lens.size else np.zeros(0, np.int64)
    take = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))

    def gather(a):
      out = np.zeros(N * (T // 2), a.dtype)
      out[: take.size] = a.reshape(-1)[take]
      return out.reshape(N, T // 2)

    halves.append(Batch(tokens=gather(batch.tokens), targets=gather(batch.targets),
                        loss_mask=gather(batch.loss_mask), segment_ids=lay.segment_ids(),
                        positions=gather(batch.positions), layout=lay))
  return tuple(halves)


# ----------------------------------------------------------------------------- device side


def _exchange(blocks_NxCx, send_count_N, recv_count_N, mode: str, shifts: tuple = ()):
  """One exchange over the server pool: block s goes to device s, the block from device s lands
  at s. Tiled: one all_to_all of the whole padded blocks (CPU and GPU). Shifted: one `ppermute`
  per shift k = 1 .. N-1, block d + k mod N going to that device with its first `shifts[k - 1]`
  rows (CPU and GPU). Ragged: only the first `send_count_N[s]` rows of block s travel and
  `recv_count_N[s]` rows land in block s (`jax.lax.ragged_all_to_all`, GPU). All give the same
  result when the rows past a block's count are zero, as the exchange's callers make them (and
  `validate_plan` checks every count fits its shift). Each is its own transpose with the counts
  swapped, or the shifts reversed (what went out on shift k comes back on shift N - k)."""
  if mode == "tiled":
    return jax.lax.all_to_all(blocks_NxCx, ROW_AXES, 0, 0, tiled=True)
  if mode == "shifted":
    # Over `data` alone (config refuses shifted with mesh.pipe > 1): over two axes, ppermute
    # numbers devices in the mesh's axis order while all_to_all and axis_index follow the axis
    # tuple's, and the mesh is (data, pipe, tensor) where rows are (pipe, data).
    N, C = blocks_NxCx.shape[:2]
    me = jax.lax.axis_index("data")
    out = jnp.zeros_like(blocks_NxCx)
    for k, rows in enumerate(shifts, 1):
      if rows == 0:
        continue
      block = jax.lax.dynamic_index_in_dim(blocks_NxCx, (me + k) % N, 0, keepdims=False)[:rows]
      got = jax.lax.ppermute(block, "data", perm=[(i, (i + k) % N) for i in range(N)])
      got = jnp.pad(got, [(0, C - rows)] + [(0, 0)] * (got.ndim - 1))
      out = jax.lax.dynamic_update_index_in_dim(out, got, (me - k) % N, 0)
    return out
  N, C = blocks_NxCx.shape[:2]
  flat = blocks_NxCx.reshape((N * C,) + blocks_NxCx.shape[2:])
  block_start = jnp.arange(N, dtype=jnp.int32) * C
  here = jnp.full((N,), jax.lax.axis_index(ROW_AXES) * C, jnp.int32)  # my block on every peer
  out = jax.lax.ragged_all_to_all(flat, jnp.zeros_like(flat), block_start,
                                  send_count_N.astype(jnp.int32), here,
                                  recv_count_N.astype(jnp.int32), axis_name=ROW_AXES)
  return out.reshape(blocks_NxCx.shape)


def _masked(valid, x):
  return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - valid.ndim)), x, 0)


# The exchange's row movements are linear maps whose transposes are each other's or simple
# gathers; they are given explicitly (custom VJPs) rather than derived by autodiff, whose
# transpose of a gather is a scatter-add into a fresh zero buffer: slow on GPU for rows of
# 32 heads x 128, and XLA merged those zero buffers across layers and pipeline ticks into one
# allocation made at the start of the step (tens of GiB).


def _with_transpose(linear, transpose):
  """`linear(x, plan)`, a linear map of rows, with `transpose(g, plan)` as its VJP."""
  f = jax.custom_vjp(linear)
  f.defvjp(lambda x, p: (linear(x, p), p), lambda p, g: (transpose(g, p), None))
  return f


def _send(x_TxKxE, idx_NxC, valid_NxC, send_count, recv_count, mode, shifts):
  """The rows `idx_NxC[s]` of `x` to server s, one exchange: the [N * C] rows received."""
  blocks = jnp.take(x_TxKxE, idx_NxC.reshape(-1), axis=0).reshape(idx_NxC.shape + x_TxKxE.shape[1:])
  with jax.named_scope("dispatch"):
    recv = _exchange(_masked(valid_NxC, blocks), send_count, recv_count, mode, shifts)
  return recv.reshape((-1,) + x_TxKxE.shape[1:])


def _rows_to_servers(x_TxHxE, p: "DispatchPlan", mode="tiled"):
  """Home rows -> server-side rows [local T | received N*C] (Q forward, dO backward)."""
  local = _masked(p.local_q_valid, jnp.take(x_TxHxE, p.local_q_idx, axis=0))
  if p.send_q_idx.shape[-1] == 0:
    return local
  return jnp.concatenate([local, _send(x_TxHxE, p.send_q_idx, p.send_q_valid, p.send_q_count,
                                       p.recv_q_count, mode, p.shift_q)])


def _rows_to_home(y_RxHxE, p: "DispatchPlan", mode="tiled"):
  """Server-side rows -> home rows (O forward, dQ backward): the transpose of `_rows_to_servers`
  (every real token sits in exactly one server slot; `validate_plan` checks it). Rows past a
  block's count are never read at home, so the reverse exchange may leave them out."""
  N, C = p.send_q_idx.shape
  T = p.return_idx.shape[0]
  if C:
    with jax.named_scope("return"):
      back = _exchange(y_RxHxE[T:].reshape((N, C) + y_RxHxE.shape[1:]), p.recv_q_count,
                       p.send_q_count, mode, p.shift_q[::-1])
    y_RxHxE = jnp.concatenate([y_RxHxE[:T], back.reshape((-1,) + y_RxHxE.shape[1:])])
  return _masked(p.return_valid, jnp.take(y_RxHxE, p.return_idx, axis=0))


def _kv_to_servers(x_TxKxE, p: "DispatchPlan", mode="tiled"):
  """Home K/V rows -> the server's gathered K/V buffer [Skv] (each document prefix contiguous)."""
  rows = x_TxKxE
  if p.send_kv_idx.shape[-1]:
    rows = jnp.concatenate([x_TxKxE, _send(x_TxKxE, p.send_kv_idx, p.send_kv_valid,
                                           p.send_kv_count, p.recv_kv_count, mode, p.shift_kv)])
  return _masked(p.server_kv_valid, jnp.take(rows, p.server_kv_idx, axis=0))


def _kv_grads_to_home(g_SxKxE, p: "DispatchPlan", mode="tiled"):
  """The transpose of `_kv_to_servers`: a gather by the inverse slot map, the reverse exchange,
  and a scatter-add of the returned rows onto the local ones (a row sent to several servers
  sums their gradients), in place."""
  N, C = p.send_kv_idx.shape
  T = p.server_kv_inv.shape[0] - N * C
  rows = _masked(p.server_kv_inv_valid, jnp.take(g_SxKxE, p.server_kv_inv, axis=0))
  if C == 0:
    return rows
  with jax.named_scope("return"):
    back = _exchange(rows[T:].reshape((N, C) + rows.shape[1:]), p.recv_kv_count, p.send_kv_count,
                     mode, p.shift_kv[::-1])
  back = back.reshape((-1,) + rows.shape[1:])
  return rows[:T].at[kv_return_index(p.send_kv_idx, p.send_kv_valid, T)].add(back, mode="drop")


def kv_return_index(send_kv_idx, send_kv_valid, T: int):
  """The local row each returned K/V gradient row adds onto, and T (past the end: the scatter
  drops it) for every slot that carried no row: the diagonal block and the padding past each
  block's count, whose index is 0. Added as zeros there, every one of them was an update of row
  0: on the GPU a scatter-add of duplicate indices is atomic, so all of them contended for one
  row, and their number grows with the blocks' capacity."""
  return jnp.where(send_kv_valid.reshape(-1), send_kv_idx.reshape(-1), T)


@functools.cache
def _movers(mode: str):
  """(rows_to_servers, rows_to_home, kv_to_servers) with explicit transposes, over the exchange
  `mode` (tiled, shifted or ragged)."""
  fs = {f: functools.partial(f, mode=mode)
        for f in (_rows_to_servers, _rows_to_home, _kv_to_servers, _kv_grads_to_home)}
  return (_with_transpose(fs[_rows_to_servers], fs[_rows_to_home]),
          _with_transpose(fs[_rows_to_home], fs[_rows_to_servers]),
          _with_transpose(fs[_kv_to_servers], fs[_kv_grads_to_home]))


def _server_exchange(q_TxHxE, k_TxKxE, v_TxKxE, p: DispatchPlan, backend: str, mode: str):
  """Steps 1-4 for one device (inside shard_map; plan arrays without their leading N)."""
  to_servers, to_home, kv_to_srv = _movers(mode)
  q_rows = to_servers(q_TxHxE, p)
  k_srv, v_srv = kv_to_srv(k_TxKxE, p), kv_to_srv(v_TxKxE, p)
  tasks = TaskTable(p.q_start, p.q_len, p.kv_start, p.kv_len)
  with jax.named_scope("core_attention"):
    o_rows, _ = kernels.attention(q_rows, k_srv, v_srv, tasks, backend=backend)
  return to_home(o_rows, p)


def resolve_exchange(exchange: str) -> str:
  """`tiled`, `shifted` or `ragged` (`ragged_all_to_all` runs on GPU only; refused elsewhere)."""
  if exchange == "ragged" and jax.default_backend() != "gpu":
    raise ValueError(f"attention.exchange=ragged needs GPUs (jax.lax.ragged_all_to_all), this "
                     f"backend is {jax.default_backend()}; use attention.exchange=tiled")
  if exchange == "ragged":
    log.warning("attention.exchange=ragged: XLA's GPU ragged_all_to_all waits on the host before "
                "each call; on 2 x H100 the step ran 0.74x colocated where tiled gives 1.09x "
                "(docs/PERFORMANCE.md, 'The ragged exchange on 2 x H100')")
  return exchange


# Pool size from which the tiled exchange's padding stops hiding under compute (docs/SIMULATOR.md:
# hidden at 8 ranks, exposed at 32; docs/PERFORMANCE.md "Dispatch at scale": 14x the rows at 8).
TILED_POOL_LIMIT = 8


def make_distca_attention(attention_config, mesh: Mesh):
  """The model's `core_attention` for `attention.impl: distca` under `mesh`."""
  pool = mesh.shape["pipe"] * mesh.shape["data"]
  if attention_config.exchange == "tiled" and pool > TILED_POOL_LIMIT:
    log.warning("attention.exchange=tiled over %d attention servers: every block of the "
                "all_to_all is padded to the largest one, which costs more than it balances beyond "
                "about %d servers (docs/SIMULATOR.md); attention.exchange=ragged sends only the "
                "moving rows but XLA 0.11 blocks the host on each one (docs/PERFORMANCE.md)",
                pool, TILED_POOL_LIMIT)
  backend = attention_config.kernel
  kernels.resolve_backend(backend)  # a bad name or platform fails here; `auto` resolves per call
  qkv_spec = P(ROW_AXES, None, "tensor", None)
  plan_spec = P(ROW_AXES)
  exchange = functools.partial(_server_exchange, backend=backend,
                               mode=resolve_exchange(attention_config.exchange))
  if attention_config.memory_mode == "resend":
    exchange = jax.checkpoint(exchange, policy=jax.checkpoint_policies.nothing_saveable)

  def local(q, k, v, plan):
    plan = jax.tree.map(lambda x: x[0], plan)
    return exchange(q[0], k[0], v[0], plan)[None]

  sharded = jax.shard_map(local, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, plan_spec),
                          out_specs=qkv_spec, check_vma=False)

  from distca_jax.attention import ColocatedContext, make_colocated_attention

  colocated = make_colocated_attention(mesh, attention_config.kernel)

  def core_attention(q, k, v, ctx, prior_kv=None):
    if isinstance(ctx, ColocatedContext):  # a step the gate stopped (host_context)
      return colocated(q, k, v, ctx)
    # Ping-pong's Pong reads K/V rows of Ping too (the prefix of the document the split cut):
    # its plan's local K/V rows are [its own T | Ping's T] (`Layout.prior`), static per plan.
    N, T = ctx.return_idx.shape
    kv_rows = ctx.server_kv_inv.shape[-1] - N * ctx.send_kv_idx.shape[-1]
    if kv_rows != T:
      if prior_kv is None or kv_rows != 2 * T:
        have = T if prior_kv is None else 2 * T
        raise ValueError(f"distca attention: the plan reads {kv_rows} K/V rows per device, the "
                         f"stream (with an earlier stream's, if given) has {have}")
      k = jnp.concatenate([k, prior_kv[0]], axis=1)
      v = jnp.concatenate([v, prior_kv[1]], axis=1)
    return sharded(q, k, v, ctx)

  return core_attention
