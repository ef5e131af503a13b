"""Flash-attention kernels for fused batches of CA-tasks, behind one interface.

    o_TxHxD, lse_TxH = attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks, backend="auto")

`tasks` is a `TaskTable` (see `tasks.py` for its rules). Backends: `reference` (plain XLA, the
oracle), `pallas`, `triton`, `cudnn`; `auto` picks the fastest available for the platform.
"""

from __future__ import annotations

import jax

from .tasks import TaskTable, causal_area, make_task_table, row_bounds

BACKENDS = ("reference", "pallas", "triton", "cudnn")


def resolve_backend(backend: str) -> str:
  """The concrete backend `auto` stands for on the default platform."""
  if backend != "auto":
    if backend not in BACKENDS:
      raise ValueError(f"kernel backend {backend!r}: choose one of {('auto',) + BACKENDS}")
    return backend
  return "reference" if jax.default_backend() == "cpu" else "cudnn"


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
           "resolve_backend", "row_bounds"]
