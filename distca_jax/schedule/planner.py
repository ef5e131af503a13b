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
import functools
import heapq
import math
from typing import NamedTuple

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
  # Why the planner stopped: "balanced" (every server within the tolerance), "stuck" (some
  # destination outside it that no candidate fits, e.g. pieces of 128 rows too large for its
  # deficit), "move cap" (max_moves), "no gain" (its moves did not lower the busiest server:
  # undone), "colocated" (not planned).
  stopped: str = "balanced"

  @property
  def short(self) -> bool:
    """Whether the plan stopped short of its tolerance (stuck or at the move cap)."""
    return self.stopped in ("stuck", "move cap", "no gain")

  @property
  def imbalance_before(self) -> float:
    return _imbalance(self.load_before)

  @property
  def imbalance_after(self) -> float:
    return _imbalance(self.load_after)


def _imbalance(load: np.ndarray) -> float:
  mean = float(load.mean()) if load.size else 0.0
  return float(load.max()) / mean if mean > 0 else 1.0


class Candidate(NamedTuple):
  """A piece a source offers: rows [lo, hi) of document `doc` at home row `home_off`, its area,
  E (pairs per byte) of moving it whole, and a bound on E over its sub-ranges."""

  piece: int
  lo: float
  hi: float
  area: float
  e_whole: float
  doc: int
  home_off: int
  e_bound: float


# Candidate from a tuple without a Python call per candidate (a batch hands out thousands).
_new_candidate = functools.partial(tuple.__new__, Candidate)


class Move(NamedTuple):
  """The move chosen: `source` gives rows [x, y) of `cand` (`pairs` of area) to the destination."""

  source: int
  cand: Candidate
  x: float
  y: float
  pairs: float
  e: float


def balance(layout: Layout, comm: CommModel, epsilon: float = 0.1, *, top_k: int = 3,
            max_sources: int = 32, max_moves: int | None = None, nodes=None, servers=None,
            validate: bool = True) -> tuple[Tasks, BalanceStats]:
  """Assigns every CA-task of `layout` to a server (servers = the layout's N buffers/devices).

  Args:
    layout: the packed step (N buffers of T tokens).
    comm: per-row byte sizes (its β = kv/q row bytes shapes the sub-range choice).
    epsilon: tolerance; the planner stops once every server is within epsilon * mean load.
    top_k: candidate items offered per source and move (>= 1).
    max_sources: per move, sources are tried in order of surplus, and the first with a candidate
      that fits the destination gives it; after this many without one, the destination is stuck.
    max_moves: safety bound on moves (default 8 N + 64).
    nodes: the node of each server (N ints; None: one node). A destination first takes from the
      sources on its own node whose surplus covers the move the flat rule would make (its deficit
      or the largest surplus, the smaller), largest first, and from the others only when none of
      those has a candidate that fits: the same moves, more of them over NVLink.
    servers: which servers take work (N bools, not all False; None: all): the target F̄ is
      ΣF over their number, a server outside takes nothing and gives all it holds (a pipelined
      tick spreads its attention over only some idle stages' servers, `schedule/tick.py`).
  Returns:
    (tasks, stats): tasks ordered by (home, home_off) with their servers; stats with loads and
    why the planner stopped (`BalanceStats.stopped`). A planner stuck short of the tolerance
    whose moves leave the busiest server as busy as before undoes them: the tasks stay home.
  Raises:
    ValueError: bad layout, epsilon, top_k, max_sources or max_moves.
  """
  check_epsilon(epsilon)
  if top_k < 1 or max_sources < 1 or (max_moves is not None and max_moves < 0):
    raise ValueError(f"balance: top_k and max_sources must be >= 1 and max_moves >= 0, got "
                     f"top_k={top_k}, max_sources={max_sources}, max_moves={max_moves}")
  base = initial_tasks(layout, validate=validate)
  n = layout.num_buffers
  max_moves = 8 * n + 64 if max_moves is None else max_moves
  pool = _Pool(base, n, comm, top_k)
  loads = _Loads(pool.load_before, epsilon, _node_ids(nodes, n), _servers(servers, n))
  scorer = _Scorer(comm, loads.tol)
  moves, stopped = 0, "balanced"
  while True:
    d, cap_d, max_sur = loads.next_destination()
    if d is None:
      break
    if moves >= max_moves:
      stopped = "move cap"
      break
    move = _choose(pool, loads, scorer.score, d, cap_d, max_sur, max_sources)
    if move is None:
      loads.give_up(d, cap_d)
      continue
    pool.apply(move, d)
    loads.shift(move.source, d, move.pairs)
    moves += 1
  if stopped == "balanced" and max(loads.max_surplus(), loads.stuck_max) > loads.tol:
    stopped = "stuck"
  tasks = pool.tasks()
  load_after = np.bincount(tasks.server, weights=tasks.area(), minlength=n)
  if stopped == "stuck" and moves and load_after.max() >= pool.load_before.max():
    # Stuck, its moves did not lower the busiest server (pieces of one granule too large for
    # the deficits, or ties at the maximum): they would only add an exchange.
    tasks, load_after, moves, stopped = base.sorted(), pool.load_before.copy(), 0, "no gain"
  return tasks, BalanceStats(epsilon=epsilon, moves=moves, load_before=pool.load_before,
                             load_after=load_after, stopped=stopped)


def check_epsilon(epsilon) -> None:
  """Raises ValueError unless `epsilon` is a number in [0, 10): the planner's tolerance."""
  if not isinstance(epsilon, (int, float, np.floating, np.integer)) or not 0 <= epsilon < 10:
    raise ValueError(f"epsilon: the planner's tolerance, a number in [0, 10), got {epsilon!r}")


class _Pool:
  """The pieces: the layout's (numpy arrays; a batch of short documents has ~10^5 of them, and
  turning them all into Python objects costs more than the planning) and the ones moves add
  (lists; a move retires one piece and adds up to three). Each source offers its `top_k` largest
  home pieces (`offers[s]`), drawn in order of area from its pieces not yet handed out."""

  def __init__(self, base: Tasks, n: int, comm: CommModel, top_k: int):
    self.base, self.top_k = base, top_k
    self.qb, self.kvb = comm.q_row_bytes, comm.kv_row_bytes
    self.size0 = base.size
    area = base.area()
    self.load_before = np.bincount(base.server, weights=area, minlength=n).astype(np.float64)
    self.retired: list[int] = []
    self.new = {f: [] for f in ("home", "doc", "q_lo", "q_hi", "home_off", "server")}
    lo, hi = base.q_lo.astype(np.float64), base.q_hi.astype(np.float64)
    self.lo, self.hi, self.area = lo, hi, area
    self.e_whole = area / np.maximum((hi - lo) * self.qb + hi * self.kvb, 1e-300)
    self.e_bound = _subrange_bound(lo, hi, self.qb, self.kvb, np.clip)
    # Home pieces of each source by (area descending, piece id): `handed[s]` holds the alive
    # ones already taken from that order (and the pieces a move leaves home), `nxt[s]` the next.
    self.by_area = _by_home_then_area(base.home, area)
    self.bounds = np.searchsorted(base.home[self.by_area], np.arange(n + 1)).tolist()
    self.area_sorted = area[self.by_area]
    self.chunk = 2 * top_k  # pieces handed out at a time
    self.handed: list[list[Candidate]] = [[] for _ in range(n)]
    self.offers: list[list[Candidate]] = [[] for _ in range(n)]
    rank = np.arange(base.size) - np.asarray(self.bounds)[base.home[self.by_area]]
    first = self.by_area[rank < self.chunk]
    for h, c in zip(base.home[first].tolist(), self._candidates(first)):
      self.handed[h].append(c)
    self.nxt = [min(self.bounds[s] + self.chunk, self.bounds[s + 1]) for s in range(n)]
    for s in range(n):
      self.refresh(s)

  def _candidates(self, idx):
    b = self.base
    return map(_new_candidate, zip(
        idx.tolist(), self.lo[idx].tolist(), self.hi[idx].tolist(), self.area[idx].tolist(),
        self.e_whole[idx].tolist(), b.doc[idx].tolist(), b.home_off[idx].tolist(),
        self.e_bound[idx].tolist()))

  def refresh(self, s: int) -> None:
    """offers[s] = the top_k largest home pieces of s (ties: the lower piece id)."""
    pool, top_k, end = self.handed[s], self.top_k, self.bounds[s + 1]
    order = lambda c: (-c.area, c.piece)
    pool.sort(key=order)
    while self.nxt[s] < end:
      # Pieces not yet handed out come in order: only the next one can outrank the top_k-th.
      j = self.nxt[s]
      if len(pool) >= top_k and order(pool[top_k - 1]) < (-float(self.area_sorted[j]),
                                                          int(self.by_area[j])):
        break
      idx = self.by_area[j:min(j + self.chunk, end)]
      pool.extend(self._candidates(idx))
      self.nxt[s] = j + idx.size
      pool.sort(key=order)
    self.offers[s] = pool[:top_k]

  def apply(self, move: Move, d: int) -> None:
    """Splits the moved piece [lo, hi) into [lo, x) home, [x, y) -> d, [y, hi) home."""
    s, c = move.source, move.cand
    i, lo, hi, doc, off = c.piece, int(c.lo), int(c.hi), c.doc, c.home_off
    x, y = int(move.x), int(move.y)
    new, qb, kvb = self.new, self.qb, self.kvb
    self.handed[s].remove(c)
    if i < self.size0:
      self.retired.append(i)
    else:
      new["q_hi"][i - self.size0] = new["q_lo"][i - self.size0]  # retired: dropped at the end
    for a, b, dst in ((lo, x, s), (y, hi, s), (x, y, d)):
      if b <= a:
        continue
      for f, v in (("home", s), ("doc", doc), ("q_lo", a), ("q_hi", b),
                   ("home_off", off + (a - lo)), ("server", dst)):
        new[f].append(v)
      if dst == s:
        area = (b - a) * (b + a + 1.0) / 2.0
        self.handed[s].append(_new_candidate((
            self.size0 + len(new["home"]) - 1, float(a), float(b), area,
            area / ((b - a) * qb + b * kvb), doc, off + (a - lo),
            _subrange_bound(float(a), float(b), qb, kvb, _clip))))
    self.refresh(s)

  def tasks(self) -> Tasks:
    """The layout's pieces still alive and the added ones, sorted."""
    keep = np.ones(self.size0, bool)
    keep[self.retired] = False
    added = {f: np.asarray(v, np.int64) for f, v in self.new.items()}
    live = added["q_hi"] > added["q_lo"]
    return Tasks(**{f: np.concatenate([getattr(self.base, f)[keep], added[f][live]])
                    for f in self.new}).sorted()


class _Loads:
  """Each server's load against the mean, in max-heaps (negated keys) of surplus and of deficit
  with lazy deletion: an entry is current while its version matches. With nodes, each node's
  surplus entries too. Destinations no candidate fits (stuck) leave the deficit heap."""

  def __init__(self, load_before: np.ndarray, epsilon: float, node, servers: np.ndarray | None):
    n = load_before.size
    self.load = load_before.tolist()
    takers = int(servers.sum()) if servers is not None else n
    mean = float(load_before.sum()) / takers if takers else 0.0
    self.target = [mean] * n if servers is None else np.where(servers, mean, 0.0).tolist()
    self.tol = epsilon * mean
    self.node = node
    load, target = self.load, self.target
    self.ver = [0] * n
    self.stuck = [False] * n
    self.stuck_max = 0.0  # largest deficit among stuck destinations (their loads no longer change)
    self.surplus = [(target[s] - load[s], 0, s) for s in range(n) if load[s] > target[s]]
    self.deficit = [(load[d] - target[d], 0, d) for d in range(n) if load[d] < target[d]]
    heapq.heapify(self.surplus)
    heapq.heapify(self.deficit)
    self.node_surplus = None  # one node: none, every source is local
    if node is not None:
      self.node_surplus = [[] for _ in range(max(node) + 1)]
      for entry in self.surplus:
        self.node_surplus[node[entry[2]]].append(entry)
      for h in self.node_surplus:
        heapq.heapify(h)

  def _top(self, heap):
    ver = self.ver
    while heap and heap[0][1] != ver[heap[0][2]]:
      heapq.heappop(heap)
    return heap[0] if heap else None

  def max_surplus(self) -> float:
    ts = self._top(self.surplus)
    return -ts[0] if ts else 0.0

  def next_destination(self):
    """(the server with the largest deficit, that deficit, the largest surplus), or (None, 0, 0)
    once every server is within the tolerance or no destination is left."""
    td = self._top(self.deficit)
    max_def = max(-td[0] if td else 0.0, self.stuck_max)
    max_sur = self.max_surplus()
    if (max_sur <= self.tol and max_def <= self.tol) or td is None:
      return None, 0.0, 0.0
    return td[2], -td[0], max_sur

  def source_heaps(self, d: int):
    """The surplus heaps a destination asks, in order: its node's, then all."""
    if self.node_surplus is None:
      return (self.surplus,)
    return (self.node_surplus[self.node[d]], self.surplus)

  def give_up(self, d: int, deficit: float) -> None:
    """No candidate fits `d`: it leaves the deficit heap."""
    self.stuck[d] = True
    self.stuck_max = max(self.stuck_max, deficit)
    self.ver[d] += 1

  def shift(self, s: int, d: int, pairs: float) -> None:
    self.load[s] -= pairs
    self.load[d] += pairs
    self._push(s)
    self._push(d)

  def _push(self, s: int) -> None:
    self.ver[s] += 1
    load, target, v = self.load[s], self.target[s], self.ver[s]
    if load > target:
      heapq.heappush(self.surplus, (target - load, v, s))
      if self.node_surplus is not None:
        heapq.heappush(self.node_surplus[self.node[s]], (target - load, v, s))
    elif load < target and not self.stuck[s]:
      heapq.heappush(self.deficit, (load - target, v, s))


_G, _INV_G = float(GRANULE), 1.0 / GRANULE


class _Scorer:
  """E of the best move of a given number of pairs out of a piece (`cost.optimal_split`, cut at
  the 128-row grid)."""

  def __init__(self, comm: CommModel, tol: float):
    self.k_opt = 2.0 * comm.beta / (comm.beta + 2.0)  # n_q* = sqrt(k_opt * want)
    self.qb, self.kvb, self.tol = comm.q_row_bytes, comm.kv_row_bytes, tol

  def score(self, a0: float, e0: float, cap: float):
    """(E, x, y, got) of the best move of `cap` pairs out of piece [a0, e0) (its area is larger:
    a piece that fits moves whole, with its candidate's E); E <= 0: none."""
    g, inv_g = _G, _INV_G
    want = cap
    nq = math.sqrt(self.k_opt * want)
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
    if nrow <= 0 or got > cap + max(0.5 * self.tol, g * y):
      return -1.0, x, y, got
    return got / (nrow * self.qb + y * self.kvb), x, y, got


def _choose(pool: _Pool, loads: _Loads, score, d: int, cap_d: float, max_sur: float,
            max_sources: int) -> Move | None:
  """The move to destination `d` (deficit `cap_d`; the largest surplus `max_sur`), or None if no source has a candidate that
  fits (`score`: `_Scorer.score`). The source with the largest surplus gives, its best candidate by E; the next sources
  only when it has none that fits. Draining the heaviest source first moves fewer, larger pieces
  than taking the best E over many sources, which sends a long document's pieces (and its K/V
  prefix) to server after server. With nodes, d's own node's sources come first. Allowing
  smaller local sources too would move more, smaller pieces and send a long document's prefix
  to more servers: fewer bytes across nodes in all, a busier hot spot."""
  # While some destination is outside the tolerance, any surplus source may give; once all are
  # inside, only sources outside it (so the loop ends as soon as everyone is within ε).
  floor_ = 0.0 if cap_d > loads.tol else loads.tol
  ver, offers, everyone = loads.ver, pool.offers, loads.surplus
  best = None  # (source, candidate, x, y, pairs): one Move made at the end
  best_e = 0.0
  tried = 0
  offered = set()
  for heap in loads.source_heaps(d):
    popped = []
    while heap and best is None and tried < max_sources:
      entry = heapq.heappop(heap)
      s = entry[2]
      if entry[1] != ver[s]:
        continue
      popped.append(entry)
      sur = -entry[0]
      # A source on d's node gives only a move as large as the flat rule's would be.
      if sur <= floor_ or (heap is not everyone and sur < min(cap_d, max_sur)):
        break
      if s in offered:  # tried on d's node
        continue
      offered.add(s)
      tried += 1
      cap = min(sur, cap_d)
      for c in offers[s]:
        if c.area <= cap:
          if c.e_whole > best_e:
            best_e, best = c.e_whole, (s, c, c.lo, c.hi, c.area)
          continue
        if c.e_bound <= best_e:  # no sub-range of this piece beats the best
          continue
        e, x, y, got = score(c.lo, c.hi, cap)
        if e > best_e:
          best_e, best = e, (s, c, x, y, got)
    for entry in popped:
      heapq.heappush(heap, entry)
    if best is not None:
      break
  return None if best is None else Move(*best, best_e)


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


def _servers(servers, n: int) -> np.ndarray | None:
  """`servers` checked, as bool [n] (None: every server takes work)."""
  if servers is None:
    return None
  arr = np.asarray(servers)
  if arr.shape != (n,) or arr.dtype != bool or not arr.any():
    raise ValueError(f"servers: one bool per server ({n}), not all False, got {servers!r}")
  return arr


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
