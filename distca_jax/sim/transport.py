"""The bytes CAD's exchange puts on each (device, server) link, per transport and round.

The dispatch packs every row a device sends into one buffer grouped by server and moves it with
one of three transports (`distca_jax/dispatch/exchange.py`, `attention.exchange`):

  ragged   only the rows that move travel (`traffic.traffic`'s count);
  shifted  one `ppermute` per shift k that carries rows: every device d sends device d + k mod N
           that shift's capacity (the largest block of the shift, bucketed), moving or not, as
           `capacities.requirements` and `capacities.bucketed` size it;
  tiled    every (device, server) pair carries the largest pair's capacity bucket
           (`traffic.traffic(tiled=True)`).

With relayed K/V (`schedule/relay.py`) the exchange has a second, sequential round: the relays
forward the K/V rows they received in the first. The simulator prices each round as its own
exchange (same transport), one after the other; the second round is padded as the dispatch
pads it, like the first (largest pair, or largest block per shift, bucketed by
`items.exchange_capacity`).

Every byte count here comes from the planner's functions (`pair_rows`, `requirements`,
`bucketed`); the only arithmetic added is laying capacities out on the pairs they pad.
"""

from __future__ import annotations

import numpy as np

from distca_jax.data.packing import Layout
from distca_jax.schedule.capacities import bucketed, requirements
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.items import Tasks, exchange_capacity
from distca_jax.schedule.traffic import kv_requests, pair_rows
from distca_jax.schedule.relay import Relay

EXCHANGES = ("ragged", "shifted", "tiled")


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
  elif exchange == "tiled":
    off_NxN = ~np.eye(n, dtype=bool)
    cap = lambda rows: exchange_capacity(int(rows.max(initial=0)), layout.buffer_len)
    rounds = [off_NxN * (cap(q_NxN) * qb + cap(kv1_NxN) * kvb), off_NxN * (cap(kv2_NxN) * kvb)]
  else:
    caps = bucketed(requirements(tasks, layout, kv), layout.buffer_len)
    second = tuple(exchange_capacity(r, layout.buffer_len) for r in _shift_max(kv2_NxN))
    rounds = [_shifted_pairs(caps.shift_q, qb, n) + _shifted_pairs(caps.shift_kv, kvb, n),
              _shifted_pairs(second, kvb, n)]
  return (rounds if kv2_NxN.any() else rounds[:1]), ragged[0] + ragged[1]


def _shift_max(rows_NxN: np.ndarray) -> list[int]:
  """The largest block of each shift k = 1 .. N-1 (d -> d + k mod N), as `requirements` takes
  it for the first round."""
  n = rows_NxN.shape[0]
  d = np.arange(n)
  return [int(rows_NxN[d, (d + k) % n].max()) for k in range(1, n)]


def _shifted_pairs(shift_rows, row_bytes: float, n: int) -> np.ndarray:
  """[N, N] bytes of a shifted exchange: every device sends d + k its shift's capacity."""
  out = np.zeros((n, n))
  d = np.arange(n)
  for k, rows in enumerate(shift_rows, start=1):
    out[d, (d + k) % n] = rows * row_bytes
  return out
