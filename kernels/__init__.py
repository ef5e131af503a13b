"""Flash-attention kernels for fused batches of CA-tasks, behind one interface.

    o_TxHxD, lse_TxH = attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks, backend="auto")

`tasks` is a `TaskTable` (see `tasks.py` for its rules). Backends: `reference` (plain XLA, the
oracle; any platform), `pallas` (block-sparse Pallas flash attention; GPU through the Pallas Triton
lowering, CPU in interpret mode), `triton` (the same kernels in Triton via jax-triton; GPU),
`cudnn` (cuDNN fused attention forward on packed segments, each task as prefix part + causal
square merged by LSE, with our Triton or Pallas backward; Hopper GPU); `auto` picks the fastest
measured for the platform (`FASTEST`). All return O [T, H, D] in q's dtype and LSE [T, H]
float32, and are differentiable in q, k, v (dK/dV summed over the query heads of a group and over
tasks sharing key rows); rows outside every task give O = 0, LSE = -inf and zero gradients.
"""

from __future__ import annotations

import jax

from .tasks import TaskTable, causal_area, make_task_table, row_bounds, row_owner

BACKENDS = ("reference", "pallas", "triton", "cudnn")


# Backends per platform, fastest measured forward+backward first (launch/bench_kernels.py, H100,
# Pretrain 64K batch: cudnn 417 (cuDNN forward + Triton backward), triton 411, pallas ~355 TF/s;
# docs/PERFORMANCE.md, section Kernels). `triton` leads all the same: cudnn's 0.5-1.8% is inside
# run-to-run noise and it needs Hopper and a [tasks, H, T] statistics tensor per part. `auto`
# takes the first one that is installed. On CPU only the reference is fast enough to matter
# (Pallas runs interpreted).
FASTEST = {"cpu": ("reference",), "gpu": ("triton", "cudnn", "pallas")}


def _installed(backend: str) -> bool:
  if backend != "triton":
    return True
  try:
    import jax_triton  # noqa: F401
    return True
  except Exception:  # ImportError, or jax-triton refusing this JAX
    return False


def resolve_backend(backend: str) -> str:
  """The concrete backend `auto` stands for on the default platform."""
  if backend != "auto":
    if backend not in BACKENDS:
      raise ValueError(f"kernel backend {backend!r}: choose one of {('auto',) + BACKENDS}")
    return backend
  for b in FASTEST.get(jax.default_backend(), ("reference",)):
    if _installed(b):
      return b
  return "reference"


def attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, *, backend: str = "auto",
              scale: float | None = None):
  """Causal (bottom-right, per task) GQA attention over a fused task batch -> (O, LSE)."""
  backend = resolve_backend(backend)
  if backend == "reference":
    from . import reference as impl
  elif backend == "pallas":
    from . import pallas as impl
  elif backend == "triton":
    from . import triton as impl
  else:
    from . import cudnn as impl
  return impl.attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale=scale)


__all__ = ["BACKENDS", "TaskTable", "attention", "causal_area", "make_task_table",
           "resolve_backend", "row_bounds", "row_owner"]
