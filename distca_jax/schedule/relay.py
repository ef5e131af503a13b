"""Relayed K/V: a shard many servers need is scattered in slices, and the servers pass the slices on.

A server with a task of document g past one of its layout shards needs that shard's K/V rows
(`traffic.kv_requests`). Sent directly, a shard of a long document goes from its one holder to
every such server, which on a large mesh can be a good part of the mesh: the holder sends m
copies, many times the mean device's bytes. With a `Relay` a shard that three or more other
servers need goes in two rounds (docs/METHOD.md, "The scheduler"), as a broadcast by scatter and
all-gather:

1. the holder cuts the rows they need into at most `fanout` slices and sends each slice once, to
   one of the servers that needs all of it (its relay);
2. each relay forwards its slice to the other servers that need some of it.

The holder then sends each row once instead of m times, and a slice's forwards land on its
relay: relays are chosen per slice as the server that sends the least so far among those that
need the whole slice, so the forwards spread over the servers, and a slice is relayed only if its
relay then sends less than its holder did, so relaying makes no new hot spot. Relays are chosen
without regard to nodes: a slice goes on to servers all over the mesh whichever server relays
it, and choosing relays on the node of most of a slice's servers moved no bytes off the network
(docs/PERFORMANCE.md, "Scheduler").

Every server still receives exactly the rows it needs, once; only who sends them changes, so the
bytes on the wire are those of the direct exchange. A relayed shard's pieces are split at the
slice boundaries (a piece per server and slice), which `kv_requests` returns in place of the
shard's direct pieces.

Numpy and scalar Python: the loop is over the relayed shards, their slices and servers, never
over rows.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools

import numpy as np

from distca_jax.schedule.items import GRANULE


@dataclasses.dataclass(frozen=True)
class Relay:
  """Two-round K/V exchange for shards three or more other servers need: the holder sends at
  most `fanout` slices, each once, to servers that forward them."""

  fanout: int

  def __post_init__(self):
    if self.fanout < 1:
      raise ValueError(f"Relay.fanout: must be >= 1, got {self.fanout}")


# The slices a shard is cut into where relays are on by default (`kv_relay_fanout=auto`,
# `transport.relay_for`).
AUTO_FANOUT = 8


@dataclasses.dataclass(frozen=True)
class Routed:
  """K/V pieces after routing, each a sub-range of an input piece: `parent` (the input piece it
  is cut from), `start` (its first row within the parent's), `rows`, and `via` (-1: sent by the
  parent's holder, or local; else the relay that forwards it, which received these rows, or more,
  of that shard from the holder)."""

  parent: np.ndarray
  start: np.ndarray
  rows: np.ndarray
  via: np.ndarray


def route(relay: Relay, shard: np.ndarray, src: np.ndarray, dst: np.ndarray, rows: np.ndarray,
          num_devices: int) -> Routed:
  """How each K/V piece travels. Pieces k: the layout shard they copy rows from (`shard[k]`, held
  by `src[k]`), the server that needs them (`dst[k]`) and how many of the shard's rows, from the
  first the pieces of that shard start at (`rows[k]`). Shards three or more other servers need
  are relayed one at a time, most rows first, each choosing relays by the rows devices send after
  the shards before it; the other pieces pass unchanged (whole, `via` -1)."""
  remote = np.flatnonzero(dst != src)
  count = np.bincount(shard[remote]) if remote.size else np.zeros(0, np.int64)
  busy = remote[count[shard[remote]] >= 3] if remote.size else remote
  keep = np.ones(dst.shape, bool)
  keep[busy] = False
  kept = np.flatnonzero(keep)
  out = [(kept, np.zeros(kept.size, np.int64), rows[kept], np.full(kept.size, -1, np.int64))]
  if busy.size:
    # K/V rows each device sends, starting from the direct exchange's; relaying moves them.
    load = np.bincount(src[remote], weights=rows[remote], minlength=num_devices).tolist()
    busy = busy[np.lexsort((-rows[busy], shard[busy]))]  # per shard, most rows first
    starts = np.flatnonzero(np.r_[True, shard[busy][1:] != shard[busy][:-1]])
    groups = np.split(busy, starts[1:])
    total = np.add.reduceat(rows[busy], starts)
    for k in np.argsort(-total, kind="stable").tolist():
      pieces = groups[k]
      out.append(_scatter_shard(relay, int(src[pieces[0]]), pieces, dst[pieces].tolist(),
                                rows[pieces].tolist(), load))
  parent, start, rows_, via = (np.concatenate([np.asarray(x, np.int64) for x in a])
                               for a in zip(*out))
  return Routed(parent=parent, start=start, rows=rows_, via=via)


def _scatter_shard(relay: Relay, holder: int, pieces: np.ndarray, servers: list[int],
                   rows: list[int], load: list[float]):
  """(parent, start, rows, via) of one relayed shard's pieces. `pieces`, `servers`, `rows`: its
  pieces, most rows first. `load`: rows each device sends, updated for this shard.

  The rows [0, rows[0]) are cut into at most `fanout` slices of at least GRANULE rows (at
  multiples of 8). A slice [x, y) goes once to its relay, a server that needs all of it, and from
  the relay to every other server j that needs some of it (rows [x, min(y, rows[j]))). A slice
  goes to its servers directly when fewer than three need it, or when its forwards would leave
  the relay sending as much as the holder did.
  """
  m = len(servers)
  top = rows[0]
  slices = max(1, min(relay.fanout, m, -(-top // GRANULE)))
  cuts = sorted({top * i // slices // 8 * 8 for i in range(slices)} | {top})
  # rows are sorted, most first: the servers that need row x are a prefix, found by bisection,
  # and their rows' sums by prefix sums (work per slice of the servers it goes to, not of all).
  neg = [-r for r in rows]
  prefix = list(itertools.accumulate(rows, initial=0))
  parent, start, size, via = [], [], [], []
  for x, y in zip(cuts[:-1], cuts[1:]):
    need = bisect.bisect_left(neg, -x)  # servers j < need have rows[j] > x
    whole = bisect.bisect_right(neg, -y)  # servers j < whole have rows[j] >= y
    forwards = whole * (y - x) + (prefix[need] - prefix[whole]) - (need - whole) * x - (y - x)
    r = -1 if need < 3 else _least_loaded(servers, whole, load)
    part = [y - x] * whole + [rows[j] - x for j in range(whole, need)]
    start += [x] * need
    size += part
    # Relay only where it lowers the busier of holder and relay: never a new hot spot.
    if r < 0 or load[servers[r]] + forwards >= load[holder]:
      parent += range(need)
      via += [-1] * need
      continue
    parent += [r] + [j for j in range(need) if j != r]
    size[-need:] = [part[r]] + part[:r] + part[r + 1:]
    via += [-1] + [servers[r]] * (need - 1)
    load[holder] -= forwards
    load[servers[r]] += forwards
  return pieces[np.asarray(parent, np.int64)], start, size, via


def _least_loaded(servers: list[int], k: int, load: list[float]) -> int:
  """The j < k whose server sends the least so far (ties: the lower server number; a shard's
  servers are distinct)."""
  first = servers[:k]
  return servers.index(min(zip(map(load.__getitem__, first), first))[1])
