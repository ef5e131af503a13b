"""Per-step accounting: model FLOPs (causal attention counted per document), MFU, and the
attention-load imbalance across devices (`gate.attention_load_per_device`, `gate.imbalance`,
which the step gate weighs too); and the trainer's binding of the gate's attention cost to the
kernel its run takes."""

from __future__ import annotations

import dataclasses

import numpy as np

from distca_jax import kernels
from distca_jax.config import ConfigError
from distca_jax.data.packing import Layout
from distca_jax.gate import (attention_load_per_device, gate_attention_cost, imbalance,
                             shard_attention_area)
from distca_jax.models.presets import ModelShape

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


# Each transport's prefix of the exchange capacities in a CAD step's log line.
EXCHANGE_PREFIXES = {"tiled": "exchange", "shifted": "exchange_shift", "ragged": "exchange_send"}


def exchange_rows(caps, exchange: str) -> dict[str, int]:
  """A CAD step's exchange capacities for its log line, in its transport's terms (each names the
  step's compiled shape): `tiled`, rows per padded (device, server) block (`exchange_q_rows`,
  `exchange_kv_rows`); `shifted`, the rows a device sends over all shifts
  (`exchange_shift_q_rows`, ...); `ragged`, the rows of the packed send buffer
  (`exchange_send_q_rows`, ...). The relayed K/V round's key (`..._kv2_rows`) only while the
  run has that round."""
  if exchange == "tiled":
    q, kv, kv2 = caps.c, caps.ckv, caps.ckv2
  elif exchange == "shifted":
    q, kv, kv2 = sum(caps.shift_q), sum(caps.shift_kv), sum(caps.shift_kv2)
  else:
    q, kv, kv2 = caps.send_q, caps.send_kv, caps.send_kv2
  prefix = EXCHANGE_PREFIXES[exchange]
  out = {f"{prefix}_q_rows": int(q or 0), f"{prefix}_kv_rows": int(kv or 0)}
  if kv2:
    out[f"{prefix}_kv2_rows"] = int(kv2)
  return out


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
