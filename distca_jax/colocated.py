"""Colocated core attention (the baseline): each device computes attention for its own tokens.

A document that started on earlier devices needs their K/V: we all-gather K and V over `data`
(per-document context parallelism, as Llama 3 does it) and keep only the window of rows before
this buffer that such a document needs. Every local shard becomes one CA-task whose KV range is
its document's whole prefix, so the same kernel interface serves every case. CAD runs it too,
for a step its gate stopped (`dispatch.exchange.make_distca_attention`). `local_task_attention`
is the shard_map that runs each device's tasks on its own rows; the WLB-style baseline
(`wlb_attention.py`) runs it too, with its own K/V gather.

Shapes: T rows per buffer, H query heads, K K/V heads, D head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from distca_jax import kernels
from distca_jax.data.packing import Layout, index_in_runs
from distca_jax.kernels import TaskTable
from distca_jax.mesh import ROW_AXES
from distca_jax.schedule.items import task_bucket


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["q_start", "q_len", "kv_start", "kv_len"], meta_fields=["window"])
@dataclasses.dataclass(frozen=True)
class ColocatedContext:
  """Per-device task tables, arrays [num_buffers, capacity] int32, sharded over `data`.

  Each device attends over `window + T` key rows: the last `window` rows of the global token
  stream before its buffer (gathered from earlier devices), then its own `T` rows. Task j of
  buffer b owns query rows [q_start, q_start + q_len) of the buffer and key rows
  [kv_start, kv_start + kv_len) of that concatenation: its document's whole prefix, which is one
  contiguous range because documents are laid out in order. `window` is static (part of the
  compiled shape), bucketed to a power of two: only a document that continues from earlier
  devices needs it, and a step without one has window 0 and no cross-device traffic.
  """

  q_start: jax.Array
  q_len: jax.Array
  kv_start: jax.Array
  kv_len: jax.Array
  window: int = 0

  KIND = "colocated"  # what `core_attention` runs for this context (attention.py's protocol)

  # The host-side step context protocol (`attention.StepContext`): colocated attention runs no
  # exchange and carries no scheduler plans; the step's one stream is the batch itself.
  cad = False
  plans = ()

  def device_inputs(self, batch):
    """(the batch's per-token arrays, their spec), (this context, its spec) for the step."""
    return (stream_arrays(batch), P("data")), (self, P("data"))


def stream_arrays(batch) -> dict[str, np.ndarray]:
  """The per-token arrays a step reads of one stream's batch (host numpy, [num_buffers, T])."""
  return {"tokens": batch.tokens, "targets": batch.targets, "loss_mask": batch.loss_mask,
          "positions": batch.positions}


def colocated_window(need: int, num_buffers: int, buffer_len: int) -> int:
  """Rows of earlier buffers a device attends over, from the longest prefix any of its first
  shards needs. Few distinct values keep recompiles rare: on up to 8 devices (a node, where the
  all-gather is cheap) any need takes the whole (N-1)*T; beyond, T times a power of two."""
  full = (num_buffers - 1) * buffer_len
  if need <= 0:
    return 0
  if num_buffers <= 8:
    return full
  return min(buffer_len * (1 << max(0, math.ceil(math.log2(need / buffer_len)))), full)


def colocated_context(layout: Layout, capacity: int | None = None, window: int | None = None,
                      group: int | None = None) -> ColocatedContext:
  """Host-side task tables for colocated attention: one task per shard of the layout.

  `group`: buffers that form one token stream (documents never cross groups; K/V of earlier
  buffers are gathered within a group). Default: all buffers. `capacity` and `window` override
  the computed ones (several layouts padded to one shape)."""
  N, T = layout.num_buffers, layout.buffer_len
  counts = np.bincount(layout.buffer, minlength=N)
  capacity = task_bucket(int(counts.max(initial=1)), minimum=32) if capacity is None else capacity
  if counts.max(initial=0) > capacity:
    raise ValueError(f"colocated tasks: a buffer holds {counts.max()} shards > capacity {capacity}")
  # Only a buffer's first shard can continue a document from earlier buffers.
  need = int(layout.doc_offset[layout.buffer_offset == 0].max(initial=0))
  if window is None:
    window = colocated_window(need, group or N, T)
  elif need > window:
    raise ValueError(f"colocated window {window} is shorter than the {need} rows a document needs")
  slot = index_in_runs(counts)
  arrays = {name: np.zeros((N, capacity), np.int32) for name in ("q_start", "q_len", "kv_start", "kv_len")}
  arrays["q_start"][layout.buffer, slot] = layout.buffer_offset
  arrays["q_len"][layout.buffer, slot] = layout.length
  arrays["kv_start"][layout.buffer, slot] = window + layout.buffer_offset - layout.doc_offset
  arrays["kv_len"][layout.buffer, slot] = layout.doc_offset + layout.length
  return ColocatedContext(**arrays, window=window)


@dataclasses.dataclass(frozen=True)
class ColocatedCapacities:
  """The compiled sizes of a colocated step: tasks per buffer and the K/V window."""

  capacity: int
  window: int


def colocated_contexts(layouts, group: int | None = None, shapes=None) -> list[ColocatedContext]:
  """Contexts of several layouts with one capacity and one window (stackable). `shapes`: a
  run's `schedule.StepShapes`, whose largest capacity and window so far they take when larger."""
  capacity = task_bucket(max(int(np.bincount(l.buffer, minlength=l.num_buffers).max(initial=1))
                             for l in layouts), minimum=32)
  N, T = layouts[0].num_buffers, layouts[0].buffer_len
  need = max(int(l.doc_offset[l.buffer_offset == 0].max(initial=0)) for l in layouts)
  window = colocated_window(need, group or N, T)
  if shapes is not None:
    fitted = shapes.fit(f"colocated@{T}", ColocatedCapacities(capacity, window))
    capacity, window = fitted.capacity, fitted.window
  return [colocated_context(l, capacity, window) for l in layouts]


def make_colocated_attention(mesh: Mesh, backend: str = "auto") -> Callable:
  """Colocated core attention under `mesh`: shard_map over (pipe, data, tensor).

  Rows (buffers) are spread over `ROW_AXES` = (pipe, data); documents never cross a pipeline
  stage's rows, so earlier rows' K/V are gathered over `data` only."""
  kernels.resolve_backend(backend)  # a bad name or platform fails here; `auto` resolves per call

  def core_attention(q, k, v, ctx: ColocatedContext):
    tasks = TaskTable(ctx.q_start, ctx.q_len, ctx.kv_start, ctx.kv_len)
    kv_rows = functools.partial(_with_prefix, ctx.window) if ctx.window else None
    return local_task_attention(mesh, ROW_AXES, backend, q, k, v, tasks, kv_rows)

  return core_attention


def _with_prefix(window: int, x_TxKxD: jax.Array) -> jax.Array:
  """[window + T, K, D]: the `window` rows of the global stream just before this buffer (zeros
  before row 0), then the buffer's own rows. Inside a shard_map over `data`."""
  T = x_TxKxD.shape[0]
  x_NTxKxD = jax.lax.all_gather(x_TxKxD, "data", axis=0, tiled=True)
  x_NTxKxD = jnp.concatenate([jnp.zeros((window,) + x_NTxKxD.shape[1:], x_NTxKxD.dtype), x_NTxKxD])
  prefix_WxKxD = jax.lax.dynamic_slice_in_dim(x_NTxKxD, jax.lax.axis_index("data") * T, window)
  return jnp.concatenate([prefix_WxKxD, x_TxKxD])


def local_task_attention(mesh: Mesh, row_axes: tuple[str, ...], backend: str, q_BxTxHxD, k_BxTxKxD,
                         v_BxTxKxD, tasks_BxC: TaskTable, kv_rows: Callable | None = None,
                         kv_args=()) -> jax.Array:
  """O [B, T, H, D]: each device runs the kernel over its own buffers' task tables, inside one
  shard_map over (`row_axes`, tensor). Colocated and WLB attention both run through it.

  Buffers (B) are sharded over `row_axes`, heads over `tensor`. `tasks_BxC`: one table row of C
  tasks per buffer; its KV ranges index the device's K/V rows, which are its own T rows, or, with
  `kv_rows`, `kv_rows(x_TxKxD, *row_args)` of its K and of its V alike (called inside the
  shard_map, so it may gather over mesh axes; the profiler's `dispatch` phase). `kv_args`: arrays
  [B, ...] sharded like the tables; `row_args` are this buffer's rows of them."""
  qkv_spec = P(row_axes, None, "tensor", None)
  row_spec = P(row_axes, None)

  def local(q_1xTxHxD, k_1xTxKxD, v_1xTxKxD, tasks_1xC, *args_1):
    k_SxKxD, v_SxKxD = k_1xTxKxD[0], v_1xTxKxD[0]
    if kv_rows is not None:
      row_args = [a[0] for a in args_1]
      with jax.named_scope("dispatch"):  # the profiler's communication phase
        k_SxKxD, v_SxKxD = kv_rows(k_SxKxD, *row_args), kv_rows(v_SxKxD, *row_args)
    tasks = TaskTable(*(a[0] for a in tasks_1xC))
    with jax.named_scope("core_attention"):
      o_TxHxD, _ = kernels.attention(q_1xTxHxD[0], k_SxKxD, v_SxKxD, tasks, backend=backend)
    return o_TxHxD[None]

  sharded = jax.shard_map(local, mesh=mesh,
                          in_specs=(qkv_spec,) * 3 + (row_spec,) * (1 + len(kv_args)),
                          out_specs=qkv_spec, check_vma=False)
  return sharded(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, tasks_BxC, *kv_args)
