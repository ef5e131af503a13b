"""The WLB-LLM-style baseline in the trainer (`data.packing=wlb`): re-packed batches and their
colocated attention with per-document context parallelism (docs/METHOD.md, "The baseline").

Host side, per step: `schedule.wlb` packs the step's documents across the data ranks into
buffers of the token cap (`WlbPacking`); `repack_batch` moves the batch's tokens there, each
token keeping its document position (RoPE) and its next-token target, so the loss per token is
the in-order batch's; `wlb_context` builds each rank's task table and K/V gather index.

Device side: every rank computes attention for its own rows (colocated). A document split over a
CP group (head+tail chunks, or the in-order fallback's consecutive ones) needs K/V rows of the
group's other ranks: the group all-gathers its K and V (cp − 1 `ppermute`s inside the group,
whose transposes return dK, dV), and each rank lays the rows of each such document's prefix out
contiguously by its gather index (`WlbContext.kv_index`; the transpose of that gather sums the
gradients). Its K/V rows are then its own buffer followed by those `window` rows, and every
shard is one task over its document's whole prefix, run as colocated attention runs its tasks
(`colocated.local_task_attention`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from distca_jax import kernels
from distca_jax.colocated import local_task_attention, stream_arrays
from distca_jax.data.packing import PAD_SEGMENT, Layout, index_in_runs, ranges
from distca_jax.data.sources import Batch
from distca_jax.kernels import TaskTable
from distca_jax.schedule import wlb
from distca_jax.schedule.items import task_bucket


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["q_start", "q_len", "kv_start", "kv_len", "kv_index"],
                   meta_fields=["group", "window"])
@dataclasses.dataclass(frozen=True)
class WlbContext:
  """Per-rank task tables [N, capacity] and K/V gather index [N, max(window, 1)], int32.

  A rank attends over `C + window` K/V rows: its own buffer of C rows, then `window` rows taken
  by `kv_index` from its group's all-gathered buffers. The group's buffers are stacked by shift:
  block s (rows [s·C, (s+1)·C)) is the buffer of the rank `s` places before this one in its
  group (cyclically), block 0 its own. `group` (the CP group size; ranks r with equal r // group
  gather together) and `window` are static: part of the compiled shape.
  """

  q_start: jax.Array
  q_len: jax.Array
  kv_start: jax.Array
  kv_len: jax.Array
  kv_index: jax.Array
  group: int = 1
  window: int = 0

  # The step-context protocol the trainer reads (`attention.py`): colocated, no CAD plans.
  cad = False
  plans = ()

  def device_inputs(self, batch: Batch):
    """(the re-packed batch's per-token arrays, their spec), (this context, its spec)."""
    return (stream_arrays(batch), P("data")), (self, P("data"))


@dataclasses.dataclass(frozen=True)
class WlbShape:
  """A WLB step's compiled capacities (`StepShapes` keeps the largest per CP group size)."""

  capacity: int  # tasks per rank
  window: int  # gathered K/V rows per rank


def wlb_context(packing: wlb.WlbPacking, capacity: int | None = None,
                window: int | None = None, rows=None) -> WlbContext:
  """Host-side task tables and gather indices of a packing (`capacity`, `window`: at least
  these, several steps padded to one shape). `rows`: the ranks whose gather index to fill (a
  process's; default: all, the others' stay zero): the work follows those ranks' K/V rows, while
  the shapes and task tables, small and the same on every process, are global."""
  lay, g = packing.layout, packing.cp
  N, C = lay.num_buffers, lay.buffer_len
  counts = np.bincount(lay.buffer, minlength=N)
  cap = task_bucket(int(counts.max(initial=1)), 32)
  capacity = cap if capacity is None else max(capacity, cap)
  num_docs = lay.doc_lens.size
  shards_of = np.bincount(lay.doc, minlength=num_docs)
  local = shards_of[lay.doc] == 1  # the whole document in this one shard: own rows only
  # Per (rank, split document) the prefix it needs: up to the end of its last shard there.
  key = lay.buffer * num_docs + lay.doc
  need_key, inv = np.unique(key[~local], return_inverse=True)
  need = np.zeros(need_key.size, np.int64)
  np.maximum.at(need, inv, (lay.doc_offset + lay.length)[~local])
  need_rank, need_doc = need_key // num_docs, need_key % num_docs
  per_rank = np.bincount(need_rank, weights=need, minlength=N).astype(np.int64)
  grown = task_bucket(int(per_rank.max(initial=0)), 128) if per_rank.any() else 0
  window = grown if window is None else max(window, grown)
  region = np.cumsum(need) - need - np.repeat(np.cumsum(per_rank) - per_rank, np.bincount(
      need_rank, minlength=N))  # offset of each (rank, document) prefix in its rank's window
  # The asked ranks' prefixes, shard by shard: prefix [0, need) of a document is its shards'
  # rows in position order, cut at `need`.
  mine = np.flatnonzero(np.isin(need_rank, rows)) if rows is not None else np.arange(need.size)
  by_doc = np.lexsort((lay.doc_offset, lay.doc))
  first = np.searchsorted(lay.doc[by_doc], need_doc[mine])
  reps = shards_of[need_doc[mine]]
  entry = np.repeat(mine, reps)
  shard = by_doc[ranges(first, reps)]
  keep = lay.doc_offset[shard] < need[entry]
  entry, shard = entry[keep], shard[keep]
  size = np.minimum(lay.length[shard], need[entry] - lay.doc_offset[shard])
  src = ranges(lay.buffer[shard] * C + lay.buffer_offset[shard], size)
  rank_of_row = np.repeat(need_rank[entry], size)
  src_rank, src_row = src // C, src % C
  if (src_rank // g != rank_of_row // g).any():
    raise ValueError("wlb context: a document's shards span two CP groups")
  shift = (rank_of_row - src_rank) % g
  kv_index = np.zeros((N, max(window, 1)), np.int32)
  kv_index[rank_of_row, ranges(region[entry] + lay.doc_offset[shard], size)] = shift * C + src_row
  # Task tables: one task per shard over its document's whole prefix.
  order = np.argsort(lay.buffer, kind="stable")
  slot = np.empty(lay.num_shards, np.int64)
  slot[order] = index_in_runs(counts)
  kv_start = lay.buffer_offset.copy()  # a whole document: its own rows
  if (~local).any():
    where = np.searchsorted(need_key, key[~local])
    kv_start[~local] = C + region[where]
  arrays = {name: np.zeros((N, capacity), np.int32)
            for name in ("q_start", "q_len", "kv_start", "kv_len")}
  arrays["q_start"][lay.buffer, slot] = lay.buffer_offset
  arrays["q_len"][lay.buffer, slot] = lay.length
  arrays["kv_start"][lay.buffer, slot] = kv_start
  arrays["kv_len"][lay.buffer, slot] = lay.doc_offset + lay.length
  return WlbContext(**arrays, kv_index=kv_index, group=g if window else 1, window=window)


def repack_batch(batch: Batch, layout: Layout, rows=None) -> Batch:
  """`batch`'s documents laid out as `layout` says (same documents and lengths): every token
  keeps its document position and its next-token target, padding carries no loss. `rows`: fill
  only these buffers of the new layout (default: all; the others stay zero, never written), as
  one process of a multi-process job needs; their tokens come from wherever they sit in
  `batch`, which may itself hold only some rows (`Batch.take` reads the others from its stream).
  Raises ValueError if the layout is of other documents or `batch` is not packed in document
  order (its sources' batches are)."""
  old = batch.layout
  if not np.array_equal(old.doc_lens, layout.doc_lens):
    raise ValueError("repack_batch: the layout is of other documents")
  lens = np.asarray(old.doc_lens, np.int64)
  doc_start = np.cumsum(lens) - lens
  # In document order, the flat position of a token in `batch` is its position in the stream.
  if not np.array_equal(old.buffer * old.buffer_len + old.buffer_offset,
                        doc_start[old.doc] + old.doc_offset):
    raise ValueError("repack_batch: the batch is not packed in document order")
  N, C = layout.num_buffers, layout.buffer_len
  held = np.arange(N) if rows is None else np.unique(np.asarray(rows, np.int64))
  mine = np.isin(layout.buffer, held)
  length = layout.length[mine]
  dst = ranges(layout.buffer[mine] * C + layout.buffer_offset[mine], length)
  doc = np.repeat(layout.doc[mine], length)
  got = batch.take(doc_start[doc] + ranges(layout.doc_offset[mine], length))
  out = {"tokens": np.zeros(N * C, np.int32), "targets": np.zeros(N * C, np.int32),
         "loss_mask": np.zeros(N * C, np.float32), "positions": np.zeros(N * C, np.int32),
         "segment_ids": np.full(N * C, PAD_SEGMENT, np.int32)}
  for k in ("tokens", "targets", "loss_mask", "positions"):
    out[k][dst] = got[k]
  out["segment_ids"][dst] = doc
  return Batch(**{k: v.reshape(N, C) for k, v in out.items()}, layout=layout,
               rows=None if rows is None else held, stream=batch.stream)


def wlb_cost(model_shape, tensor_parallel: int) -> wlb.WlbCost:
  """The simulator's default price of a baseline step (`sim/config.py` HardwareConfig and
  cp_overlap), which `data.wlb_cp=auto` minimises, with the linear layers over whole buffers
  (`static`): the compiled step computes its padding rows too."""
  from distca_jax.sim.config import HardwareConfig, SimConfig

  h, s = HardwareConfig(), SimConfig()
  return wlb.wlb_cost_for_model(model_shape, tensor_parallel, linear_tflops=h.linear_tflops,
                                attention_tflops=h.attention_tflops, nvlink_gbps=h.nvlink_gbps,
                                network_gbps=h.network_gbps, gpus_per_node=h.gpus_per_node,
                                cp_overlap=s.cp_overlap, static=True)


def pack_step(data_config, doc_lens, num_ranks: int, cost: wlb.WlbCost) -> wlb.WlbPacking:
  """The step's packing as `data.wlb_cp` (a size, or `auto`: the fastest by `cost`) and
  `data.wlb_token_cap` say, which documents to split chosen by `cost` (`wlb.adaptive_pack`);
  deterministic in the documents."""
  T = data_config.tokens_per_device
  if data_config.wlb_cp != "auto" and num_ranks % int(data_config.wlb_cp):
    from distca_jax.schema import ConfigError

    raise ConfigError(f"data.wlb_cp: {data_config.wlb_cp} must divide the {num_ranks} data ranks")
  if data_config.wlb_cp == "auto":
    return wlb.best_packing(doc_lens, num_ranks, T, cost, token_cap=data_config.wlb_token_cap)
  return wlb.adaptive_pack(doc_lens, num_ranks, T, cost, cp=int(data_config.wlb_cp),
                           token_cap=data_config.wlb_token_cap)


def host_step(data_config, batch: Batch, cost: wlb.WlbCost, shapes=None, rows=None):
  """(re-packed batch, WlbContext, WlbPacking) of one step. `shapes`: the run's
  `dispatch.StepShapes`, whose capacities only grow, so steps compile rarely. `rows`: the
  re-packed buffers to fill (a process's devices'; default: all). The packing is global: it
  needs only the documents' lengths."""
  packing = pack_step(data_config, batch.layout.doc_lens, batch.layout.num_buffers, cost)
  ctx = wlb_context(packing, rows=rows)
  if shapes is not None:
    need = WlbShape(capacity=int(ctx.q_start.shape[1]), window=ctx.window)
    grown = shapes.fit(f"wlb{ctx.group}@{packing.layout.buffer_len}", need)
    if grown != need:
      ctx = wlb_context(packing, grown.capacity, grown.window, rows)
  return repack_batch(batch, packing.layout, rows), ctx, packing


def make_wlb_attention(mesh: Mesh, backend: str = "auto") -> Callable:
  """Core attention over WLB-packed buffers (`WlbContext`) under `mesh` (no pipeline axis)."""
  kernels.resolve_backend(backend)
  if mesh.shape.get("pipe", 1) != 1:
    raise ValueError("data.packing=wlb: not with mesh.pipe > 1")
  n = mesh.shape["data"]
  row_axes = tuple(a for a in ("pipe", "data") if a in mesh.shape)

  def with_group_rows(group, window, x_TxKxD, kv_index_W):
    # Block s: the buffer of the group rank s places before this one (cyclically).
    blocks = [x_TxKxD]
    for s in range(1, group):
      perm = [(r, r // group * group + (r % group + s) % group) for r in range(n)]
      blocks.append(jax.lax.ppermute(x_TxKxD, "data", perm))
    return jnp.concatenate([x_TxKxD, jnp.concatenate(blocks)[kv_index_W[:window]]])

  def core_attention(q, k, v, ctx: WlbContext):
    tasks = TaskTable(ctx.q_start, ctx.q_len, ctx.kv_start, ctx.kv_len)
    if not ctx.window:  # no document is split over ranks: each rank's own rows only
      return local_task_attention(mesh, row_axes, backend, q, k, v, tasks)
    return local_task_attention(mesh, row_axes, backend, q, k, v, tasks,
                                functools.partial(with_group_rows, ctx.group, ctx.window),
                                (ctx.kv_index,))

  return core_attention


@dataclasses.dataclass
class WlbStep:
  """The host side of one WLB step: its device context, its packing, and the attention
  imbalance (max / mean area per rank) the in-order layout of the same documents had. Follows
  the trainer's step-context protocol (`device_inputs`, `cad`, `plans`)."""

  context: WlbContext
  packing: wlb.WlbPacking
  in_order_imbalance: float
  cad = False
  plans = ()

  def device_inputs(self, batch: Batch):
    return self.context.device_inputs(batch)

  def loads(self) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: attention area (query-key pairs) and real tokens of the packing."""
    return self.packing.area, self.packing.tokens

  def imbalance(self) -> tuple[float, float]:
    """Attention max / mean over ranks: the in-order layout's, and this packing's."""
    return self.in_order_imbalance, _ratio(self.packing.area)

  def record(self) -> dict[str, float]:
    """The step's log entries: the CP group size that gathered K/V (1: none) and the max / mean
    real tokens per rank (the memory imbalance the packing traded for balanced work)."""
    return {"wlb_cp": float(self.context.group), "token_imbalance": _ratio(self.packing.tokens)}


def _ratio(x: np.ndarray) -> float:
  m = float(np.mean(x))
  return float(np.max(x)) / m if m > 0 else 1.0


def host_item(config, batch: Batch, model_shape, tensor_parallel: int, shapes=None, rows=None):
  """The training loop's host work for one `data.packing=wlb` step: (re-packed batch, its
  `WlbStep`, (attention area per rank, None)); the area is the packing's, what its step runs.
  `rows`: the re-packed buffers this process feeds (default: all)."""
  before = wlb.WlbPacking(batch.layout, batch.layout.num_buffers, 1).area
  wb, ctx, packing = host_step(config.data, batch, wlb_cost(model_shape, tensor_parallel), shapes,
                               rows)
  return wb, WlbStep(ctx, packing, _ratio(before)), (packing.area, None)
