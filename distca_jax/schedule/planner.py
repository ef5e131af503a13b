"""The communication-aware CA-task scheduler (docs/METHOD.md, "The scheduler").

`balance(layout, comm, epsilon)` places the CA-tasks of one (nano-)batch on attention servers:

1. Every layout shard starts as a task on its home device. Load F_s = area of the tasks on s,
   target F̄ = ΣF / N. Servers above F̄ have a surplus, servers below it a deficit.
2. Take the destination d with the largest deficit and the source s with the largest surplus.
   For s's candidate items: ΔF = min(F_item, surplus_s, deficit_d); V = bytes to move ΔF worth
   of the item (the whole item, or the byte-optimal sub-range from `cost.optimal_split`, cut at
   128-token boundaries); score E = ΔF / V. Move the best candidate (if none fits d, the source
   with the next largest surplus offers its own).
3. Repeat until every server is within ε·F̄ of F̄, or no candidate can move.

Moves never push a source below F̄ or a destination above F̄ (beyond the rounding of a cut to
the 128-token grid, at most half the tolerance or one granule's area), so received tasks never
move again, and tasks stay home unless a move is needed to bring some server within the
tolerance: with equal loads nothing moves.

Speed (the planner runs on the host once per nano-batch, ahead of the GPUs;
launch/bench_scheduler.py times it, docs/PERFORMANCE.md has the figures): the loop is over *moves*
(a few hundred), never over tokens or documents, and is scalar Python, which beats numpy on the
handful of numbers a move touches. Each source offers its `top_k` largest home items as
candidates (long documents give the best ΔF per byte: a short document moved whole costs bytes
∝ l for area ∝ l², so E ∝ l).
Surplus and deficit live in lazy max-heaps. Only splits are scored: an item that fits moves
whole, with an E known from the start, and an item none of whose sub-ranges can beat the best
found (`_subrange_bound`) is passed over. The layout's items stay numpy arrays; only what moves
becomes Python objects. Bytes in E use the paper's estimate (no deduplication); the plan's
reported bytes (`traffic.traffic`) deduplicate KV per server and document.

Why one source at a time: the method takes the best E over the candidates of every surplus
source, which favours the same long documents move after move (their splits score best) and
spreads each over many servers, its K/V prefix travelling to each. The heaviest source giving
first needs fewer moves and fewer bytes, and leaves a smaller hot spot (docs/PERFORMANCE.md,
"Scheduler").

Nodes (`nodes`, the trainer's `attention.data_rank_nodes`): a destination first asks the sources on
its own node, largest surplus first, among those that can give as much as the flat rule's source
would; the move is as large, and its bytes cross NVLink, not the network. Moves, plan time and
the balance stay those of the flat rule; fewer bytes cross nodes (docs/PERFORMANCE.md,
"Scheduler").
"""

from __future__ import annotations

import dataclasses
import heapq
import math

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
            max_sources: int = 32, max_moves: int | None = None, nodes=None,
            validate: bool = True) -> tuple[Tasks, BalanceStats]:
  """Assigns every CA-task of `layout` to a server (servers = the layout's N buffers/devices).

  Args:
    layout: the packed step (N buffers of T tokens).
    comm: per-row byte sizes (its β = kv/q row bytes shapes the sub-range choice).
    epsilon: tolerance; the planner stops once every server is within epsilon * mean load.
    top_k: candidate items offered per source and move.
    max_sources: per move, sources are tried in order of surplus, and the first with a candidate
      that fits the destination gives it; after this many without one, the destination is stuck.
    max_moves: safety bound on moves (default 8 N + 64).
    nodes: the node of each server (N ints; None: one node). A destination first takes from the
      sources on its own node whose surplus covers the move the flat rule would make (its deficit
      or the largest surplus, the smaller), largest first, and from the others only when none of
      those has a candidate that fits: the same moves, more of them over NVLink.
  Returns:
    (tasks, stats): tasks ordered by (home, home_off) with their servers; stats with loads.
  Raises:
    ValueError: bad layout or epsilon.
  """
  if not 0 <= epsilon < 10:
    raise ValueError(f"epsilon: must be in [0, 10), got {epsilon}")
  base = initial_tasks(layout, validate=validate)
  n = layout.num_buffers
  node = _node_ids(nodes, n)
  g = float(GRANULE)
  qb, kvb = comm.q_row_bytes, comm.kv_row_bytes
  max_moves = 8 * n + 64 if max_moves is None else max_moves

  area0 = base.area()
  p0 = base.size
  load_np = np.bincount(base.server, weights=area0, minlength=n).astype(np.float64)
  load_before = load_np.copy()
  target = float(load_np.sum()) / n if n else 0.0
  tol = epsilon * target
  load = load_np.tolist()

  # The layout's pieces stay numpy arrays (a batch of short documents has ~10^5 of them; turning
  # them all into lists and back costs more than the loop); a move retires one piece and appends up
  # to three to the lists `new`. Candidates are tuples (piece, a0, e0, area, E whole, doc, offset,
  # E bound of its sub-ranges), compared by scalar code, which beats numpy on the handful of
  # numbers a move touches.
  retired: list[int] = []
  new = {f: [] for f in ("home", "doc", "q_lo", "q_hi", "home_off", "server")}
  lo_f, hi_f = base.q_lo.astype(np.float64), base.q_hi.astype(np.float64)
  e_whole = area0 / np.maximum((hi_f - lo_f) * qb + hi_f * kvb, 1e-300)  # E of a whole-piece move
  e_sub = _subrange_bound(lo_f, hi_f, qb, kvb, np.clip)

  # Home pieces of each source by (area descending, piece id): `handed[s]` holds the alive ones
  # already taken from that order (and the pieces a move leaves home), `nxt[s]` the next one.
  by_area = _by_home_then_area(base.home, area0)
  bounds = np.searchsorted(base.home[by_area], np.arange(n + 1)).tolist()
  area_sorted = area0[by_area]
  handed: list[list[tuple]] = [[] for _ in range(n)]
  cands: list[list[tuple]] = [[] for _ in range(n)]

  chunk = 2 * top_k  # pieces handed out at a time

  def base_cands(idx):
    """Candidate tuples of layout pieces `idx`."""
    return zip(idx.tolist(), lo_f[idx].tolist(), hi_f[idx].tolist(), area0[idx].tolist(),
               e_whole[idx].tolist(), base.doc[idx].tolist(), base.home_off[idx].tolist(),
               e_sub[idx].tolist())

  def refresh(s):
    """cands[s] = the top_k largest home pieces of s (ties: the lower piece id)."""
    pool = handed[s]
    pool.sort(key=lambda c: (-c[3], c[0]))
    while nxt[s] < bounds[s + 1]:
      # Pieces not yet handed out come in order: only the next one can outrank the top_k-th.
      j = nxt[s]
      if len(pool) >= top_k and (-pool[top_k - 1][3], pool[top_k - 1][0]) < (
          -float(area_sorted[j]), int(by_area[j])):
        break
      idx = by_area[j:min(j + chunk, bounds[s + 1])]
      pool.extend(base_cands(idx))
      nxt[s] = j + idx.size
      pool.sort(key=lambda c: (-c[3], c[0]))
    cands[s] = pool[:top_k]

  rank = np.arange(p0) - np.asarray(bounds)[base.home[by_area]]
  first = by_area[rank < chunk]
  for h, c in zip(base.home[first].tolist(), base_cands(first)):
    handed[h].append(c)
  nxt = [min(bounds[s] + chunk, bounds[s + 1]) for s in range(n)]
  for s in range(n):
    refresh(s)

  k_opt = 2.0 * comm.beta / (comm.beta + 2.0)  # n_q* = sqrt(k_opt * want), cost.optimal_split
  inv_g = 1.0 / g

  def score(a0, e0, cap):
    """(E, x, y, got) of the best move of `cap` pairs out of piece [a0, e0) (its area is larger:
    a piece that fits moves whole, with the E of its tuple); E <= 0: none."""
    want = cap
    nq = math.sqrt(k_opt * want)
    y = want / nq + 0.5 * nq
    y_min = 0.5 * (math.sqrt(1.0 + 4.0 * (a0 * a0 + a0) + 8.0 * want) - 1.0)
    y = min(max(y, y_min), e0)
    y = round(y * inv_g) * g
    y = min(e0, (a0 // g + 1.0) * g) if y <= a0 else min(y, e0)
    t = 2.0 * y + 1.0
    x = y - 0.5 * (t - math.sqrt(max(t * t - 8.0 * want, 0.0)))
    x = round(x * inv_g) * g
    if x >= y:
      x = math.floor((y - 1.0) * inv_g) * g
    x = max(x, a0)
    nrow = y - x
    got = nrow * (y + x + 1.0) * 0.5
    # A rounded move may overshoot by part of a granule, never by more than half the tolerance
    # (at ε = 0, by at most the area of one granule at that position).
    if nrow <= 0 or got > cap + max(0.5 * tol, g * y):
      return -1.0, x, y, got
    return got / (nrow * qb + y * kvb), x, y, got

  # Max-heaps (negated keys) of surplus and of deficit with lazy deletion: an entry is current
  # while its version matches. Stuck destinations (no candidate fits) leave the deficit heap.
  ver = [0] * n
  sur_heap = [(target - load[s], 0, s) for s in range(n) if load[s] > target]
  def_heap = [(load[d] - target, 0, d) for d in range(n) if load[d] < target]
  heapq.heapify(sur_heap)
  heapq.heapify(def_heap)
  # Per node, the same surplus entries (one node: none, every source is local).
  node_heap = None
  if node is not None:
    node_heap = [[] for _ in range(max(node) + 1)]
    for entry in sur_heap:
      node_heap[node[entry[2]]].append(entry)
    for h in node_heap:
      heapq.heapify(h)
  stuck = [False] * n

  def push(s):
    ver[s] += 1
    if load[s] > target:
      heapq.heappush(sur_heap, (target - load[s], ver[s], s))
      if node_heap is not None:
        heapq.heappush(node_heap[node[s]], (target - load[s], ver[s], s))
    elif load[s] < target and not stuck[s]:
      heapq.heappush(def_heap, (load[s] - target, ver[s], s))

  def top(heap):
    while heap and heap[0][1] != ver[heap[0][2]]:
      heapq.heappop(heap)
    return heap[0] if heap else None

  stuck_max = 0.0  # largest deficit among stuck destinations (their loads no longer change)
  moves = 0
  while moves < max_moves:
    ts, td = top(sur_heap), top(def_heap)
    max_sur = -ts[0] if ts else 0.0
    max_def = max(-td[0] if td else 0.0, stuck_max)
    if max_sur <= tol and max_def <= tol:
      break
    if td is None:
      break
    d, cap_d = td[2], -td[0]
    # While some destination is outside the tolerance, any surplus source may give; once all are
    # inside, only sources outside it (so the loop ends as soon as everyone is within ε).
    floor_ = 0.0 if cap_d > tol else tol
    best_e, best = 0.0, None  # best E; (source, candidate, x, y, got)
    # The source with the largest surplus gives, its best candidate by E; the next sources only
    # when it has none that fits. Draining the heaviest source first moves fewer, larger pieces
    # than taking the best E over many sources, which sends a long document's pieces (and its
    # K/V prefix) to server after server. With nodes, d's own node's sources come first.
    # Allowing smaller local sources too would move more, smaller pieces and send a long
    # document's prefix to more servers: fewer bytes across nodes in all, a busier hot spot.
    tried = 0
    offered = set()
    for heap in ((node_heap[node[d]], sur_heap) if node_heap is not None else (sur_heap,)):
      popped = []
      while heap and best is None and tried < max_sources:
        entry = heapq.heappop(heap)
        s = entry[2]
        if entry[1] != ver[s]:
          continue
        popped.append(entry)
        sur = -entry[0]
        # A source on d's node gives only a move as large as the flat rule's would be.
        if sur <= floor_ or (heap is not sur_heap and sur < min(cap_d, max_sur)):
          break
        if s in offered:  # tried on d's node
          continue
        offered.add(s)
        tried += 1
        cap = min(sur, cap_d)
        for c in cands[s]:
          if c[3] <= cap:
            if c[4] > best_e:
              best_e, best = c[4], (s, c, c[1], c[2], c[3])
            continue
          if c[7] <= best_e:  # no sub-range of this piece beats the best
            continue
          e, x, y, got = score(c[1], c[2], cap)
          if e > best_e:
            best_e, best = e, (s, c, x, y, got)
      for entry in popped:
        heapq.heappush(heap, entry)
      if best is not None:
        break
    if best is None:
      stuck[d] = True
      stuck_max = max(stuck_max, cap_d)
      ver[d] += 1  # drops its deficit entry
      continue
    s, c, x, y, moved = best
    i, li, hi_i, doc_i, off_i = c[0], int(c[1]), int(c[2]), c[5], c[6]
    xi, yi = int(x), int(y)
    # Split piece i = [lo, hi) into [lo, x) home, [x, y) -> d, [y, hi) home.
    handed[s].remove(c)
    if i < p0:
      retired.append(i)
    else:
      new["q_hi"][i - p0] = new["q_lo"][i - p0]  # retired: zero-length, dropped below
    for a, b, dst in ((li, xi, s), (yi, hi_i, s), (xi, yi, d)):
      if b <= a:
        continue
      for f, v in (("home", s), ("doc", doc_i), ("q_lo", a), ("q_hi", b),
                   ("home_off", off_i + (a - li)), ("server", dst)):
        new[f].append(v)
      if dst == s:
        fa = (b - a) * (b + a + 1.0) / 2.0
        handed[s].append((p0 + len(new["home"]) - 1, float(a), float(b), fa,
                          fa / ((b - a) * qb + b * kvb), doc_i, off_i + (a - li),
                          _subrange_bound(float(a), float(b), qb, kvb, _clip)))
    load[s] -= moved
    load[d] += moved
    push(s)
    push(d)
    refresh(s)
    moves += 1

  keep = np.ones(p0, bool)
  keep[retired] = False
  added = {f: np.asarray(v, np.int64) for f, v in new.items()}
  live = added["q_hi"] > added["q_lo"]
  tasks = Tasks(**{f: np.concatenate([getattr(base, f)[keep], added[f][live]]) for f in new}).sorted()
  load_after = np.bincount(tasks.server, weights=tasks.area(), minlength=n)
  return tasks, BalanceStats(epsilon=epsilon, moves=moves, load_before=load_before,
                             load_after=load_after)


def _node_ids(nodes, n: int) -> list[int] | None:
  """Dense node numbers of `nodes` as a list (None when no node holds two servers, or one holds
  them all: then no source is nearer than another)."""
  if nodes is None:
    return None
  arr = np.asarray(nodes)
  if arr.shape != (n,) or not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"nodes: one integer node per server ({n}), got shape {arr.shape} "
                     f"dtype {arr.dtype}")
  uniq, dense = np.unique(arr, return_inverse=True)
  return None if uniq.size <= 1 or uniq.size == n else dense.tolist()


def _clip(v: float, lo: float, hi: float) -> float:
  return min(max(v, lo), hi)


def _subrange_bound(a0, e0, qb: float, kvb: float, clip):
  """Upper bound of E (pairs per byte) over the sub-ranges [x, y) of pieces [a0, e0) (floats or
  arrays; `clip`: np.clip or `_clip`). E of the m rows ending at y, m (2 y - m + 1) / 2 pairs for
  m qb + y kvb bytes, grows with y, so y = e0; in m it peaks at the positive root of
  qb m² + 2 e0 kvb m - (2 e0 + 1) e0 kvb, clipped to the piece."""
  m = (((e0 * kvb) ** 2 + qb * kvb * e0 * (2.0 * e0 + 1.0)) ** 0.5 - e0 * kvb) / qb
  m = clip(m, 1.0, e0 - a0)
  # A hair above the exact value: a bound that rounds below the score it bounds would skip it.
  return m * (2.0 * e0 - m + 1.0) / (2.0 * (m * qb + e0 * kvb)) * (1.0 + 1e-9)


def _by_home_then_area(home: np.ndarray, area: np.ndarray) -> np.ndarray:
  """Piece order by (home, area descending, index): one integer sort key where it fits (several
  times faster than np.lexsort); areas are integers (one of q and 2 q_lo + q + 1 is even)."""
  scale = int(area.max(initial=0.0)) + 1
  if home.size and int(home.max()) < 2 ** 62 // scale:
    return np.argsort(home * scale + (scale - 1 - area.astype(np.int64)), kind="stable")
  return np.lexsort((-area, home))


# ----------------------------------------------------------------------------- KV requests
