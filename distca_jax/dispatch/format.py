"""The exchange's arrays (`DispatchPlan`) and how a task placement becomes them (`build_dispatch`).

Host side, numpy. `DispatchPlan`'s docstring is the format: every array the device side
(`exchange.py`) reads, with its shape and meaning. `checks.validate_plan` refuses arrays that
do not follow it, and tests/helpers.py's `simulate_dispatch` runs them in numpy against direct
attention (the format's executable specification).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from distca_jax.data.packing import Layout
from distca_jax.schedule.capacities import Capacities
from distca_jax.schedule.items import Tasks, exchange_capacity
from distca_jax.schedule.plan import cumsum_in_groups, fill_ranges
from distca_jax.schedule.planner import kv_requests, pair_rows

ARRAY_FIELDS = ("local_q_idx", "local_q_valid", "send_q_idx", "send_q_valid", "send_kv_idx",
                "send_kv_valid", "server_kv_idx", "server_kv_valid", "server_kv_inv",
                "server_kv_inv_valid", "q_start", "q_len", "kv_start", "kv_len", "return_idx",
                "return_valid", "send_q_count", "recv_q_count", "send_kv_count", "recv_kv_count")


class PlanMismatchError(ValueError):
  """A dispatch plan does not belong to the batch it is used with, or breaks its capacities."""


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(ARRAY_FIELDS),
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

  KIND = "distca"  # what `core_attention` runs for this context (attention.py's protocol)


def build_dispatch(tasks: Tasks, layout: Layout, capacities: Capacities, devices=None,
                   kv=None) -> DispatchPlan:
  """The dispatch arrays of a task placement (`DispatchPlan`), straight from the scheduler's
  tasks: stay-home rows local, every off-diagonal (device, server) block padded to
  `capacities.c` / `.ckv` rows (None: the smallest bucket that holds the rows that really move),
  the server's K/V buffer and task table to `.skv` / `.ctask` (e.g. the scheduler's
  `Plan.capacities`, or the larger ones of several plans of one shape), and the shifted
  exchange's per-shift rows as given (`.shift_q`, `.shift_kv`; () for the other exchanges).
  `devices` (default: all): fill only what those devices hold, send and
  receive (their rows, and the blocks they send or receive); the other rows stay zero, never
  touched (numpy's zeros are not committed until written), so a process of a large job pays
  for its own devices; shapes and counts are those of the whole plan on every process. Work is a
  loop over tasks and K/V pieces, never over tokens. `kv`: the tasks' `kv_requests`, when
  already at hand. Raises PlanMismatchError when a capacity is too small."""
  n, t = layout.num_buffers, layout.buffer_len
  c, ckv, skv, ctask = capacities.c, capacities.ckv, capacities.skv, capacities.ctask
  tkv = layout.kv_rows  # K/V rows per device: its buffer, then a ping-pong prior buffer's
  mine = np.ones(n, bool) if devices is None else np.isin(np.arange(n), devices)
  kv = kv_requests(tasks, layout) if kv is None else kv
  # Rows per block of the whole plan (every process agrees on them, whatever it fills).
  q_pairs, kv_pairs, _ = pair_rows(tasks, layout, kv)
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
      send_kv_count=send_kv_count, recv_kv_count=np.ascontiguousarray(send_kv_count.T),
      shift_q=capacities.shift_q, shift_kv=capacities.shift_kv)


def _kv_inverse(server_kv_idx: np.ndarray, server_kv_valid: np.ndarray, rows: int,
                servers=None) -> tuple[np.ndarray, np.ndarray]:
  """For each of a server's `rows` K/V rows, the slot of its gathered K/V buffer holding it
  (`server_kv_idx`'s inverse), and whether one does; for `servers` only (default: all, the
  others' rows stay zero). Raises if a row fills two slots."""
  N = server_kv_idx.shape[0]
  sel = rows_selector(N, servers)
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


def rows_selector(n: int, devices):
  """An index for the rows `devices` (default: all) of an [n, ...] array: a slice when they are
  consecutive, as a process's devices usually are (a view, no copy), else the sorted rows."""
  if devices is None:
    return slice(None)
  d = np.unique(np.asarray(devices, np.int64))
  return slice(int(d[0]), int(d[-1]) + 1) if d.size and d[-1] - d[0] + 1 == d.size else d
