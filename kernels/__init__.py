"""Flash-attention kernels for fused batches of CA-tasks, behind one interface.

    o_TxHxD, lse_TxH = attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks, backend="auto")

`tasks` is a `TaskTable` (see `tasks.py` for its rules). Backends: `reference` (plain XLA, the
oracle; any platform), `pallas` (block-sparse Pallas flash attention; GPU through the Pallas Triton
lowering, CPU in interpret mode), `triton` (the same kernels in Triton via jax-triton; GPU),
`mosaic` (Mosaic GPU forward and one-kernel FA3-style backward; Hopper GPU, bf16/fp16, head
dim 64 or 128); `auto` picks per platform and head dim (`FASTEST`, `LEADS_AT`). All return O [T, H, D] in q's
dtype and LSE [T, H] float32, and are differentiable in q, k, v (dK/dV summed over the query
heads of a group and over tasks sharing key rows); rows outside every task give O = 0,
LSE = -inf and zero gradients.

Shapes: T query rows, S key rows, H query heads, K KV heads (H a multiple of K), D head dim.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from .common import installed
from .tasks import TaskTable, causal_area, make_task_table, row_bounds, row_owner

BACKENDS = ("reference", "pallas", "triton", "mosaic")


# Backends per platform, first choice first, by the kernels' forward+backward time against dense
# cuDNN causal attention (launch/bench_kernels.py; docs/PERFORMANCE.md, Kernels): on a GPU triton,
# mosaic (first where it runs: `LEADS_AT`), pallas.
# `auto` takes the first one that is installed and runs the call's head dim, dtype and GPU
# (`unsupported`), after putting first the backends that lead at that head dim (`LEADS_AT`). On
# CPU only the reference is fast enough to matter (Pallas runs interpreted).
FASTEST = {"cpu": ("reference",), "gpu": ("triton", "mosaic", "pallas")}
# mosaic leads at head dims 64 and 128, where it was also measured faster than triton in whole
# training steps, compile included (docs/PERFORMANCE.md, Kernels).
LEADS_AT = {"mosaic": (64, 128)}

log = logging.getLogger(__name__)


def _compute_capability() -> tuple[int, ...]:
  try:
    return tuple(int(x) for x in jax.devices()[0].compute_capability.split("."))
  except (AttributeError, ValueError):
    return (0,)


def unsupported(backend: str, head_dim: int | None = None, dtype=None, platform: str | None = None,
                compute_capability: tuple[int, ...] | None = None) -> str | None:
  """Why `backend` cannot run attention of this head dim and dtype on `platform` (default: JAX's
  default backend), or None if it can. Without head dim and dtype: whether it runs here at all."""
  platform = platform or jax.default_backend()
  if backend in ("triton", "mosaic") and platform != "gpu":
    return f"the {backend} kernel backend needs a GPU (this platform is {platform})"
  if backend == "triton" and not installed("triton"):
    return f"the {backend} kernel backend needs jax-triton, which is not installed"
  if backend == "mosaic" and not installed("mosaic"):
    return ("the mosaic kernel backend needs JAX's Mosaic GPU "
            "(jax.experimental.pallas.mosaic_gpu), which does not import with this JAX")
  if head_dim is None or dtype is None:
    return None
  dtype = jnp.dtype(dtype)
  pow2 = head_dim > 0 and head_dim & (head_dim - 1) == 0
  if backend in ("triton", "pallas") and platform == "gpu" and not pow2:
    return f"the {backend} kernels take power-of-two head dims on GPU, not {head_dim}"
  if backend == "mosaic":
    from .mosaic import unsupported as mosaic_unsupported
    why = mosaic_unsupported(head_dim, dtype)
    if why:
      return why
    cc = compute_capability or _compute_capability()
    if cc[:1] != (9,):  # wgmma is Hopper's alone: Blackwell's tensor cores take tcgen05
      return ("the mosaic kernel backend needs a Hopper GPU (its kernels use wgmma and TMA); "
              f"this one is compute capability {'.'.join(map(str, cc))}")
  return None


def auto_order(platform: str, head_dim: int | None = None) -> tuple[str, ...]:
  """The backends `auto` tries on `platform` for this head dim, first choice first."""
  order = FASTEST.get(platform, ("reference",))
  lead = tuple(b for b in order if head_dim in LEADS_AT.get(b, ()))
  return lead + tuple(b for b in order if b not in lead)


def resolve_backend(backend: str, head_dim: int | None = None, dtype=None) -> str:
  """The concrete backend for `backend` on the default platform: `auto` is the fastest measured
  one that runs this head dim and dtype (when given); a named one is refused with the reason if
  it cannot run them, or cannot run here at all."""
  if backend not in ("auto",) + BACKENDS:
    raise ValueError(f"kernel backend {backend!r}: choose one of {('auto',) + BACKENDS}")
  if backend != "auto":
    why = unsupported(backend, head_dim, dtype)
    if why:
      raise ValueError(f"kernel backend {backend!r}: {why}")
    return backend
  platform = jax.default_backend()
  for b in auto_order(platform, head_dim):
    if unsupported(b, head_dim, dtype) is None:
      return b
  if platform != "cpu":
    log.warning("kernel backend auto: no fast backend runs head dim %s, %s on %s; using the "
                "reference (dense O(T x S) attention, for small shapes only)", head_dim,
                jnp.dtype(dtype).name if dtype is not None else "?", platform)
  return "reference"


def attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, *, backend: str = "auto",
              scale: float | None = None):
  """Causal (bottom-right, per task) GQA attention over a fused task batch -> (O, LSE).
  `backend="auto"` picks per call, from this call's head dim and dtype (`resolve_backend`)."""
  backend = resolve_backend(backend, q_TxHxD.shape[-1], q_TxHxD.dtype)
  if backend == "reference":
    from . import reference as impl
  elif backend == "pallas":
    from . import pallas as impl
  elif backend == "triton":
    from . import triton as impl
  else:
    from . import mosaic as impl
  return impl.attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale=scale)


__all__ = ["BACKENDS", "TaskTable", "attention", "auto_order", "causal_area", "make_task_table",
           "resolve_backend", "row_bounds", "row_owner", "unsupported"]
