"""Mosaic GPU attention (Hopper) over a fused CA-task batch: the `mosaic` backend.

The forward (`mosaic_fwd.py`) is after JAX's `attention_mgpu`, with persistent CTAs looping over
the (query tile, head) units; the backward (`mosaic_bwd.py`) computes dQ, dK and dV in one
kernel, FA3-style, with dQ reduce-added by the TMA unit. Against dense cuDNN causal attention of
equal causal area the pair's forward+backward is measured in docs/PERFORMANCE.md (Kernels), and
so is the Triton pair's; `launch/tools/ab_mosaic.py` times versions of these kernels side by
side.

Conventions as the other backends: O, natural-log LSE out; rows outside every task (LSE = -inf)
get O = 0 and zero gradients. Head dims 64 and 128 (at 256 these tiles need more shared memory
than a Hopper card has), bf16 or fp16, Hopper (wgmma, TMA). The GPU tests compare the kernels
with the float64 oracle; on the CPU a test lowers them for CUDA (layouts, transforms, barriers,
pipelines; the PTX is made on the GPU).

Shapes: T query rows, S key rows, H query heads, K KV heads, D head dim.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp

from .mosaic_bwd import backward_from_stats, unsupported
from .mosaic_fwd import forward
from .tasks import TaskTable

__all__ = ["attention", "backward_from_stats", "forward", "lowered_kernels", "unsupported"]


def lowered_kernels(stablehlo_text: str) -> tuple[int, int]:
  """(Mosaic GPU call sites, distinct kernels) in a lowered module's text: jaxlib compiles each
  distinct kernel (by its hash) once a process, so the second number is what XLA's compile pays
  for."""
  hashes = re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', stablehlo_text)
  return len(re.findall(r"custom_call @mosaic_gpu", stablehlo_text)), len(set(hashes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale):
  return forward(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale)


def _attention_fwd(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale):
  out = forward(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale)
  return out, (q_TxHxD, k_SxKxD, v_SxKxD, tasks, *out)


def _attention_bwd(scale, res, cts):
  q, k, v, tasks, o, lse = res
  do, dlse = cts
  dlse = jnp.where(jnp.isfinite(lse), dlse.astype(jnp.float32), 0.0)
  return (*backward_from_stats(q, k, v, tasks, o, lse, do, dlse, scale), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, *, scale: float | None = None):
  """O [T, H, D] in q's dtype and LSE [T, H] float32 from the Mosaic GPU forward, differentiable
  through the one-kernel backward. Hopper GPU; bf16 or fp16; head dim 64 or 128."""
  T, H, D = q_TxHxD.shape
  why = unsupported(D, q_TxHxD.dtype)
  if why:
    raise ValueError(why)
  scale = D ** -0.5 if scale is None else float(scale)
  tasks = TaskTable(*(jnp.asarray(a, jnp.int32) for a in tasks))
  return _attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale)
