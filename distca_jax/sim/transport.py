"""The bytes CAD's exchange puts on each (device, server) link, per round, as the simulator prices
them.

What each transport carries is its own (`distca_jax/schedule/transport.py`, the dispatch's
`attention.exchange`); this lays a plan's rows on the pairs and asks it. With relayed K/V
(`schedule/relay.py`) the exchange has a second, sequential round: the relays forward the K/V
rows they received in the first. The simulator prices each round as its own exchange (same
transport), one after the other.
"""

from __future__ import annotations

import numpy as np

from distca_jax.data.packing import Layout
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.items import Tasks
from distca_jax.schedule.relay import Relay
from distca_jax.schedule.traffic import kv_requests, pair_rows
from distca_jax.schedule.transport import RAGGED, Transport


def exchange_rounds(tasks: Tasks, layout: Layout, comm: CommModel, transport: Transport,
                    relay: Relay | None = None) -> tuple[list[np.ndarray], np.ndarray]:
  """(rounds, moved_NxN): the bytes per layer of each sequential round of CAD's exchange on
  `transport`, and of the rows that move (the ragged exchange's, all rounds summed), float64
  [N, N] each: [d, s] is what device d sends server s (query rows with everything that comes back
  for them, and K/V rows, as `CommModel` counts them, backward included). One round, or two with
  `relay` when a shard is relayed (the second carries the relayed K/V rows). Zero diagonals: rows
  that stay do not move."""
  q_NxN, kv1_NxN, kv2_NxN = pair_rows(tasks, layout, kv_requests(tasks, layout, relay))
  rounds = transport.rounds(q_NxN, kv1_NxN, kv2_NxN, comm, layout.buffer_len)
  moved = sum(RAGGED.rounds(q_NxN, kv1_NxN, kv2_NxN, comm, layout.buffer_len))
  return (rounds if kv2_NxN.any() else rounds[:1]), moved
