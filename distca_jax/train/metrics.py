"""Per-step accounting: model FLOPs (causal attention counted per document), MFU, and the
attention-load imbalance across devices (`gate_cost.attention_load_per_device`, `imbalance`,
which the step gate weighs too); and the trainer's binding of the gate's attention cost to the
kernel its run takes."""

from __future__ import annotations

import dataclasses

import numpy as np

from distca_jax import kernels
from distca_jax.config import ConfigError
from distca_jax.data.packing import Layout
from distca_jax.gate import gate_attention_cost
from distca_jax.models.presets import ModelShape
from distca_jax.schedule.gate_cost import attention_load_per_device, imbalance, shard_attention_area

__all__ = ["PEAK_TFLOPS", "TRAIN_MULTIPLIER", "peak_flops_per_device", "shard_attention_area",
           "attention_load_per_device", "imbalance", "with_kernel_gate_cost", "step_flops"]

# Dense bf16 peak per device (TFLOP/s, no sparsity), matched against `device.device_kind`.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "B200": 2250.0, "A100": 312.0}

# Training = forward + backward (2x forward for the matmuls and for attention); rematerialised
# recompute is not counted, as is usual for MFU.
TRAIN_MULTIPLIER = 3.0


def peak_flops_per_device(device_kind: str, override_tflops: float | None) -> float | None:
  """Peak FLOP/s of one device: the override (TFLOP/s), else the table's for its kind, or None."""
  if override_tflops is not None:
    return override_tflops * 1e12
  for name, tflops in PEAK_TFLOPS.items():
    if name in device_kind:
      return tflops * 1e12
  return None


def with_kernel_gate_cost(config, shape: ModelShape):
  """`config` (a whole `Config`) with `attention.gate_attention_cost` set to the measured cost of
  the kernel `attention.kernel` resolves to for the model's head dim and dtype on the default
  platform (the one every core attention call of the run takes, `gate.gate_attention_cost`),
  unless the config sets it. Returns (config, kernel); a named kernel that cannot run the model
  is a ConfigError."""
  a = config.attention
  try:
    kernel = kernels.resolve_backend(a.kernel, shape.head_dim, config.model.dtype)
  except ValueError as e:
    raise ConfigError(f"attention.kernel: {e}") from None
  attention = dataclasses.replace(a, gate_attention_cost=gate_attention_cost(a, kernel))
  return dataclasses.replace(config, attention=attention), kernel


def moved_rows(plans) -> dict[str, int]:
  """The rows a CAD step's plans move between devices, per layer, summed over its nano-batches:
  query rows sent to a server other than their home (`moved_q_rows`; their outputs come back)
  and K/V rows sent to the servers that need them (`moved_kv_rows`, deduplicated per server
  and document). What balancing costs, not the padded capacities the exchange is compiled at."""
  q = sum(int(np.sum(p.traffic.q_rows_out)) for p in plans)
  kv = sum(int(np.sum(p.traffic.kv_rows_out)) for p in plans)
  return {"moved_q_rows": q, "moved_kv_rows": kv}


def step_flops(shape: ModelShape, layout: Layout) -> float:
  """Model FLOPs of one training step: matmuls over every real token plus causal attention of
  every document (whole-document areas, however the documents are split)."""
  tokens = float(layout.length.sum())
  lens = layout.doc_lens.astype(np.float64)
  attn_fwd = float(np.sum(shape.attention_flops(lens, lens)))
  return TRAIN_MULTIPLIER * (shape.matmul_flops_per_token() * tokens + attn_fwd)
