"""Per-step accounting: model FLOPs (causal attention counted per document), MFU, and the
attention-load imbalance across devices."""

from __future__ import annotations

import dataclasses

import numpy as np

from distca_jax.data.packing import Layout
from distca_jax.models.presets import ModelShape

# Dense bf16 peak per device (TFLOP/s, no sparsity), matched against `device.device_kind`.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "B200": 2250.0, "A100": 312.0}

# Training = forward + backward (2x forward for the matmuls and for attention); rematerialised
# recompute is not counted, as is usual for MFU.
TRAIN_MULTIPLIER = 3.0


def peak_flops_per_device(device_kind: str, override_tflops: float | None) -> float | None:
  if override_tflops is not None:
    return override_tflops * 1e12
  for name, tflops in PEAK_TFLOPS.items():
    if name in device_kind:
      return tflops * 1e12
  return None


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


# The gate's cost model lives in `AttentionConfig` (`gate_attention_cost`, `gate_exchange_fixed`,
# `gate_exchange_flops_per_byte`), so a cluster can carry its own fit. The defaults are a
# least-squares fit of fourteen batches measured on 4 x H100 (Llama-3-8B shape with 2 layers, 64K
# tokens per device, Triton kernel; `launch/fit_gate.py`, docs/PERFORMANCE.md "The step gate"):
# attention at 3.5x its forward FLOPs runs ~340 TF/s where the rest of the step (3x the matmul
# FLOPs, which also pays for remat, norms and the LM head) runs ~250, every fitted colocated step
# within 5% of the measured one; the exchange costs a fixed part (the ping-pong split's smaller
# matmuls, its calls) and a part per byte the busiest device moves (laying rows out on the
# servers, and the transfer ping-pong does not hide).
#
# Attention's cost depends on the kernel, so unset (`gate_attention_cost: null`, the default) it
# is the one measured for the kernel the step runs: triton's from the fit above; mosaic's that
# scaled by the two kernels' attention time per FLOP in one-device colocated training steps
# (`fit_gate.py --kernel-logs`, `gpu_session.sh kfit`; H200, Llama-3-8B shape with 2 layers,
# ProLong 64K, 39 steps each, 2026-11-29: 346 vs 425 TF/s, 0.813; an H100 before the twentieth
# session's backward fixes measured 0.832; docs/PERFORMANCE.md). Kernels not measured in training
# steps take the fit's kernel's.
GATE_FIT_KERNEL = "triton"
GATE_ATTENTION_COST = {"triton": 0.75, "mosaic": 0.61}


def gate_attention_cost(attention_config, kernel: str | None = None) -> float:
  """The gate's attention cost: `attention_config.gate_attention_cost` if set, else the one
  measured for `kernel` (a resolved backend, not `auto`), else the fit's kernel's."""
  if attention_config.gate_attention_cost is not None:
    return attention_config.gate_attention_cost
  return GATE_ATTENTION_COST.get(kernel, GATE_ATTENTION_COST[GATE_FIT_KERNEL])


def describe_gate_cost(attention_config, kernel: str) -> str:
  """Where the gate's attention cost for `kernel` comes from, for the run's log: the config, the
  kernel's measurement, or (a kernel not measured in steps) the fit's kernel's."""
  cost = gate_attention_cost(attention_config, kernel)
  if attention_config.gate_attention_cost is not None:
    return f"{cost:.3g} (attention.gate_attention_cost)"
  if kernel in GATE_ATTENTION_COST:
    return f"{cost:.3g} ({kernel} kernel, measured)"
  return f"{cost:.3g} ({GATE_FIT_KERNEL}'s: the {kernel} kernel is not measured in training steps)"


def describe_gate_nodes(attention_config) -> str:
  """The data ranks' nodes for the run's log, when there are several: "; 2 nodes (8, 8 data
  ranks), a byte between them 4 NVLink bytes"; "" on one node."""
  nodes = attention_config.gate_nodes or ()
  counts = np.bincount(nodes) if len(nodes) else np.zeros(0, int)
  counts = counts[counts > 0]
  if counts.size < 2:
    return ""
  return (f"; {counts.size} nodes ({', '.join(map(str, counts))} data ranks), a byte between "
          f"them {attention_config.gate_network_byte_cost:g} NVLink bytes")


def with_kernel_gate_cost(config, shape: ModelShape):
  """`config` (a whole `Config`) with `attention.gate_attention_cost` set to the measured cost of
  the kernel `attention.kernel` resolves to for the model's head dim and dtype on the default
  platform (the one every core attention call of the run takes), unless the config sets it.
  Returns (config, kernel); a named kernel that cannot run the model is a ConfigError."""
  from distca_jax import kernels
  from distca_jax.config import ConfigError

  a = config.attention
  try:
    kernel = kernels.resolve_backend(a.kernel, shape.head_dim, config.model.dtype)
  except ValueError as e:
    raise ConfigError(f"attention.kernel: {e}") from None
  attention = dataclasses.replace(a, gate_attention_cost=gate_attention_cost(a, kernel))
  return dataclasses.replace(config, attention=attention), kernel


def _costs(attention_config):
  if attention_config is None:
    from distca_jax.config import AttentionConfig

    attention_config = AttentionConfig()
  if attention_config.gate_attention_cost is None:  # callers that resolve no kernel: the fit's
    cost = gate_attention_cost(attention_config)
    attention_config = dataclasses.replace(attention_config, gate_attention_cost=cost)
  return attention_config


def attention_flops_per_area(shape: ModelShape) -> float:
  """Training FLOPs of core attention per query-key pair, all layers and heads (forward and
  backward: 3.5 x the forward's 4 x head_dim per pair and head)."""
  return 3.5 * 4.0 * shape.head_dim * shape.heads * shape.layers


def colocated_flops(shape: ModelShape, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
  """Per device, the colocated step's matmul FLOPs (3 x forward, every real token) and core
  attention FLOPs: the two terms the gate's cost model weighs."""
  tokens = np.bincount(layout.buffer, weights=layout.length, minlength=layout.num_buffers)
  return (3.0 * shape.matmul_flops_per_token() * tokens,
          attention_flops_per_area(shape) * attention_load_per_device(layout))


def _colocated_step(shape: ModelShape, layout: Layout, costs) -> tuple[np.ndarray, np.ndarray, float]:
  """Per device, in matmul FLOPs: the colocated step's matmul time and attention time; and the
  attention time per unit of causal area."""
  linear, attn = colocated_flops(shape, layout)
  return (linear, costs.gate_attention_cost * attn,
          costs.gate_attention_cost * attention_flops_per_area(shape))


def predicted_cad_gain(shape: ModelShape, layout: Layout, exchange: bool = False,
                       attention_config=None) -> float:
  """The most balancing core attention can save, as a fraction of the colocated step: (max −
  mean of the devices' attention time) / (the slowest device's step time), times from FLOPs
  (the gate's cost model, `attention_config.gate_*`, default: `AttentionConfig()`'s); balancing
  at best brings every device to the mean. `exchange`: less the exchange's fixed cost, an upper
  bound on `predicted_cad_saving` (up to the few query-key pairs a ping-pong cut drops: the
  suffix of the one document split between the halves does not attend to its prefix)."""
  costs = _costs(attention_config)
  linear, attn, _ = _colocated_step(shape, layout, costs)
  step = (linear + attn).max()
  if step <= 0:
    return 0.0
  fixed = costs.gate_exchange_fixed * linear.max() if exchange else 0.0
  return float((attn.max() - attn.mean() - fixed) / step)


def predicted_cad_saving(shape: ModelShape, layout: Layout, plans, attention_config=None,
                         exchange_bytes: np.ndarray | None = None) -> float:
  """Fraction of the colocated step CAD is predicted to save with these plans (the step's
  nano-batches, balanced), net of the exchange: (the slowest device's attention time colocated −
  the slowest server's after planning − the exchange's cost) / the colocated step. Times from
  FLOPs (the gate's cost model, `attention_config.gate_*`); the same on every process (global
  plans only). `exchange_bytes`: per device, the bytes one layer's exchange sends plus receives
  over the step (`dispatch.exchange_bytes`: the tiled exchange's padded blocks); default: the
  rows the plans move. Every term is the whole model's (all heads' bytes, all matmuls): with
  mesh.tensor > 1 each device does 1/tensor of each, so the fraction is the same."""
  costs = _costs(attention_config)
  linear, attn, per_area = _colocated_step(shape, layout, costs)
  step = (linear + attn).max()
  if step <= 0:
    return 0.0
  planned = per_area * sum(p.stats.load_after for p in plans)
  if exchange_bytes is None:
    exchange_bytes = sum(p.traffic.send + p.traffic.recv for p in plans)
  moved = np.max(exchange_bytes) * shape.layers
  net = (attn.max() - planned.max() - costs.gate_exchange_fixed * linear.max()
         - costs.gate_exchange_flops_per_byte * moved)
  return float(net / step)


def step_flops(shape: ModelShape, layout: Layout) -> float:
  """Model FLOPs of one training step: matmuls over every real token plus causal attention of
  every document (whole-document areas, however the documents are split)."""
  tokens = float(layout.length.sum())
  lens = layout.doc_lens.astype(np.float64)
  attn_fwd = float(np.sum(shape.attention_flops(lens, lens)))
  return TRAIN_MULTIPLIER * (shape.matmul_flops_per_token() * tokens + attn_fwd)
