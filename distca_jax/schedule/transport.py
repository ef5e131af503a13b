"""CAD's exchange transports as values: what each carries, what it costs, how it logs. Numpy only.

The dispatch packs every row a device sends into one buffer grouped by server and moves it with
one transport (`attention.exchange`, and the simulator's `exchange`):

  tiled   every (device, server) pair carries one block padded to the largest pair's rows, one
          `all_to_all` (CPU and GPU). The padding grows with the pool: cheap within a node,
          where it crosses NVLink and hides under compute, the collapse of CAD across nodes.
  ragged  only the rows that move travel, one `ragged_all_to_all` (GPU only): the transport for
          clusters.

`TILED` and `RAGGED` are the one place that says so: which capacities each uses, the bytes each
round carries, whether relayed K/V applies, its step-log fields. The gate's cost model
(`schedule/gate_cost.py`), the simulator, the metrics, the benchmarks and the device side
(`dispatch/exchange.py`, keyed by these objects) ask them; `choose` resolves `auto`.

With relayed K/V (`schedule/relay.py`) the exchange has a second, sequential round: the relays
forward the K/V rows they received in the first. Each round is padded as the first is.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distca_jax.schedule.capacities import Capacities
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.items import exchange_capacity
from distca_jax.schedule.relay import AUTO_FANOUT, Relay


@dataclasses.dataclass(frozen=True)
class Transport:
  """One transport of the exchange. `name`: its `attention.exchange` value; `carries`: what
  travels, in a phrase (logs, `--help`-level notes); `padded`: every (device, server) pair
  carries a whole block at the step's capacities; `needs_gpu`: it runs on GPUs only;
  `relays_across_nodes`: `kv_relay_fanout=auto` relays K/V where the servers span nodes;
  `log_prefix`: its step-log fields' prefix (`<prefix>_q_rows`, `_kv_rows`, `_kv2_rows`)."""

  name: str
  carries: str
  padded: bool
  needs_gpu: bool
  relays_across_nodes: bool
  log_prefix: str

  def capacities(self, caps: Capacities) -> Capacities:
    """Only the sizes this transport uses (the packed buffers always); the others zeroed so they
    never grow the run's shapes (each distinct value compiles the step)."""
    raise NotImplementedError

  def log_rows(self, caps: Capacities) -> dict[str, int]:
    """A CAD step's exchange capacities for its log line, in this transport's terms (each names
    the step's compiled shape); the relayed round's key only while the run has that round."""
    q, kv, kv2 = self._logged(caps)
    out = {f"{self.log_prefix}_q_rows": int(q or 0), f"{self.log_prefix}_kv_rows": int(kv or 0)}
    if kv2:
      out[f"{self.log_prefix}_kv2_rows"] = int(kv2)
    return out

  def _logged(self, caps: Capacities) -> tuple:
    raise NotImplementedError

  def rounds(self, q_NxN, kv_NxN, kv2_NxN, comm: CommModel, buffer_len: int) -> list[np.ndarray]:
    """Bytes per layer each (device, server) pair carries in each sequential round, [N, N]
    float64 ([d, s]: d -> s, zero diagonal), for one plan whose pairs move these query, K/V
    and relayed K/V rows (`traffic.pair_rows`); blocks bucketed as the dispatch buckets them."""
    raise NotImplementedError

  def carried_bytes(self, caps: Capacities, moved_N: np.ndarray, comm: CommModel,
                    plans: int) -> np.ndarray:
    """Per device, the bytes one layer's exchange sends plus receives over `plans` plans at the
    step's capacities `caps`; `moved_N`: the same for the rows the plans move (their traffic,
    relays included)."""
    raise NotImplementedError

  def pool_note(self, servers: int) -> str:
    """A warning for the run's log where this transport over `servers` attention servers costs
    more than balancing gains ("" where it does not)."""
    return ""


@dataclasses.dataclass(frozen=True)
class _Tiled(Transport):

  def capacities(self, caps: Capacities) -> Capacities:
    return caps

  def _logged(self, caps):
    return caps.c, caps.ckv, caps.ckv2

  def pair_bytes(self, caps: Capacities, comm: CommModel) -> tuple[float, float]:
    """Bytes one (device, server) block carries in round 1 (query and K/V rows) and round 2
    (relayed K/V rows) at `caps`' block sizes (`c`, `ckv`, `ckv2`)."""
    return (caps.c * comm.q_row_bytes + caps.ckv * comm.kv_row_bytes,
            (caps.ckv2 or 0) * comm.kv_row_bytes)

  def rounds(self, q_NxN, kv_NxN, kv2_NxN, comm, buffer_len):
    block = lambda rows: exchange_capacity(int(rows.max(initial=0)), buffer_len)
    caps = Capacities(c=block(q_NxN), ckv=block(kv_NxN), ckv2=block(kv2_NxN))
    off_NxN = ~np.eye(q_NxN.shape[0], dtype=bool)
    return [off_NxN * b for b in self.pair_bytes(caps, comm)]

  def carried_bytes(self, caps, moved_N, comm, plans):
    n = moved_N.shape[0]
    return np.full(n, 2.0 * (n - 1) * plans * sum(self.pair_bytes(caps, comm)))

  def pool_note(self, servers):
    if servers <= TILED_POOL_LIMIT:
      return ""
    return (f"attention.exchange=tiled over {servers} attention servers: every (device, server) "
            f"pair is padded to the largest one's rows, bytes that grow with the pool and cost more "
            f"than balancing gains beyond about {TILED_POOL_LIMIT} servers, so the gate keeps most "
            "steps colocated; attention.exchange=ragged (GPU) sends only the rows that move "
            "(docs/PERFORMANCE.md, \"Dispatch at scale\")")


@dataclasses.dataclass(frozen=True)
class _Ragged(Transport):

  def capacities(self, caps: Capacities) -> Capacities:
    return dataclasses.replace(caps, c=0, ckv=0, ckv2=0)

  def _logged(self, caps):
    return caps.send_q, caps.send_kv, caps.send_kv2

  def rounds(self, q_NxN, kv_NxN, kv2_NxN, comm, buffer_len):
    return [q_NxN * comm.q_row_bytes + kv_NxN * comm.kv_row_bytes, kv2_NxN * comm.kv_row_bytes]

  def carried_bytes(self, caps, moved_N, comm, plans):
    return np.asarray(moved_N, np.float64)


TILED = _Tiled(name="tiled", carries="every (device, server) pair padded to the largest pair's "
               "block", padded=True, needs_gpu=False, relays_across_nodes=False, log_prefix="exchange")
# On `tiled` a relay's second round pads every pair to its largest forward and costs more than it
# saves (docs/METHOD.md, "The scheduler"); on `ragged` it spreads a long document's K/V.
RAGGED = _Ragged(name="ragged", carries="only the rows that move", padded=False, needs_gpu=True,
                 relays_across_nodes=True, log_prefix="exchange_send")
TRANSPORTS: dict[str, Transport] = {t.name: t for t in (TILED, RAGGED)}

# Data ranks from which tiled's padding stops hiding under compute and outgrows what balancing
# gains (docs/SIMULATOR.md: hidden at 8 ranks, exposed at 32; docs/PERFORMANCE.md, "Dispatch at
# scale": 14x the rows at 8): one node's. The run's log warns beyond it.
TILED_POOL_LIMIT = 8


def named(name: str) -> Transport:
  """The transport called `name` (`tiled`, `ragged`); `auto` is `choose`'s."""
  if name not in TRANSPORTS:
    raise ValueError(f"exchange: one of {sorted(TRANSPORTS)}, got {name!r}")
  return TRANSPORTS[name]


def node_count(nodes) -> int:
  """How many nodes `nodes` (one node number per data rank; None: unknown, one) spans."""
  return 1 if nodes is None else len(set(np.asarray(nodes).tolist()))


def choose(name: str, nodes, platform: str | None = None) -> tuple[Transport, str]:
  """(transport, why) for an `exchange` setting: a named one as it is; `auto`, `tiled` while the
  data ranks fit one node (`nodes`, one node number per data rank; None: one node), `ragged`
  across nodes, where tiled's padding outgrows what balancing gains (docs/SIMULATOR.md), but
  `tiled` on a `platform` other than a GPU, where ragged does not run."""
  if name != "auto":
    return named(name), f"attention.exchange={name}"
  count = node_count(nodes)
  if count == 1:
    return TILED, ("attention.exchange=auto: tiled, the data ranks fit one node (the padded "
                   "blocks cross NVLink)")
  if platform not in (None, "gpu"):
    return TILED, (f"attention.exchange=auto: tiled, the data ranks span {count} nodes but "
                   f"ragged needs GPUs (this platform is {platform})")
  return RAGGED, (f"attention.exchange=auto: ragged, the data ranks span {count} nodes (tiled's "
                  "padded blocks grow with the pool)")


def relay_for(fanout: int | str, transport: Transport, nodes) -> Relay | None:
  """The relay a `kv_relay_fanout` setting asks for (None: off): a number (0: off), or "auto":
  `AUTO_FANOUT` slices when the servers span more than one node (`nodes`, one entry per server;
  None: one node) and the transport relays across nodes. Within a node a shard's copies are at
  most the node's size and cross NVLink."""
  if fanout != "auto":
    return Relay(int(fanout)) if fanout else None
  return Relay(AUTO_FANOUT) if node_count(nodes) > 1 and transport.relays_across_nodes else None
