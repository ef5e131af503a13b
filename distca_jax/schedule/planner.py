"""The communication-aware CA-task scheduler (DESIGN.md §1 "The scheduler").

`balance(layout, comm, epsilon)` places the CA-tasks of one (nano-)batch on attention servers:

1. Every layout shard starts as a task on its home device. Load F_s = area of the tasks on s,
   target F̄ = ΣF / N. Servers above F̄ have a surplus, servers below it a deficit.
2. Take the destination d with the largest deficit. For candidate items on surplus sources:
   ΔF = min(F_item, surplus_s, deficit_d); V = bytes to move ΔF worth of the item (the whole item,
   or the byte-optimal sub-range from `cost.optimal_split`, cut at 128-token boundaries);
   score E = ΔF / V. Move the best candidate.
3. Repeat until every server is within ε·F̄ of F̄, or no candidate can move.

Moves never push a source below F̄ or a destination above F̄ (up to one 128-row granule of
rounding), so received tasks never move again, and tasks stay home unless a move is needed to
bring some server within the tolerance: with equal loads nothing moves.

Speed (the planner runs on the host once per nano-batch, ahead of the GPUs): the loop is over
*moves*, never over tokens or documents. Each source offers its `top_k` largest home items as
candidates (long documents give the best ΔF per byte: a short document moved whole costs
bytes ∝ l for area ∝ l², so E ∝ l), and a move evaluates all candidates of all surplus sources in
one vectorised numpy expression. Bytes in E use the paper's estimate (no deduplication); the
plan's reported bytes (`traffic`) deduplicate KV per server and document.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distca_jax.data.packing import Layout
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.items import GRANULE, Tasks, initial_tasks


@dataclasses.dataclass(frozen=True)
class BalanceStats:
  """What the planner did. Loads are areas (query-key pairs) per server, float64 [N]."""

  epsilon: float
  moves: int
  load_before: np.ndarray
  load_after: np.ndarray

  @property
  def imbalance_before(self) -> float:
    return _imbalance(self.load_before)

  @property
  def imbalance_after(self) -> float:
    return _imbalance(self.load_after)


def _imbalance(load: np.ndarray) -> float:
  mean = float(load.mean()) if load.size else 0.0
  return float(load.max()) / mean if mean > 0 else 1.0


def balance(layout: Layout, comm: CommModel, epsilon: float = 0.1, *, top_k: int = 3,
            max_sources: int = 8, max_moves: int | None = None,
            validate: bool = True) -> tuple[Tasks, BalanceStats]:
  """Assigns every CA-task of `layout` to a server (servers = the layout's N buffers/devices).

  Args:
    layout: the packed step (N buffers of T tokens).
    comm: per-row byte sizes (its β = kv/q row bytes shapes the sub-range choice).
    epsilon: tolerance; the planner stops once every server is within epsilon * mean load.
    top_k: candidate items offered per source and move.
    max_sources: per move, only the sources with the largest surplus offer candidates (a larger
      surplus allows a larger ΔF, which costs fewer bytes per FLOP, so these dominate E).
    max_moves: safety bound on moves (default 8 N + 64).
  Returns:
    (tasks, stats): tasks ordered by (home, home_off) with their servers; stats with loads.
  Raises:
    ValueError: bad layout or epsilon.
  """
  if not 0 <= epsilon < 10:
    raise ValueError(f"epsilon: must be in [0, 10), got {epsilon}")
  base = initial_tasks(layout, validate=validate)
  n = layout.num_buffers
  g = float(GRANULE)
  qb, kvb = comm.q_row_bytes, comm.kv_row_bytes
  beta = comm.beta
  max_moves = 8 * n + 64 if max_moves is None else max_moves

  # Growable struct of arrays: every move splits one piece into at most three.
  cap_p = base.size + 2 * max_moves + 2
  home = np.zeros(cap_p, np.int64)
  doc = np.zeros(cap_p, np.int64)
  lo = np.zeros(cap_p, np.int64)
  hi = np.zeros(cap_p, np.int64)
  off = np.zeros(cap_p, np.int64)
  server = np.zeros(cap_p, np.int64)
  area = np.zeros(cap_p, np.float64)
  p = base.size
  home[:p], doc[:p], lo[:p], hi[:p] = base.home, base.doc, base.q_lo, base.q_hi
  off[:p], server[:p] = base.home_off, base.server
  area[:p] = base.area()

  load = np.bincount(server[:p], weights=area[:p], minlength=n).astype(np.float64)
  load_before = load.copy()
  target = float(load.sum()) / n if n else 0.0
  tol = epsilon * target

  # Home pieces per source, and each source's top_k candidates with their geometry cached
  # ([n, top_k] float arrays; fa = -1 marks an empty slot) so a move touches only small arrays.
  order = np.argsort(home[:p], kind="stable")
  bounds = np.searchsorted(home[:p][order], np.arange(n + 1))
  at_home = [order[bounds[s]:bounds[s + 1]].tolist() for s in range(n)]
  cand = np.full((n, top_k), -1, np.int64)
  c_a0 = np.zeros((n, top_k))
  c_e0 = np.zeros((n, top_k))
  c_fa = np.full((n, top_k), -1.0)
  c_q0 = np.ones((n, top_k))  # 1 + 4 (a0² + a0): y_min = (sqrt(q0 + 8 want) - 1) / 2
  c_yn = np.zeros((n, top_k))  # first grid point above a0, capped at e0

  def refresh(s):  # scalar code: the lists are short and numpy calls cost more than they save
    items = at_home[s]
    if len(items) > top_k:
      items = sorted(items, key=area.__getitem__, reverse=True)[:top_k]
    for j in range(top_k):
      if j < len(items):
        i = items[j]
        a0, e0 = float(lo[i]), float(hi[i])
        cand[s, j], c_a0[s, j], c_e0[s, j], c_fa[s, j] = i, a0, e0, area[i]
        c_q0[s, j] = 1.0 + 4.0 * (a0 * a0 + a0)
        c_yn[s, j] = min(e0, (a0 // g + 1.0) * g)
      else:
        cand[s, j], c_fa[s, j] = -1, -1.0

  # Initial candidates, vectorised: the top_k largest shards of each home.
  by_area = np.lexsort((-area[:p], home[:p]))
  rank = np.arange(p) - bounds[home[:p][by_area]]
  first = by_area[rank < top_k]
  h, col = home[first], rank[rank < top_k]
  cand[h, col] = first
  a0, e0 = lo[first].astype(np.float64), hi[first].astype(np.float64)
  c_a0[h, col], c_e0[h, col], c_fa[h, col] = a0, e0, area[first]
  c_q0[h, col] = 1.0 + 4.0 * (a0 * a0 + a0)
  c_yn[h, col] = np.minimum(e0, (np.floor(a0 / g) + 1.0) * g)

  k_opt = 2.0 * beta / (beta + 2.0)  # n_q* = sqrt(k_opt * want), cost.optimal_split
  stuck_pen = np.zeros(n)  # -inf: destination no candidate can fill without overshooting
  m_src = min(max_sources, n)
  moves = 0
  while moves < max_moves:
    dl = target - load  # deficit (> 0) or surplus (< 0) per server
    if dl.max() <= tol and -dl.min() <= tol:
      break
    de = dl + stuck_pen
    d = int(np.argmax(de))
    cap_d = float(de[d])
    if cap_d <= 0:
      break
    srcs = np.argpartition(dl, m_src - 1)[:m_src] if m_src < n else np.arange(n)
    sur = -dl[srcs]
    # While some destination is outside the tolerance, any surplus source may give; once all are
    # inside, only sources outside it (so the loop ends as soon as everyone is within ε).
    keep = (sur > (0.0 if cap_d > tol else tol)) & (srcs != d)
    srcs, sur = srcs[keep], sur[keep]
    if srcs.size == 0:
      stuck_pen[d] = -np.inf
      continue
    a0, e0, fa = c_a0[srcs], c_e0[srcs], c_fa[srcs]
    cap = np.minimum(sur, cap_d)[:, None]
    want = np.maximum(np.minimum(fa, cap), 0.0)
    whole = fa <= cap
    # Byte-optimal sub-range [x, y) of `want` pairs inside [a0, e0), snapped to the 128 grid.
    nq = np.sqrt(k_opt * want)
    y = want / np.maximum(nq, 1e-9) + 0.5 * nq
    y = np.minimum(np.maximum(y, 0.5 * (np.sqrt(c_q0[srcs] + 8.0 * want) - 1.0)), e0)
    y = np.round(y * (1.0 / g)) * g
    y = np.where(y <= a0, c_yn[srcs], np.minimum(y, e0))
    t = 2.0 * y + 1.0
    x = y - 0.5 * (t - np.sqrt(np.maximum(t * t - 8.0 * want, 0.0)))
    x = np.round(x * (1.0 / g)) * g
    x = np.maximum(np.where(x >= y, np.floor((y - 1.0) * (1.0 / g)) * g, x), a0)
    x = np.where(whole, a0, x)
    y = np.where(whole, e0, y)
    nrow = y - x
    got = nrow * (y + x + 1.0) * 0.5
    # A rounded move may overshoot by part of a granule, never by more than half the tolerance
    # (at ε = 0, by at most the area of one granule at that position).
    bad = (got > cap + np.maximum(0.5 * tol, g * y)) | (fa <= 0.0)
    e = np.where(bad, -1.0, got / np.maximum(nrow * qb + y * kvb, 1.0))
    best = int(np.argmax(e))
    if e.flat[best] <= 0.0:
      stuck_pen[d] = -np.inf
      continue
    r, col = divmod(best, top_k)
    s = int(srcs[r])
    i = int(cand[s, col])
    xi, yi = int(x.flat[best]), int(y.flat[best])
    # Split piece i = [lo, hi) into [lo, x) home, [x, y) -> d, [y, hi) home.
    li, hi_i = int(lo[i]), int(hi[i])
    at_home[s].remove(i)
    for a, b, dst in ((li, xi, s), (yi, hi_i, s), (xi, yi, d)):
      if b <= a:
        continue
      home[p], doc[p], lo[p], hi[p] = home[i], doc[i], a, b
      off[p], server[p] = off[i] + (a - li), dst
      area[p] = (b - a) * (b + a + 1.0) / 2.0
      if dst == s:
        at_home[s].append(p)
      p += 1
    area[i] = 0.0
    hi[i] = lo[i]  # retired: zero-length, dropped below
    moved = float(got.flat[best])
    load[s] -= moved
    load[d] += moved
    refresh(s)
    moves += 1

  live = hi[:p] > lo[:p]
  tasks = Tasks(home=home[:p][live], doc=doc[:p][live], q_lo=lo[:p][live], q_hi=hi[:p][live],
                home_off=off[:p][live], server=server[:p][live]).sorted()
  load_after = np.bincount(tasks.server, weights=tasks.area(), minlength=n)
  return tasks, BalanceStats(epsilon=epsilon, moves=moves, load_before=load_before,
                             load_after=load_after)


# ----------------------------------------------------------------------------- KV requests


@dataclasses.dataclass(frozen=True)
class KVRequests:
  """Which KV rows each server needs, deduplicated per (server, document).

  Pairs p (one per (server, document) with a task there): pair_server, pair_doc, pair_need
  (server needs document rows [0, pair_need)). Pieces k (one per pair and layout shard that
  overlaps the needed prefix): piece_pair, piece_src (device holding the rows), piece_src_off
  (first buffer row), piece_doc_off (first document position), piece_rows.
  """

  pair_server: np.ndarray
  pair_doc: np.ndarray
  pair_need: np.ndarray
  piece_pair: np.ndarray
  piece_src: np.ndarray
  piece_src_off: np.ndarray
  piece_doc_off: np.ndarray
  piece_rows: np.ndarray


def kv_requests(tasks: Tasks, layout: Layout) -> KVRequests:
  """Deduplicated KV rows per (server, document), split by the layout shard that holds them."""
  num_docs = int(np.asarray(layout.doc_lens).size)
  key = tasks.server * max(num_docs, 1) + tasks.doc
  order = np.argsort(key, kind="stable")
  k_sorted = key[order]
  starts = np.flatnonzero(np.r_[True, k_sorted[1:] != k_sorted[:-1]]) if key.size else np.zeros(0, np.int64)
  pair_key = k_sorted[starts]
  pair_need = np.maximum.reduceat(tasks.q_hi[order], starts) if key.size else np.zeros(0, np.int64)
  pair_server = pair_key // max(num_docs, 1)
  pair_doc = pair_key % max(num_docs, 1)
  # Layout shards grouped by document in position order.
  s_order = np.lexsort((layout.doc_offset, layout.doc))
  s_doc = layout.doc[s_order]
  first = np.searchsorted(s_doc, np.arange(num_docs))
  count = np.bincount(s_doc, minlength=num_docs)
  reps = count[pair_doc]
  piece_pair = np.repeat(np.arange(pair_doc.size), reps)
  within = np.arange(piece_pair.size) - np.repeat(np.cumsum(reps) - reps, reps)
  shard = s_order[first[pair_doc][piece_pair] + within]
  d_off = layout.doc_offset[shard]
  need = pair_need[piece_pair]
  keep = d_off < need
  piece_pair, shard, d_off = piece_pair[keep], shard[keep], d_off[keep]
  rows = np.minimum(d_off + layout.length[shard], pair_need[piece_pair]) - d_off
  return KVRequests(pair_server=pair_server, pair_doc=pair_doc, pair_need=pair_need,
                    piece_pair=piece_pair, piece_src=np.asarray(layout.buffer[shard], np.int64),
                    piece_src_off=np.asarray(layout.buffer_offset[shard], np.int64),
                    piece_doc_off=np.asarray(d_off, np.int64), piece_rows=np.asarray(rows, np.int64))


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


def traffic(tasks: Tasks, layout: Layout, comm: CommModel, pairwise: bool = False) -> Traffic:
  """Network bytes of a task placement, KV deduplicated per (server, document).

  Query rows: Q out and O back (and the backward's terms, see CommModel) for tasks whose server
  is not their home. KV rows: each server receives doc[0:need) once per document, from whichever
  devices hold those rows; rows the server holds itself are free.
  """
  n = layout.num_buffers
  q_len = tasks.q_len.astype(np.float64)
  remote = tasks.server != tasks.home
  q_out = np.bincount(tasks.home[remote], weights=q_len[remote], minlength=n)
  q_in = np.bincount(tasks.server[remote], weights=q_len[remote], minlength=n)
  kv = kv_requests(tasks, layout)
  dst = kv.pair_server[kv.piece_pair]
  r = dst != kv.piece_src
  rows = kv.piece_rows.astype(np.float64)
  kv_out = np.bincount(kv.piece_src[r], weights=rows[r], minlength=n)
  kv_in = np.bincount(dst[r], weights=rows[r], minlength=n)
  send = q_out * comm.q_row_bytes + kv_out * comm.kv_row_bytes
  recv = q_in * comm.q_row_bytes + kv_in * comm.kv_row_bytes
  pair = None
  if pairwise:
    pair = np.zeros((n, n))
    np.add.at(pair, (tasks.home[remote], tasks.server[remote]), q_len[remote] * comm.q_row_bytes)
    np.add.at(pair, (kv.piece_src[r], dst[r]), rows[r] * comm.kv_row_bytes)
  return Traffic(send=send, recv=recv, q_rows_out=q_out, kv_rows_out=kv_out,
                 remote_tasks=np.bincount(tasks.home[remote], minlength=n), pair_bytes=pair)
