"""Per-step accounting: model FLOPs (causal attention counted per document), MFU, and the
attention-load imbalance across devices."""

from __future__ import annotations

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


def step_flops(shape: ModelShape, layout: Layout) -> float:
  """Model FLOPs of one training step: matmuls over every real token plus causal attention of
  every document (whole-document areas, however the documents are split)."""
  tokens = float(layout.length.sum())
  lens = layout.doc_lens.astype(np.float64)
  attn_fwd = float(np.sum(shape.attention_flops(lens, lens)))
  return TRAIN_MULTIPLIER * (shape.matmul_flops_per_token() * tokens + attn_fwd)
