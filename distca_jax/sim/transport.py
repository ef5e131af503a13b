"""The bytes CAD's exchange puts on each (device, server) link, per transport and round.

The dispatch packs every row a device sends into one buffer grouped by server and moves it with
one of two transports (`distca_jax/dispatch/exchange.py`, `attention.exchange`):

  ragged   only the rows that move travel (`traffic.traffic`'s count);
  tiled    every (device, server) pair carries the largest pair's capacity bucket
           (`traffic.traffic(tiled=True)`).

With relayed K/V (`schedule/relay.py`) the exchange has a second, sequential round: the relays
forward the K/V rows they received in the first. The simulator prices each round as its own
exchange (same transport), one after the other; the second round is padded as the dispatch
pads it, like the first (largest pair, bucketed by `items.exchange_capacity`).

Every byte count here comes from the planner's functions (`pair_rows`, `exchange_capacity`); the
only arithmetic added is laying capacities out on the pairs they pad.
"""

from __future__ import annotations

import numpy as np

from distca_jax.data.packing import Layout
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.items import Tasks, exchange_capacity
from distca_jax.schedule.traffic import kv_requests, pair_rows
from distca_jax.schedule.relay import Relay

EXCHANGES = ("ragged", "tiled")


def exchange_rounds(tasks: Tasks, layout: Layout, comm: CommModel, exchange: str,
                    relay: Relay | None = None) -> tuple[list[np.ndarray], np.ndarray]:
  """(rounds, moved_NxN): the bytes per layer of each sequential round of CAD's exchange on
  `exchange`'s transport, and of the rows that move (the ragged exchange's, all rounds summed),
  float64 [N, N] each: [d, s] is what device d sends server s (query rows with everything that
  comes back for them, and K/V rows, as `CommModel` counts them, backward included). One round,
  or two with `relay` when a shard is relayed (the second carries the relayed K/V rows). Zero
  diagonals: rows that stay do not move."""
  if exchange not in EXCHANGES:
    raise ValueError(f"exchange: one of {EXCHANGES}, got {exchange!r}")
  n = layout.num_buffers
  kv = kv_requests(tasks, layout, relay)
  q_NxN, kv1_NxN, kv2_NxN = pair_rows(tasks, layout, kv)
  qb, kvb = comm.q_row_bytes, comm.kv_row_bytes
  ragged = [q_NxN * qb + kv1_NxN * kvb, kv2_NxN * kvb]
  if exchange == "ragged":
    rounds = ragged
  else:
    off_NxN = ~np.eye(n, dtype=bool)
    cap = lambda rows: exchange_capacity(int(rows.max(initial=0)), layout.buffer_len)
    rounds = [off_NxN * (cap(q_NxN) * qb + cap(kv1_NxN) * kvb), off_NxN * (cap(kv2_NxN) * kvb)]
  return (rounds if kv2_NxN.any() else rounds[:1]), ragged[0] + ragged[1]
