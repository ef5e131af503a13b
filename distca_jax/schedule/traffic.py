"""What a placement of CA-tasks moves: each server's K/V requests, the rows each (device, server)
pair carries, and the bytes per device (docs/METHOD.md, "The scheduler").

`kv_requests` deduplicates the K/V rows a server needs per document and splits them by the
layout shard that holds them (relayed, `relay.route`, when asked); `pair_rows` counts the query
and K/V rows of each pair; `traffic` prices them with a `CommModel`, for the transport that sends
only the rows that move or for the tiled all_to_all. Numpy only: loops are over shards and
pairs, never over tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distca_jax.data.packing import Layout, ranges
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.items import Tasks, exchange_capacity
from distca_jax.schedule.relay import Relay, route


@dataclasses.dataclass(frozen=True)
class KVRequests:
  """Which KV rows each server needs, deduplicated per (server, document).

  Pairs p (one per (server, document) with a task there): pair_server, pair_doc, pair_need
  (server needs document rows [0, pair_need)). Pieces k (one per pair and layout shard that
  overlaps the needed prefix): piece_pair, piece_src (device holding the rows), piece_src_off
  (first K/V row of the device: its buffer row, or T + row for a ping-pong `prior` shard),
  piece_doc_off (first document position), piece_rows, piece_via (-1: sent by piece_src, or local
  when piece_src is the server; else the device that forwards it in a second round, having
  received the same rows, or more, of that shard directly: `relay.py`). Without relays a pair
  has one piece per shard; a relayed shard's pieces are cut at its slices.
  """

  pair_server: np.ndarray
  pair_doc: np.ndarray
  pair_need: np.ndarray
  piece_pair: np.ndarray
  piece_src: np.ndarray
  piece_src_off: np.ndarray
  piece_doc_off: np.ndarray
  piece_rows: np.ndarray
  piece_via: np.ndarray


def kv_requests(tasks: Tasks, layout: Layout, relay: Relay | None = None) -> KVRequests:
  """Deduplicated KV rows per (server, document), split by the layout shard that holds them;
  with `relay`, a shard that three or more other servers need is relayed (`relay.route`)."""
  num_docs = int(np.asarray(layout.doc_lens).size)
  key = tasks.server * max(num_docs, 1) + tasks.doc
  order = np.argsort(key, kind="stable")
  k_sorted = key[order]
  starts = np.flatnonzero(np.r_[True, k_sorted[1:] != k_sorted[:-1]]) if key.size else np.zeros(0, np.int64)
  pair_key = k_sorted[starts]
  pair_need = np.maximum.reduceat(tasks.q_hi[order], starts) if key.size else np.zeros(0, np.int64)
  pair_server = pair_key // max(num_docs, 1)
  pair_doc = pair_key % max(num_docs, 1)
  # Layout shards grouped by document in position order; a ping-pong Pong's prior shards (held
  # in Ping's buffer on the same device) are its K/V rows T + r.
  sh_doc, sh_doc_off, sh_len, sh_buf, sh_row = (layout.doc, layout.doc_offset, layout.length,
                                                layout.buffer, layout.buffer_offset)
  if layout.prior is not None:
    p = layout.prior
    sh_doc, sh_doc_off, sh_len, sh_buf = (np.concatenate([a, b]) for a, b in (
        (sh_doc, p.doc), (sh_doc_off, p.doc_offset), (sh_len, p.length), (sh_buf, p.buffer)))
    sh_row = np.concatenate([sh_row, layout.buffer_len + p.buffer_offset])
  s_order = np.lexsort((sh_doc_off, sh_doc))
  s_doc = sh_doc[s_order]
  first = np.searchsorted(s_doc, np.arange(num_docs))
  count = np.bincount(s_doc, minlength=num_docs)
  reps = count[pair_doc]
  piece_pair = np.repeat(np.arange(pair_doc.size), reps)
  shard = s_order[ranges(first[pair_doc], reps)]
  d_off = sh_doc_off[shard]
  need = pair_need[piece_pair]
  keep = d_off < need
  piece_pair, shard, d_off = piece_pair[keep], shard[keep], d_off[keep]
  rows = np.asarray(np.minimum(d_off + sh_len[shard], pair_need[piece_pair]) - d_off, np.int64)
  src = np.asarray(sh_buf[shard], np.int64)
  src_off, d_off = np.asarray(sh_row[shard], np.int64), np.asarray(d_off, np.int64)
  via = np.full(rows.shape, -1, np.int64)
  if relay is not None:  # relayed shards' pieces are cut at their slices (`relay.route`)
    r = route(relay, shard, src, pair_server[piece_pair], rows, layout.num_buffers)
    piece_pair, src, src_off, d_off = (a[r.parent] for a in (piece_pair, src, src_off, d_off))
    src_off, d_off, rows, via = src_off + r.start, d_off + r.start, r.rows, r.via
  return KVRequests(pair_server=pair_server, pair_doc=pair_doc, pair_need=pair_need,
                    piece_pair=piece_pair, piece_src=src, piece_src_off=src_off,
                    piece_doc_off=d_off, piece_rows=rows, piece_via=via)


@dataclasses.dataclass(frozen=True)
class PairRows:
  """The rows one round of the exchange moves between (device, server) pairs, listed only for
  the pairs that move any (a handful per device on a large mesh): `sender`, `server` (sorted by
  sender then server, never equal), `rows`."""

  sender: np.ndarray
  server: np.ndarray
  rows: np.ndarray

  @staticmethod
  def summed(sender, server, rows, n: int) -> "PairRows":
    """The rows of each (sender, server) pair summed."""
    key, pair = np.unique(np.asarray(sender, np.int64) * n + server, return_inverse=True)
    total = np.bincount(pair, weights=rows, minlength=key.size).astype(np.int64)
    return PairRows(sender=key // n, server=key % n, rows=total)

  def sent(self, n: int) -> np.ndarray:
    """[n] rows each device sends."""
    return np.bincount(self.sender, weights=self.rows, minlength=n).astype(np.int64)

  def received(self, n: int) -> np.ndarray:
    """[n] rows each server receives."""
    return np.bincount(self.server, weights=self.rows, minlength=n).astype(np.int64)

  def largest(self) -> int:
    """The most rows one pair moves."""
    return int(self.rows.max(initial=0))

  def dense(self, n: int) -> np.ndarray:
    """int64 [n, n]: [d, s] the rows d sends s (the dispatch arrays' counts)."""
    out = np.zeros((n, n), np.int64)
    out[self.sender, self.server] = self.rows
    return out


def exchange_pairs(tasks: Tasks, layout: Layout, kv: KVRequests | None = None
                   ) -> tuple[PairRows, PairRows, PairRows]:
  """Rows each (device, server) pair moves under `tasks` (rows that stay on their device do not
  move): query rows (home -> server), deduplicated K/V rows sent in the first round (holder ->
  server) and in the second (relay -> server; none unless `kv` has relays). `kv`: the tasks'
  `kv_requests`, when already at hand (default: without relays)."""
  n = layout.num_buffers
  remote = tasks.server != tasks.home
  q = PairRows.summed(tasks.home[remote], tasks.server[remote], tasks.q_len[remote], n)
  kv = kv_requests(tasks, layout) if kv is None else kv
  sender, dst, rows, relayed = _kv_sends(kv)
  k1, k2 = (PairRows.summed(sender[m], dst[m], rows[m], n) for m in (~relayed, relayed))
  return q, k1, k2


def pair_rows(tasks: Tasks, layout: Layout, kv: KVRequests | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`exchange_pairs` as int64 [N, N] arrays, zero on the diagonal (the dispatch arrays' counts;
  the reports' per-pair tables)."""
  return tuple(p.dense(layout.num_buffers) for p in exchange_pairs(tasks, layout, kv))


def _kv_sends(kv: KVRequests) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(sender, server, rows, relayed) of the K/V pieces that move: the relay sends what it
  forwards, the holder the rest."""
  dst = kv.pair_server[kv.piece_pair]
  m = dst != kv.piece_src
  via = kv.piece_via[m]
  return np.where(via >= 0, via, kv.piece_src[m]), dst[m], kv.piece_rows[m], via >= 0


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Bytes per device per layer (for the server's heads; multiply by layers for a step).

  send[d], recv[d]: bytes device d puts on / takes off the network (local rows excluded).
  q_rows_out[d], kv_rows_out[d]: remote rows sent. pair_bytes[d, s]: only if asked (N×N).
  """

  send: np.ndarray
  recv: np.ndarray
  q_rows_out: np.ndarray
  kv_rows_out: np.ndarray
  remote_tasks: np.ndarray  # tasks of home d computed elsewhere, per home
  pair_bytes: np.ndarray | None = None

  @property
  def max_bytes(self) -> float:
    return float(max(self.send.max(initial=0.0), self.recv.max(initial=0.0)))


def traffic(tasks: Tasks, layout: Layout, comm: CommModel, pairwise: bool = False,
            tiled: bool = False, relay: Relay | None = None,
            kv: KVRequests | None = None) -> Traffic:
  """Network bytes of a task placement, KV deduplicated per (server, document).

  Query rows: Q out and O back (and the backward's terms, see CommModel) for tasks whose server
  is not their home. KV rows: each server receives doc[0:need) once per document, from whichever
  devices hold those rows; rows the server holds itself are free. `tiled`: the bytes of the
  dispatch's tiled all_to_all instead (`attention.exchange: tiled`), where every (device, server)
  pair carries the capacity bucket of the largest pair's rows, moving or not (with `relay`, a
  second all_to_all carries the relayed rows). `relay`: K/V shards needed by many servers are
  relayed (`kv_requests`); a relay sends the rows it forwards, the holder only the others.
  `kv`: the tasks' `kv_requests` with `relay`, when already at hand. Work of the tasks and
  pieces; [N, N] only for `pairwise`.
  """
  n = layout.num_buffers
  q_len = tasks.q_len.astype(np.float64)
  remote = tasks.server != tasks.home
  q_out = np.bincount(tasks.home[remote], weights=q_len[remote], minlength=n)
  q_in = np.bincount(tasks.server[remote], weights=q_len[remote], minlength=n)
  kv = kv_requests(tasks, layout, relay) if kv is None else kv
  sender, dst, rows, _ = _kv_sends(kv)
  rows = rows.astype(np.float64)
  kv_out = np.bincount(sender, weights=rows, minlength=n)
  kv_in = np.bincount(dst, weights=rows, minlength=n)
  remote_tasks = np.bincount(tasks.home[remote], minlength=n)
  if tiled:
    cap = lambda pairs: exchange_capacity(pairs.largest(), layout.buffer_len)
    q_pair, kv1, kv2 = exchange_pairs(tasks, layout, kv)
    block = cap(q_pair) * comm.q_row_bytes + (cap(kv1) + cap(kv2)) * comm.kv_row_bytes
    every = np.full(n, (n - 1) * block, np.float64)  # N - 1 blocks each way
    pair = None
    if pairwise:
      pair = np.full((n, n), block, np.float64)
      np.fill_diagonal(pair, 0.0)
    return Traffic(send=every, recv=every.copy(), q_rows_out=q_out, kv_rows_out=kv_out,
                   remote_tasks=remote_tasks, pair_bytes=pair)
  send = q_out * comm.q_row_bytes + kv_out * comm.kv_row_bytes
  recv = q_in * comm.q_row_bytes + kv_in * comm.kv_row_bytes
  pair = None
  if pairwise:
    pair = np.zeros((n, n))
    np.add.at(pair, (tasks.home[remote], tasks.server[remote]), q_len[remote] * comm.q_row_bytes)
    np.add.at(pair, (sender, dst), rows * comm.kv_row_bytes)
  return Traffic(send=send, recv=recv, q_rows_out=q_out, kv_rows_out=kv_out,
                 remote_tasks=remote_tasks, pair_bytes=pair)
