"""The exchange's arrays (`DispatchPlan`) and how a task placement becomes them (`build_dispatch`).

Host side, numpy. `DispatchPlan`'s and `Round`'s docstrings are the format: every array the
device side (`exchange.py`) reads, with its shape and meaning. `checks.validate_plan` refuses arrays that
do not follow it, and tests/helpers.py's `simulate_dispatch` runs them in numpy against direct
attention (the format's executable specification).
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
from typing import Any, NamedTuple

import jax
import numpy as np

from distca_jax.data.packing import Layout
from distca_jax.schedule.capacities import Capacities, bucketed, requirements
from distca_jax.schedule.items import Tasks
from distca_jax.schedule.plan import cumsum_in_groups, fill_ranges
from distca_jax.schedule.traffic import PairRows, exchange_pairs, kv_requests

# The exchange's rounds, in the order the forward runs them, each with the names of its send,
# receive and tiled-block sizes in `Capacities`.
ROUNDS = {"q": ("send_q", "recv_q", "c"), "kv": ("send_kv", "recv_kv", "ckv"),
          "kv2": ("send_kv2", "recv_kv2", "ckv2")}


class PlanMismatchError(ValueError):
  """A dispatch plan does not belong to the batch it is used with, or breaks its capacities."""


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["send_idx", "send_valid", "send_count", "recv_count", "send_off",
                                "recv_off", "peer_off", "back_off"],
                   meta_fields=["recv_rows", "block"])
@dataclasses.dataclass(frozen=True)
class Round:
  """One packed exchange round of a `DispatchPlan`, leading dim N: the rows each device sends,
  grouped by server, and where every block sits on both sides.

  send_idx    [N, S]   rows sent (over the sender's rows the round reads), the rows for server s
                       at [send_off[s], + send_count[s])
  send_valid  [N, S]   bool: the first sum(send_count) slots
  send_count  [N, N]   rows device d sends server s (zero diagonal)
  recv_count  [N, N]   rows server s receives from each home d (the transpose)
  send_off    [N, N]   where d's rows for s start in d's send buffer (exclusive prefix sum)
  recv_off    [N, N]   where s's rows from d start in s's receive buffer (the same over d)
  peer_off    [N, N]   where d's rows land in s's receive buffer (recv_off transposed: what
                       `ragged_all_to_all` asks of the sender)
  back_off    [N, N]   where s's returned rows land in d's send layout (send_off transposed: the
                       reverse exchange's peer offsets)
  recv_rows            static: R, the receive buffer's rows (0: the round is skipped)
  block                static: the tiled exchange's rows per padded (device, server) block (0 for
                       the ragged exchange)
  """

  send_idx: Any
  send_valid: Any
  send_count: Any
  recv_count: Any
  send_off: Any
  recv_off: Any
  peer_off: Any
  back_off: Any
  recv_rows: int = 0
  block: int = 0

  @property
  def send_rows(self) -> int:
    """S, the send buffer's rows."""
    return self.send_idx.shape[-1]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["local_q_valid", "q", "kv", "kv2", "server_kv_idx",
                                "server_kv_valid", "server_kv_inv", "server_kv_inv_valid",
                                "q_start", "q_len", "kv_start", "kv_len"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DispatchPlan:
  """One step's dispatch arrays, leading dim N (one row per device, sharded over `ROW_AXES`).

  The exchange is packed: a device keeps every row it sends in ONE send buffer, grouped by
  server, and receives into ONE buffer, grouped by home; both are sized by the busiest device's
  moving rows (`Capacities.send_q` ...), never by N times a per-pair capacity. A server's query
  rows are [its home rows T, in place | received Rq]: its local tasks read their rows where they
  sit, and each home row's output is its own server row r < T or comes back to the send slot
  its query row left from; its K/V rows [local Tkv | received Rkv], where Tkv is the
  device's T rows, or for ping-pong's Pong 2T: its own, then Ping's (`Layout.prior`: the prefix
  of the document the split cut is in Ping's buffers), then with relays (`schedule/relay.py`)
  the second K/V round's Rkv2: [local Tkv | round-1 Rkv | round-2 Rkv2]. Round 1 carries the
  pieces their holders send; in round 2 each relay forwards, from its [local Tkv | round-1
  Rkv] rows, pieces it received in round 1 to the servers that need them too:

  local_q_valid [N, T]       bool: home rows a local task reads in place (False for the rows
                             sent away and for padding, whose output is zero); what the checks
                             follow: the device side moves no local row and reads none of it
  q             `Round`      the query rows: home rows out, outputs back (Sq send, Rq receive)
  kv            `Round`      K/V round 1: local K/V rows a holder sends (Skvs, Rkv)
  kv2           `Round`      K/V round 2: a relay's rows forwarded, over its [local Tkv | round-1
                             Rkv] rows (Skvs2, Rkv2; [N, 0] and all zero without relays)
  server_kv_idx [N, Skv]     server-side K/V gather over [local Tkv | received Rkv | Rkv2] rows
  server_kv_valid [N, Skv]
  server_kv_inv [N, Tkv + Rkv + Rkv2]  its inverse (each K/V row a server holds sits in at most one
  server_kv_inv_valid           slot): the backward gathers K/V gradients instead of scattering
  q_start, q_len, kv_start, kv_len [N, Ctask]  the server's task table (kernels/tasks.py) over
                             its [local T | received Rq] query rows and gathered K/V rows
  """

  local_q_valid: Any
  q: Round
  kv: Round
  kv2: Round
  server_kv_idx: Any
  server_kv_valid: Any
  server_kv_inv: Any
  server_kv_inv_valid: Any
  q_start: Any
  q_len: Any
  kv_start: Any
  kv_len: Any

  KIND = "distca"  # what `core_attention` runs for this context (attention.py's protocol)

  @property
  def rounds(self) -> dict[str, Round]:
    """The exchange's rounds by name (`ROUNDS`)."""
    return {name: getattr(self, name) for name in ROUNDS}

  @property
  def kv_rows(self) -> int:
    """Tkv, a device's local K/V rows (T, or 2T for ping-pong's Pong)."""
    return self.server_kv_inv.shape[-1] - self.kv.recv_rows - self.kv2.recv_rows

  @property
  def capacities(self) -> Capacities:
    """The capacities its arrays have."""
    sizes = {}
    for name, (send, recv, block) in ROUNDS.items():
      r = getattr(self, name)
      sizes.update({send: r.send_rows, recv: r.recv_rows, block: r.block})
    return Capacities(**sizes, skv=self.server_kv_idx.shape[-1], ctask=self.q_start.shape[-1])

  def arrays(self) -> dict[str, Any]:
    """Every array by name (a round's as `q.send_idx`), for comparing plans array for array."""
    out = {}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if isinstance(value, Round):
        out.update({f"{f.name}.{g.name}": getattr(value, g.name) for g in dataclasses.fields(Round)
                    if g.name not in ("recv_rows", "block")})
      else:
        out[f.name] = value
    return out

  def static(self) -> tuple[tuple[int, int], ...]:
    """Each round's static sizes (`recv_rows`, `block`): what a step compiles for beside the
    arrays' shapes."""
    return tuple((r.recv_rows, r.block) for r in self.rounds.values())


def exchange_offsets(count_NxN: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(send_off, recv_off), [N, N] int64, of an exchange moving count[d, s] rows d -> s: where
  d's rows for s start in d's send buffer (send_off[d, s]) and where they land in s's receive
  buffer (recv_off[s, d]); both exclusive prefix sums, so the buffers are packed."""
  count = np.asarray(count_NxN, np.int64)
  return np.cumsum(count, axis=1) - count, (np.cumsum(count, axis=0) - count).T


def _exchange_arrays(pairs: PairRows, n: int) -> dict[str, np.ndarray]:
  """The six per-device count and offset arrays of one packed exchange (a `Round`'s), int32,
  from the rows each (sender, server) pair moves: the counts and their transpose (each
  scattered from the pairs), each one's exclusive prefix sum along its rows, and those
  transposed (numpy's prefix sum down the columns of an [N, N] array is about 10x slower than
  along its rows, and than a transposing copy). The six share one allocation: six fresh ones
  cost more in page faults than the arithmetic."""
  count, turned, send_off, recv_off, peer_off, back_off = np.zeros((6, n, n), np.int32)
  count[pairs.sender, pairs.server] = pairs.rows
  turned[pairs.server, pairs.sender] = pairs.rows
  for a, out in ((count, send_off), (turned, recv_off)):
    np.cumsum(a, axis=1, dtype=np.int32, out=out)
    out -= a
  peer_off[...] = recv_off.T
  back_off[...] = send_off.T
  return dict(send_count=count, recv_count=turned, send_off=send_off, recv_off=recv_off,
              peer_off=peer_off, back_off=back_off)


def build_dispatch(tasks: Tasks, layout: Layout, capacities: Capacities, devices=None,
                   kv=None) -> DispatchPlan:
  """The dispatch arrays of a task placement (`DispatchPlan`), straight from the scheduler's
  tasks: stay-home rows local, the moving rows packed in each device's send and receive
  buffers of `capacities.send_q` / `.recv_q` / `.send_kv` / `.recv_kv` rows (None: the bucket
  the plan needs), the server's K/V buffer and task table of `.skv` / `.ctask`, and the tiled
  exchange's static block sizes as given (`.c`, `.ckv`, `.ckv2`).
  `devices` (default: all): fill only what those devices hold, send and receive (their rows,
  and the rows they send or receive); the other rows stay zero, never touched (numpy's zeros
  are not committed until written), so a process of a large job pays for its own devices;
  shapes and counts are those of the whole plan on every process (and the round-1 rows relays
  forward to those devices are filled too). Work is a loop over tasks and
  K/V pieces, never over tokens. `kv`: the tasks' `kv_requests`, when already at hand. Raises
  PlanMismatchError when a capacity is too small."""
  n, t = layout.num_buffers, layout.buffer_len
  mine = np.ones(n, bool) if devices is None else np.isin(np.arange(n), devices)
  kv = kv_requests(tasks, layout) if kv is None else kv
  # Rows per (device, server) pair of each round, of the whole plan (every process agrees).
  pairs = exchange_pairs(tasks, layout, kv)
  caps = _open_capacities(capacities, tasks, layout, kv)
  _check_fits(*pairs, caps, n)
  exchanges = dict(zip(ROUNDS, (_exchange_arrays(p, n) for p in pairs)))
  q = _query_arrays(tasks, t, caps, exchanges["q"], mine)
  k = _kv_arrays(kv, layout, caps, exchanges["kv"], exchanges["kv2"], mine)
  tables = _task_tables(q.tasks, kv, k.pair_base, caps.ctask, mine,
                        max(int(np.asarray(layout.doc_lens).size), 1))
  as_rows = lambda a: a.reshape(n, a.size // n)
  sends = {"q": q.send, "kv": k.send, "kv2": k.send2}
  rounds = {name: Round(send_idx=as_rows(sends[name][0]), send_valid=as_rows(sends[name][1]),
                        **exchanges[name], recv_rows=getattr(caps, recv),
                        block=getattr(caps, block) or 0)
            for name, (_, recv, block) in ROUNDS.items()}
  arrays = {name: as_rows(a) for name, a in {**q.arrays, **k.arrays, **tables}.items()}
  return DispatchPlan(**arrays, **rounds)


def _open_capacities(capacities: Capacities, tasks: Tasks, layout: Layout, kv) -> Capacities:
  """`capacities` with what it leaves open (None) as the plan needs, bucketed."""
  open_ = [f.name for f in dataclasses.fields(Capacities) if getattr(capacities, f.name) is None]
  if not open_:
    return capacities
  need = bucketed(requirements(tasks, layout, kv), layout.buffer_len)
  return dataclasses.replace(capacities, **{name: getattr(need, name) for name in open_})


def _zeros(width: int, mine: np.ndarray):
  """(index, valid) flat arrays of [N, width] slots (N = mine.size), uncommitted until written."""
  return sparse_zeros(mine, width, np.int32), sparse_zeros(mine, width, bool)


def sparse_zeros(mine: np.ndarray, width: int, dtype) -> np.ndarray:
  """A flat zero array of [N, width] (N = mine.size), of which a process writes and reads the
  rows of its devices (`mine`) and writes a few scattered ranges of the others' rows (the slots
  they send its devices). numpy asks the kernel for 2 MiB pages for every large array, so each
  first touch anywhere zeroes 2 MiB (at 512 devices about 1 s of a step's host time went
  there); here only the span of `mine`'s rows gets them, the rest 4 KiB pages."""
  itemsize = np.dtype(dtype).itemsize
  nbytes = mine.size * width * itemsize
  if not nbytes or nbytes < _HUGE_PAGE or not hasattr(mmap, "MADV_NOHUGEPAGE"):  # (Linux)
    return np.zeros(mine.size * width, dtype)
  # Private and anonymous (a shared one is shmem, which takes no huge pages): zero, committed
  # page by page when touched.
  buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  buf.madvise(mmap.MADV_NOHUGEPAGE)
  rows = np.flatnonzero(mine)
  if rows.size:
    lo = int(rows[0]) * width * itemsize // mmap.PAGESIZE * mmap.PAGESIZE
    buf.madvise(mmap.MADV_HUGEPAGE, lo, (int(rows[-1]) + 1) * width * itemsize - lo)
  return np.frombuffer(buf, dtype)


_HUGE_PAGE = 2 << 20


class _Queries(NamedTuple):
  """The query side's arrays (flat): the local and return arrays, the send buffer's (index,
  valid), and the tasks in its order, which the task tables read: their server, document,
  first row at the server (`q_start`), rows and last position + 1."""

  arrays: dict
  send: tuple
  tasks: tuple


def _query_arrays(tasks: Tasks, t: int, caps: Capacities, exchange: dict, mine) -> _Queries:
  """Queries: a local task reads its home rows in place (server row r < T is home row r), the
  others are grouped by (home, server) in home-row order at their pair's place in the home's
  send buffer and the server's receive buffer; the output of each row sent away returns to the
  send slot its query row left from."""
  n, sq = mine.size, caps.send_q
  send_off, recv_off = exchange["send_off"], exchange["recv_off"]
  block = tasks.home * n + tasks.server
  order = np.lexsort((tasks.home_off, block))
  home, server = tasks.home[order], tasks.server[order]
  hoff, ql = tasks.home_off[order], tasks.q_len[order]
  pos = cumsum_in_groups(ql, block[order])
  local = home == server
  local_q_valid = sparse_zeros(mine, t, bool)
  w = local & mine[home]
  fill_ranges(None, local_q_valid, home[w] * t + hoff[w], 0, ql[w])
  send_slot = send_off[home, server] + pos  # the row's place in its home's send buffer
  send_q_idx, send_q_valid = _zeros(sq, mine)
  w = ~local & (mine[home] | mine[server])
  fill_ranges(send_q_idx, send_q_valid, (home * sq + send_slot)[w], hoff[w], ql[w])
  q_start = np.where(local, hoff, t + recv_off[server, home] + pos)
  return _Queries(arrays=dict(local_q_valid=local_q_valid), send=(send_q_idx, send_q_valid),
                  tasks=(server, tasks.doc[order], q_start, ql, tasks.q_hi[order]))


class _KV(NamedTuple):
  """The K/V side's arrays (flat): the server's gather and its inverse, each round's send
  buffer (index, valid), and where each (server, document) pair's prefix starts in its
  server's gathered K/V rows."""

  arrays: dict
  send: tuple
  send2: tuple
  pair_base: np.ndarray


def _kv_arrays(kv, layout: Layout, caps: Capacities, round1: dict, round2: dict, mine) -> _KV:
  """Keys/values: deduplicated prefix pieces (one per server, document and holding shard). A
  server reads its own pieces from its buffer; the others arrive packed by sender: in round 1
  from their holder, relayed ones in round 2 from their relay (its blocks after round 1's). The
  server gathers each (server, document) pair's prefix contiguously, and the inverse of that
  gather is the same ranges turned around (the backward gathers K/V gradients by it)."""
  n, tkv = mine.size, layout.kv_rows  # K/V rows per device: its buffer, then a prior buffer's
  rkv, rkv2, skvs, skvs2, skv = caps.recv_kv, caps.recv_kv2, caps.send_kv, caps.send_kv2, caps.skv
  kv_send_off, kv_recv_off = round1["send_off"], round1["recv_off"]
  kv2_send_off, kv2_recv_off = round2["send_off"], round2["recv_off"]
  num_docs = max(int(np.asarray(layout.doc_lens).size), 1)
  dst = kv.pair_server[kv.piece_pair]
  relayed = kv.piece_via >= 0
  kblk = relayed * (n * n) + np.where(relayed, kv.piece_via, kv.piece_src) * n + dst
  korder = np.lexsort((kv.piece_doc_off, kv.piece_pair, kblk))
  src, kdst, rows = kv.piece_src[korder], dst[korder], kv.piece_rows[korder]
  src_off, via, rel = kv.piece_src_off[korder], kv.piece_via[korder], relayed[korder]
  kpos = cumsum_in_groups(rows, kblk[korder])
  own = src == kdst
  # Where a server's piece sits in its [local Tkv | round-1 Rkv | round-2 Rkv2] rows; a relayed
  # piece is forwarded from where the relay's own piece of that shard (`fed`) sits.
  kv_row = np.where(own, src_off, tkv + kv_recv_off[kdst, src] + kpos)
  fed = _relay_sources(kv, korder, rel, num_docs)
  r = np.maximum(via, 0)
  kv_row = np.where(rel, tkv + rkv + kv2_recv_off[kdst, r] + kpos, kv_row)
  # Round 1 also fills, for `devices`, the pieces their relays forward to them.
  feeds = np.zeros(rel.size, bool)
  feeds[fed[rel & mine[kdst]]] = True
  send_kv_idx, send_kv_valid = _zeros(skvs, mine)
  w = ~own & ~rel & (mine[src] | mine[kdst] | feeds)
  fill_ranges(send_kv_idx, send_kv_valid, (src * skvs + kv_send_off[src, kdst] + kpos)[w],
              src_off[w], rows[w])
  send_kv2_idx, send_kv2_valid = _zeros(skvs2, mine)
  w = rel & (mine[r] | mine[kdst])
  fill_ranges(send_kv2_idx, send_kv2_valid, (r * skvs2 + kv2_send_off[r, kdst] + kpos)[w],
              kv_row[fed][w], rows[w])
  need = np.bincount(kv.pair_server, weights=kv.pair_need, minlength=n).max(initial=0)
  if need > skv:
    raise PlanMismatchError(f"plan gathers {int(need)} K/V rows on one server, more than the "
                            f"capacity {skv}")
  pair_base = cumsum_in_groups(kv.pair_need, kv.pair_server)
  server_kv_idx, server_kv_valid = _zeros(skv, mine)
  w = mine[kdst]
  slot = (pair_base[kv.piece_pair[korder]] + kv.piece_doc_off[korder])[w]
  fill_ranges(server_kv_idx, server_kv_valid, (kdst * skv)[w] + slot, kv_row[w], rows[w])
  held = tkv + rkv + rkv2
  _refuse_overlaps(kdst[w], kv_row[w], rows[w])
  kv_inv, kv_inv_valid = _zeros(held, mine)
  fill_ranges(kv_inv, kv_inv_valid, (kdst * held + kv_row)[w], slot, rows[w])
  return _KV(arrays=dict(server_kv_idx=server_kv_idx, server_kv_valid=server_kv_valid,
                         server_kv_inv=kv_inv, server_kv_inv_valid=kv_inv_valid),
             send=(send_kv_idx, send_kv_valid), send2=(send_kv2_idx, send_kv2_valid),
             pair_base=pair_base)


def _task_tables(tasks: tuple, kv, pair_base: np.ndarray, ctask: int, mine,
                 num_docs: int) -> dict:
  """Each server's task table, its tasks in order of their query rows: query rows at the
  server, keys from its (server, document) pair's prefix."""
  server, doc, q_start, q_len, q_hi = tasks
  n = mine.size
  tpair = np.searchsorted(kv.pair_server * num_docs + kv.pair_doc, server * num_docs + doc)
  torder = np.lexsort((q_start, server))
  srv = server[torder]
  slot = cumsum_in_groups(np.ones_like(srv), srv)
  if srv.size and slot.max() >= ctask:
    raise PlanMismatchError(f"plan has {int(slot.max()) + 1} tasks on one server, more than the "
                            f"capacity {ctask}")
  w = mine[srv]
  flat, torder = (srv * ctask + slot)[w], torder[w]
  tab = {k: sparse_zeros(mine, ctask, np.int32) for k in ("q_start", "q_len", "kv_start", "kv_len")}
  tab["q_start"][flat] = q_start[torder]
  tab["q_len"][flat] = q_len[torder]
  tab["kv_start"][flat] = pair_base[tpair[torder]]
  tab["kv_len"][flat] = q_hi[torder]
  return tab


def _relay_sources(kv, korder: np.ndarray, rel: np.ndarray, num_docs: int) -> np.ndarray:
  """For each piece (in `korder`'s order), the piece its rows are forwarded from: for a relayed
  one (`rel`) the relay's own round-1 piece of that shard, found by (relay, document, first
  document position); every other piece itself. Raises PlanMismatchError where the relay holds
  no such piece, or fewer rows of it."""
  pair, doc_off, src, rows, via = (a[korder] for a in (
      kv.piece_pair, kv.piece_doc_off, kv.piece_src, kv.piece_rows, kv.piece_via))
  if not rel.any():
    return np.arange(rel.size)
  span = int(doc_off.max(initial=0)) + 1
  # Each direct piece keyed by (its server, document, first position), sorted.
  direct = np.flatnonzero(~rel)
  key = (kv.pair_server[pair[direct]] * num_docs + kv.pair_doc[pair[direct]]) * span + doc_off[direct]
  by_key = direct[np.argsort(key, kind="stable")]
  key = np.sort(key)
  want = (np.maximum(via, 0) * num_docs + kv.pair_doc[pair]) * span + doc_off
  at = np.minimum(np.searchsorted(key, want), max(key.size - 1, 0))
  hit = by_key[at] if key.size else np.zeros_like(at)
  ok = (key[at] == want) & (src[hit] == src) & (rows[hit] >= rows) if key.size else ~rel
  if not ok[rel].all():
    raise PlanMismatchError("plan relays K/V rows through a device that did not receive them")
  return np.where(rel, hit, np.arange(rel.size))


def _check_fits(q_pairs: PairRows, kv_pairs: PairRows, kv2_pairs: PairRows, caps: Capacities,
                n: int) -> None:
  """Raises PlanMismatchError when the plan's moving rows do not fit the buffers (or, for the
  tiled exchange, its blocks)."""
  for name, pairs, send, recv, block in (
      ("query", q_pairs, caps.send_q, caps.recv_q, caps.c),
      ("K/V", kv_pairs, caps.send_kv, caps.recv_kv, caps.ckv),
      ("relayed K/V", kv2_pairs, caps.send_kv2, caps.recv_kv2, caps.ckv2)):
    sent, got = int(pairs.sent(n).max(initial=0)), int(pairs.received(n).max(initial=0))
    if sent > send or got > recv:
      raise PlanMismatchError(f"plan sends {sent} / receives {got} {name} rows on one device, "
                              f"more than the buffers' capacities {send} / {recv}")
    if block and pairs.largest() > block:
      raise PlanMismatchError(f"plan moves {pairs.largest()} {name} rows between two devices, "
                              f"more than the tiled exchange's block capacity {block}")


def _refuse_overlaps(server: np.ndarray, start: np.ndarray, length: np.ndarray) -> None:
  """Raises PlanMismatchError when two of the row ranges [start, start + length) a server
  gathers overlap: a K/V row in two slots has no single inverse."""
  keep = length > 0
  server, start, length = server[keep], start[keep], length[keep]
  order = np.lexsort((start, server))
  server, start, end = server[order], start[order], (start + length)[order]
  if ((server[1:] == server[:-1]) & (start[1:] < end[:-1])).any():
    raise PlanMismatchError("plan gathers one K/V row into two server slots")


def rows_selector(n: int, devices):
  """An index for the rows `devices` (default: all) of an [n, ...] array: a slice when they are
  consecutive, as a process's devices usually are (a view, no copy), else the sorted rows."""
  if devices is None:
    return slice(None)
  d = np.unique(np.asarray(devices, np.int64))
  return slice(int(d[0]), int(d[-1]) + 1) if d.size and d[-1] - d[0] + 1 == d.size else d
