"""What the kernel backends share: whether a backend's imports are installed, constants of
base-2 softmax, row padding, the backward's per-row statistics, the Pallas / Triton tile
configurations, and the backward's padded-shape wrapper.

Shapes: T query rows, S key rows, H query heads, K KV heads, D head dim; `_HxT` arrays hold one
row per query head (the kernels read a head's statistics contiguously).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .blocks import cdiv
from .tasks import TaskTable

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")


# ------------------------------------------------------------------------ Pallas / Triton tiles


class Config(NamedTuple):
  """Tile sizes (rows) and Triton launch parameters of the Pallas and Triton kernels. All block
  sizes are powers of two."""

  block_q: int = 128        # forward
  block_k: int = 64
  block_q_dq: int = 128     # dQ kernel
  block_k_dq: int = 64
  block_q_dkv: int = 64     # dK/dV kernel
  block_k_dkv: int = 128
  num_warps: int = 8
  num_stages: int = 3
  num_warps_bwd: int = 8    # dK/dV kernel (and dQ unless num_warps_dq is set)
  num_stages_bwd: int = 2
  num_warps_dq: int | None = None
  num_stages_dq: int | None = None
  # Fused backward: the dK/dV kernel also adds each tile's dQ into a float32 buffer with atomics
  # (5 matmuls per tile instead of 3 + 4 over two kernels), and the dQ kernel is not run.
  fused_bwd: bool = False
  # Triton only: the dK/dV kernel computes S^T = K Q^T (no register transposes of P and dS).
  bwd_transposed: bool = False


# Measured by launch/bench_kernels.py --tune (docs/PERFORMANCE.md, Kernels): forward 128 x 128
# tiles, 8 warps, 3 stages; backward 64 x 64 tiles, 4 warps, 2 stages (twice the backward
# throughput of 128 x 64 / 64 x 128 at 8 warps; the fused backward with atomic dQ was slower).
# Triton's transposed dK/dV step is a little faster than the untransposed one. Small tiles on CPU
# keep interpret mode cheap and exercise the multi-block paths on small test shapes.
GPU_CONFIG = Config(block_q=128, block_k=128, block_q_dq=64, block_k_dq=64, block_q_dkv=64,
                    block_k_dkv=64, num_warps=8, num_stages=3, num_warps_bwd=4, num_stages_bwd=2,
                    bwd_transposed=True)
CPU_CONFIG = Config(16, 16, 16, 16, 16, 16, 4, 1, 4, 1)
# GPU tiles per head dim (launch/bench_kernels.py --tune --head-dim D writes its best here for the
# rest of its run). A head dim not listed takes the config of the smallest listed one above it
# (or the largest listed): tiles that fit a larger head dim's registers and shared memory fit a
# smaller one's. At 256, 128's tiles ask for twice the shared memory there is, and the dK/dV
# accumulators want 8 warps.
GPU_CONFIGS: dict[int, Config] = {
    64: GPU_CONFIG._replace(block_k=64, num_warps=4, num_stages_bwd=3),
    128: GPU_CONFIG,
    256: GPU_CONFIG._replace(block_k=64, num_stages=2, num_warps_bwd=8),
}


def gpu_config(head_dim: int) -> Config:
  """The GPU tiles for `head_dim` (see GPU_CONFIGS)."""
  dims = sorted(GPU_CONFIGS)
  return GPU_CONFIGS[next((d for d in dims if d >= head_dim), dims[-1])]


def installed(backend: str) -> bool:
  """Whether what `backend` imports beyond JAX imports here: jax-triton (triton), JAX's Mosaic
  GPU Pallas (mosaic)."""
  try:
    if backend == "triton":
      import jax_triton  # noqa: F401
    elif backend == "mosaic":
      import jax.experimental.pallas.mosaic_gpu  # noqa: F401
    return True
  except Exception:  # ImportError, or jax-triton refusing this JAX
    return False


# ---------------------------------------------------------------------------------- rows


def pad_rows(x, rows):
  """`x` with zero rows appended along its first axis up to `rows`."""
  return x if x.shape[0] == rows else jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _pow2(n):
  return 1 << max(n - 1, 0).bit_length()


def padded(cfg: Config, T: int, S: int, tasks: TaskTable):
  """(T, S) rounded up to every kernel's block sizes, and the task table padded to a power-of-two
  capacity (Triton wants power-of-two block shapes, and the dK/dV kernel reads the whole table)."""
  row_q = max(cfg.block_q, cfg.block_q_dq, cfg.block_q_dkv)
  row_k = max(cfg.block_k, cfg.block_k_dq, cfg.block_k_dkv)
  C = tasks.q_start.shape[-1]
  tasks = TaskTable(*(pad_rows(jnp.asarray(a, jnp.int32), _pow2(C)) for a in tasks))
  return cdiv(T, row_q) * row_q, cdiv(S, row_k) * row_k, tasks


def row_ranges(row_lo, row_hi):
  """[2, T] int32: each row's visible key range as start and length, the length clamped at 0
  (an unsigned compare, `visible`, would read a negative one as every key)."""
  return jnp.stack([row_lo, jnp.maximum(row_hi - row_lo, 0)])


def visible(keys, lo, length):
  """lo <= keys < lo + length as one unsigned compare per element (in-kernel arrays)."""
  u32 = lambda x: lax.bitcast_convert_type(x, jnp.uint32)
  return u32(keys - lo) < u32(length)


# ---------------------------------------------------------------------------------- backward


def row_delta(do_TxHxD, o_TxHxD):
  """rowsum(dO * O) per query row and head, float32 [T, H], in a pass of its own. Left to fuse
  with the [H, T] transpose and the statistics around it, XLA read dO and O in the transposed
  order, several times slower than this pass (docs/PERFORMANCE.md, Kernels)."""
  f32 = jnp.float32
  return jax.lax.optimization_barrier(jnp.sum(do_TxHxD.astype(f32) * o_TxHxD.astype(f32), -1))


def backward_stats(do_TxHxD, o_TxHxD, lse_HxT, dlse_HxT):
  """(LSE in base 2, delta) [H, T] float32 as the backward kernels read them. The LSE cotangent
  enters as a shift of delta: dS = P * (dP - (rowsum(dO * O) - dLSE)). Rows that see nothing have
  LSE -inf; 0 keeps (-inf) - LSE from becoming NaN."""
  delta_HxT = row_delta(do_TxHxD, o_TxHxD).T - dlse_HxT
  lse2_HxT = jnp.where(jnp.isfinite(lse_HxT), lse_HxT * LOG2E, 0.0)
  return lse2_HxT, delta_HxT
