"""The step gate's cost model: whether CAD's balancing pays for its exchange. Numpy only.

In matmul-FLOP units (`GateCosts`, fitted by `launch/fit_gate.py`):

  colocated step = matmul FLOPs + attention_cost x attention FLOPs    (the slowest device)
  CAD's saving   = attention time colocated - the slowest server's after planning
                   - (machinery + exchange_fixed) x matmul FLOPs
                   - exchange_flops_per_byte x bytes

where the bytes are the busiest device's over one step's exchanges, as its transport carries them
(`transport.Transport.carried_bytes`), bytes between nodes priced `network_byte_cost` NVLink
bytes each (`busier_link`). `predicted_cad_saving` is that as a fraction of the colocated step;
the trainer runs colocated attention on a step predicted to save less than its threshold
(`distca_jax/gate.py`). Every input is a number or a plan: the model knows no config.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distca_jax.data.packing import Layout


@dataclasses.dataclass(frozen=True)
class GateCosts:
  """The gate's fitted cost profile, in matmul-FLOP units: attention's time per FLOP relative to
  the matmuls'; CAD's fixed cost as fractions of the matmul time, its machinery (the row movers
  and the two streams, what one GPU measures with nothing to move) and the exchange's calls
  (what only several GPUs show); the exchange's cost per byte the busiest device sends and
  receives; and a byte between nodes in NVLink bytes."""

  attention_cost: float
  exchange_fixed: float
  exchange_flops_per_byte: float
  network_byte_cost: float = 4.0
  machinery: float = 0.0

  @property
  def fixed(self) -> float:
    """CAD's whole fixed cost, a fraction of the matmul time."""
    return self.machinery + self.exchange_fixed


@dataclasses.dataclass(frozen=True)
class ModelFlops:
  """What the gate needs of a model: forward matmul FLOPs per token (all layers), training FLOPs
  of core attention per query-key pair (all layers and heads), and its layers."""

  matmul_per_token: float
  attention_per_area: float
  layers: int


def shard_attention_area(layout: Layout) -> np.ndarray:
  """Causal query-key pairs of each shard (queries = the shard, keys = its document prefix)."""
  q = layout.length.astype(np.float64)
  kv = (layout.doc_offset + layout.length).astype(np.float64)
  return q * kv - q * (q - 1) / 2


def attention_load_per_device(layout: Layout) -> np.ndarray:
  """Causal attention area (query-key pairs) each buffer computes when attention is colocated."""
  return np.bincount(layout.buffer, weights=shard_attention_area(layout), minlength=layout.num_buffers)


def imbalance(load: np.ndarray) -> float:
  """max / mean; 1.0 is perfect balance."""
  mean = float(np.mean(load))
  return float(np.max(load)) / mean if mean > 0 else 1.0


def colocated_flops(model: ModelFlops, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
  """Per device, the colocated step's matmul FLOPs (3 x forward, every real token) and core
  attention FLOPs: the two terms the cost model weighs."""
  tokens = np.bincount(layout.buffer, weights=layout.length, minlength=layout.num_buffers)
  return (3.0 * model.matmul_per_token * tokens,
          model.attention_per_area * attention_load_per_device(layout))


def _colocated_step(model: ModelFlops, layout: Layout, costs: GateCosts):
  """Per device, in matmul FLOPs: the colocated step's matmul time and attention time; and the
  attention time per unit of causal area."""
  linear, attn = colocated_flops(model, layout)
  return linear, costs.attention_cost * attn, costs.attention_cost * model.attention_per_area


def predicted_cad_gain(model: ModelFlops, layout: Layout, costs: GateCosts,
                       exchange: bool = False) -> float:
  """The most balancing core attention can save, as a fraction of the colocated step: (max −
  mean of the devices' attention time) / (the slowest device's step time); balancing at best
  brings every device to the mean. `exchange`: less the exchange's fixed cost, an upper bound on
  `predicted_cad_saving` (up to the few query-key pairs a ping-pong cut drops: the suffix of the
  one document split between the halves does not attend to its prefix)."""
  linear, attn, _ = _colocated_step(model, layout, costs)
  step = (linear + attn).max()
  if step <= 0:
    return 0.0
  fixed = costs.fixed * linear.max() if exchange else 0.0
  return float((attn.max() - attn.mean() - fixed) / step)


def predicted_cad_saving(model: ModelFlops, layout: Layout, plans, costs: GateCosts,
                         exchange_bytes: np.ndarray | None = None) -> float:
  """Fraction of the colocated step CAD is predicted to save with these plans (the step's
  nano-batches, balanced), net of the exchange: (the slowest device's attention time colocated −
  the slowest server's after planning − the exchange's cost) / the colocated step. The same on
  every process (global plans only). `exchange_bytes`: per device, the bytes one layer's
  exchange sends plus receives over the step in NVLink bytes (`busier_link`); default: the rows
  the plans move. Every term is the whole model's (all heads' bytes, all matmuls): with
  mesh.tensor > 1 each device does 1/tensor of each, so the fraction is the same."""
  linear, attn, per_area = _colocated_step(model, layout, costs)
  step = (linear + attn).max()
  if step <= 0:
    return 0.0
  planned = per_area * sum(p.stats.load_after for p in plans)
  if exchange_bytes is None:
    exchange_bytes = sum(p.traffic.send + p.traffic.recv for p in plans)
  moved = np.max(exchange_bytes) * model.layers
  net = (attn.max() - planned.max() - costs.fixed * linear.max()
         - costs.exchange_flops_per_byte * moved)
  return float(net / step)


def busier_link(carried_N: np.ndarray, nodes, network_byte_cost: float) -> np.ndarray:
  """Per device, its exchange's bytes in NVLink bytes: a device's bytes within its node and
  across nodes move at once over different links, so the busier link counts, bytes across nodes
  at `network_byte_cost` each (as the simulator's exchange model). `carried_N`: each device's
  bytes, spread evenly over its peers; `nodes`: one node number per device (None: one node)."""
  n = carried_N.shape[0]
  if nodes is None or n < 2:
    return carried_N
  nodes = np.asarray(nodes)
  if nodes.shape != (n,):
    raise ValueError(f"nodes: {nodes.size} node numbers for {n} data ranks")
  _, inverse, counts = np.unique(nodes, return_inverse=True, return_counts=True)
  across = (n - counts[inverse]) / (n - 1)  # the share of each device's peers on other nodes
  return np.maximum(carried_N * (1 - across), network_byte_cost * carried_N * across)
