"""Relayed K/V: a shard's K/V rows sent to a few of the servers that need them, which forward them.

A server with a task of document g past one of its layout shards needs that shard's K/V rows
(`planner.kv_requests`). Sent directly, a shard of a long document goes from its one holder to
every such server, which on a large mesh can be a good part of the mesh: that device then sends
many times the mean device's bytes. With a `Relay`, a shard's rows go in two rounds
(docs/METHOD.md, "The scheduler"):

1. the holder sends them to about sqrt(m) of the m servers that need them (at most `fanout`);
2. each of those forwards them to at most `fanout` others: a relay forwards only rows it received
   itself (its need covers the child's), and relays on the child's node are preferred (a node is
   `devices_per_node` consecutive devices), so rows cross the network less and fan out over the
   node's links.

sqrt(m) direct receivers make the holder's copies and each relay's about equal: the busiest
sender sends about sqrt(m) copies instead of m. More rounds would go further (about m^(1/3)
copies with three); docs/PERFORMANCE.md has the measured hot spot.

Every server still receives exactly the rows it needs, once; only who sends them changes, so the
bytes on the wire are those of the direct exchange.

Numpy and scalar Python: the loop is over the shards that three or more other servers need and
their servers, never over rows.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Relay:
  """Two-round K/V exchange: a shard goes directly to at most `fanout` servers, each of which
  forwards it to at most `fanout` more (more direct sends only where fanout·(fanout + 1) servers
  are too few, or no relay holds the rows a server needs). `devices_per_node`: consecutive devices
  that share a node's links (1: every device its own node, relays chosen without regard to it).
  """

  fanout: int
  devices_per_node: int = 8

  def __post_init__(self):
    if self.fanout < 1:
      raise ValueError(f"Relay.fanout: must be >= 1, got {self.fanout}")
    if self.devices_per_node < 1:
      raise ValueError(f"Relay.devices_per_node: must be >= 1, got {self.devices_per_node}")


def route(relay: Relay, shard: np.ndarray, src: np.ndarray, dst: np.ndarray, rows: np.ndarray,
          num_devices: int) -> np.ndarray:
  """The relay of each K/V piece (int64, -1: sent directly from `src`, or local).

  Pieces k: the layout shard they copy rows from (`shard[k]`, held by `src[k]`), the server that
  needs them (`dst[k]`) and how many of the shard's rows, from its first (`rows[k]`). The shards
  that three or more other servers need are routed one at a time, most rows first, each choosing
  relays by the rows devices send after the shards before it.
  """
  via = np.full(dst.shape, -1, np.int64)
  remote = np.flatnonzero(dst != src)
  if remote.size == 0:
    return via
  count = np.bincount(shard[remote])
  busy = remote[count[shard[remote]] >= 3]  # with two, both get the rows directly
  if busy.size == 0:
    return via
  # K/V rows each device sends directly; relaying moves rows from a holder's count to a relay's.
  load = np.bincount(src[remote], weights=rows[remote], minlength=num_devices).tolist()
  busy = busy[np.argsort(shard[busy], kind="stable")]
  starts = np.flatnonzero(np.r_[True, shard[busy][1:] != shard[busy][:-1]])
  groups = np.split(busy, starts[1:])
  total = np.add.reduceat(rows[busy], starts)
  for k in np.argsort(-total, kind="stable").tolist():
    pieces = groups[k]
    for j, r in _route_shard(relay, int(src[pieces[0]]), dst[pieces].tolist(),
                             rows[pieces].tolist(), load):
      via[pieces[j]] = r
  return via


def _route_shard(relay: Relay, holder: int, servers: list[int], rows: list[int],
                 load: list[float]) -> list[tuple[int, int]]:
  """(j, relay device) for the servers j of one shard served in round 2; the others get the rows
  directly. `load`: rows each device sends, updated for the relayed rows.

  Direct receivers: about sqrt(m) of the m servers (so the holder's sends and each relay's
  forwards are about equal), at least the m / (fanout + 1) that one round of forwarding needs,
  at most `fanout` otherwise. They are taken round-robin over nodes, the nodes with the most
  servers first, each node's server with the most rows (then the least loaded) first, so that
  as many servers as possible find a relay on their node. Each other server, most rows first,
  takes a relay that holds its rows: one below its even share of the children if any, on the
  server's node if any, the least loaded; past the share up to `fanout`; with none, it gets the
  rows directly.
  """
  f, dpn = relay.fanout, relay.devices_per_node
  m = len(servers)
  pref = sorted(range(m), key=lambda j: (-rows[j], load[servers[j]], servers[j]))
  nodes: dict[int, list[int]] = {}
  for j in pref:
    nodes.setdefault(servers[j] // dpn, []).append(j)
  by_size = sorted(nodes.values(), key=len, reverse=True)  # stable: ties keep preference order
  order = [grp[i] for i in range(len(by_size[0])) for grp in by_size if i < len(grp)]
  direct = order[:min(m, max(-(-m // (f + 1)), min(f, math.isqrt(m - 1) + 1)))]
  children = dict.fromkeys(direct, 0)
  share = -(-(m - len(direct)) // len(direct))  # children per relay when evenly spread
  out = []
  for j in pref:
    if j in children:
      continue
    best = None
    for r in direct:
      if children[r] < f and rows[r] >= rows[j]:
        # A relay past its even share only where none within it can serve; then on the node.
        key = (children[r] >= share, servers[r] // dpn != servers[j] // dpn, load[servers[r]])
        if best is None or key < best[0]:
          best = (key, r)
    if best is None:
      continue  # no relay holds its rows or has room
    r = best[1]
    children[r] += 1
    load[holder] -= rows[j]
    load[servers[r]] += rows[j]
    out.append((j, servers[r]))
  return out
