"""Baselines the scheduler is compared with, on the same batches.

Each returns a `SystemLoad`: per rank (a device of the `data` axis, i.e. one tensor-parallel
group), the attention area it computes, the tokens it holds (memory, and the linear layers'
work), and the network bytes per layer it sends / receives for attention.

* `colocated`: the packed layout as is. Each rank computes attention for its own tokens;
  documents that overflow into the next buffer need their KV prefix from the earlier ones.
* `wlb_packing`: WLB-LLM-style variable-length packing, the trainer's own (`schedule/wlb.py`
  has the algorithm; `data.packing=wlb` runs it): documents go to ranks greedily, largest
  workload first (area + token_weight * tokens, WLB's α·l² + β·l), under a token cap
  (`token_cap` × T); with `cp > 1`, a document longer than a rank's share is split head+tail over
  a group of cp ranks, which all-gather the group's K and V (and reduce-scatter dK, dV). Balances
  attention, unbalances memory: its `tokens` show by how much. The paper's baseline sweeps
  DP × CP and keeps the best.
* `per_document_cp`: every document cut into 2·N chunks, head+tail pairs over all N ranks, priced
  ideally (each rank exactly 1/N of the attention and tokens).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distca_jax.data.packing import Layout
from distca_jax.schedule.cost import CommModel, range_area
from distca_jax.schedule.items import initial_tasks
from distca_jax.schedule.traffic import traffic
from distca_jax.schedule.wlb import WlbCost, WlbPacking, adaptive_pack, wlb_pack


@dataclasses.dataclass(frozen=True)
class SystemLoad:
  """Per-rank loads of one system on one batch. Arrays float64 [N].

  area: attention query-key pairs computed; tokens: tokens held (activation memory, linear work);
  send / recv: network bytes per layer for attention (CommModel units); cp: context-parallel size.
  """

  name: str
  area: np.ndarray
  tokens: np.ndarray
  send: np.ndarray
  recv: np.ndarray
  cp: int = 1
  attn_ms: np.ndarray | None = None  # fwd+bwd kernel ms per layer, if a kernel model was given

  @property
  def compute_imbalance(self) -> float:
    return _ratio(self.area)

  @property
  def memory_imbalance(self) -> float:
    return _ratio(self.tokens)


def _ratio(x: np.ndarray) -> float:
  m = float(np.mean(x)) if x.size else 0.0
  return float(np.max(x)) / m if m > 0 else 1.0


def colocated(layout: Layout, comm: CommModel, kernel=None) -> SystemLoad:
  """(a) No balancing: every shard's attention on its home rank.

  kernel: optional object with `fwdbwd_ms(q, kv)` (cost.AnalyticKernel or cost.TimeTable).
  """
  tasks = initial_tasks(layout)
  n = layout.num_buffers
  tr = traffic(tasks, layout, comm)
  ms = None
  if kernel is not None:
    ms = np.bincount(tasks.home, weights=kernel.fwdbwd_ms(tasks.q_len, tasks.kv_len), minlength=n)
  return SystemLoad(name="colocated",
                    area=np.bincount(tasks.home, weights=tasks.area(), minlength=n),
                    tokens=np.bincount(layout.buffer, weights=layout.length, minlength=n).astype(np.float64),
                    send=tr.send, recv=tr.recv, attn_ms=ms)


def wlb_packing(doc_lens, num_ranks: int, buffer_len: int, comm: CommModel, *, cp: int = 1,
                token_cap: float = 1.5, token_weight: float = 0.0, kernel=None,
                cost: WlbCost | None = None) -> SystemLoad:
  """(b) WLB-LLM-style packing (`wlb.wlb_pack`, the trainer's) priced per rank.

  Args:
    doc_lens: the batch's document lengths (>= 1), at most num_ranks * buffer_len tokens.
    cp: context-parallel group size (divides num_ranks); the packing may run a larger one when
      the documents do not fit the cap at this one (`SystemLoad.cp` is the size that ran).
    token_cap: a rank holds at most token_cap * buffer_len tokens (memory limit of the packing).
    token_weight: workload per token in area units (linear layers), for WLB's α·l² + β·l.
    kernel: optional kernel-time model; a rank's time is the sum over its shards.
    cost: the price of a step (`wlb.WlbCost`, the simulator's): given, the packing is
      `wlb.adaptive_pack`'s (which documents to split chosen by it; token_weight from it),
      as the trainer packs; else only documents longer than a rank's share are split.
  """
  if cost is not None:
    return wlb_load(adaptive_pack(doc_lens, num_ranks, buffer_len, cost, cp=cp,
                                  token_cap=token_cap), comm, kernel)
  return wlb_load(wlb_pack(doc_lens, num_ranks, buffer_len, cp=cp, token_cap=token_cap,
                           token_weight=token_weight), comm, kernel)


def wlb_load(packing: WlbPacking, comm: CommModel, kernel=None) -> SystemLoad:
  """Per-rank loads of a WLB packing: its shards' attention, its tokens, and the K/V rows each
  rank of a gathering group receives (`WlbPacking.gathered_rows`), sent as much as received."""
  lay = packing.layout
  recv = packing.gathered_rows() * comm.kv_row_bytes
  ms = None
  if kernel is not None:
    ms = np.bincount(lay.buffer, weights=kernel.fwdbwd_ms(lay.length, lay.doc_offset + lay.length),
                     minlength=lay.num_buffers)
  return SystemLoad(name="wlb" if packing.cp == 1 else f"wlb_cp{packing.cp}", area=packing.area,
                    tokens=packing.tokens, send=recv.copy(), recv=recv, cp=packing.cp, attn_ms=ms)


def per_document_cp(doc_lens, num_ranks: int, buffer_len: int, comm: CommModel,
                    kernel=None) -> SystemLoad:
  """(c) Every document split head+tail over all ranks (CP = N), KV all-gathered; priced ideally:
  each rank computes exactly 1/N of every document's attention and holds 1/N of its tokens."""
  lens = np.asarray(doc_lens, np.int64).reshape(-1)
  if lens.size and lens.min() < 1:
    raise ValueError(f"per_document_cp: document lengths must be >= 1, found {int(lens.min())}")
  n = num_ranks
  tok = np.full(n, lens.sum() / n)
  recv = np.full(n, lens.sum() * (n - 1) / n * comm.kv_row_bytes)
  ms = None if kernel is None else np.full(n, np.sum(kernel.fwdbwd_ms(lens, lens)) / n)
  return SystemLoad(name="per_doc_cp", area=np.full(n, range_area(0, lens).sum() / n), tokens=tok,
                    send=recv.copy(), recv=recv, cp=n, attn_ms=ms)
