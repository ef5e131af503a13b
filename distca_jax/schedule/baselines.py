"""Baselines the scheduler is compared with, on the same batches (issue 3, DESIGN.md §1).

Each returns a `SystemLoad`: per rank (a device of the `data` axis, i.e. one tensor-parallel
group), the attention area it computes, the tokens it holds (memory, and the linear layers'
work), and the network bytes per layer it sends / receives for attention.

* `colocated`: the packed layout as is. Each rank computes attention for its own tokens;
  documents that overflow into the next buffer need their KV prefix from the earlier ones.
* `wlb_packing` with `cp=1`: WLB-LLM-style variable-length packing. Whole documents (documents
  longer than a rank's token cap are cut into consecutive chunks) go to ranks greedily, largest
  workload first (workload = area + token_weight * tokens, WLB's α·l² + β·l), onto the least
  loaded rank whose token cap (`token_cap` × T) still has room. Balances attention, unbalances
  memory: its `tokens` show by how much.
* `wlb_packing` with `cp > 1`: the same packing over N / cp groups of cp ranks, and inside a group
  per-document context parallelism: every document is cut into 2·cp chunks and rank i takes the
  head+tail pair (i, 2cp−1−i) (constant causal cost per pair), so attention and tokens are split
  evenly inside the group; each rank all-gathers the group's K and V (and reduce-scatters dK, dV).
  The paper's baseline sweeps DP × CP and keeps the best; `cp = N` is pure per-document CP.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from distca_jax.data.packing import Layout
from distca_jax.schedule.cost import CommModel, range_area
from distca_jax.schedule.items import initial_tasks
from distca_jax.schedule.planner import traffic


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
                token_cap: float = 1.5, token_weight: float = 0.0, kernel=None) -> SystemLoad:
  """(b)/(c) Variable-length packing over num_ranks / cp groups, per-document CP of size cp inside.

  Args:
    doc_lens: the batch's document lengths (>= 1), about num_ranks * buffer_len tokens.
    cp: context-parallel group size (divides num_ranks).
    token_cap: a rank holds at most token_cap * buffer_len tokens (memory limit of the packing).
    token_weight: workload per token in area units (linear layers), for WLB's α·l² + β·l.
    kernel: optional kernel-time model; a rank's time is its group's item times / cp.
  """
  lens = np.asarray(doc_lens, np.int64).reshape(-1)
  if lens.size and lens.min() < 1:
    raise ValueError(f"wlb_packing: document lengths must be >= 1, found {int(lens.min())}")
  if cp < 1 or num_ranks % cp:
    raise ValueError(f"wlb_packing: cp = {cp} must divide num_ranks = {num_ranks}")
  if token_cap < 1:
    raise ValueError(f"wlb_packing: token_cap must be >= 1, got {token_cap}")
  groups = num_ranks // cp
  cap = int(token_cap * buffer_len * cp)
  # Documents longer than a group's cap are cut into consecutive chunks of at most cp * T.
  chunk = buffer_len * cp
  nchunk = np.maximum(1, -(-lens // chunk)) if lens.size else np.zeros(0, np.int64)
  doc = np.repeat(np.arange(lens.size), nchunk)
  k = np.arange(doc.size) - np.repeat(np.cumsum(nchunk) - nchunk, nchunk)
  lo = k * chunk
  hi = np.minimum(lo + chunk, lens[doc])
  area = range_area(lo, hi)
  tok = (hi - lo).astype(np.float64)
  work = area + token_weight * tok
  g_area = np.zeros(groups)
  g_tok = np.zeros(groups)
  g_prefix = np.zeros(groups)  # KV rows of earlier chunks that a later chunk needs
  g_ms = np.zeros(groups)
  item_ms = kernel.fwdbwd_ms(hi - lo, hi) if kernel is not None else np.zeros(area.size)
  heap = [(0.0, g) for g in range(groups)]
  # Python loop over documents (a few tens of thousands at 512 ranks): the simulator's baseline,
  # not the per-step planner.
  for i in np.argsort(-work, kind="stable").tolist():
    aside = []
    while heap:
      w, g = heapq.heappop(heap)
      if g_tok[g] + tok[i] <= cap:
        break
      aside.append((w, g))
    else:  # nobody has room: the group with the fewest tokens takes it
      w, g = min(aside, key=lambda x: g_tok[x[1]])
      aside.remove((w, g))
    g_area[g] += area[i]
    g_tok[g] += tok[i]
    g_prefix[g] += lo[i]
    g_ms[g] += item_ms[i]
    heapq.heappush(heap, (w + work[i], g))
    for x in aside:
      heapq.heappush(heap, x)
  # Per rank: an even share of its group's work (head+tail chunks balance causal cost exactly up
  # to one token per chunk pair).
  r_area = np.repeat(g_area / cp, cp)
  r_tok = np.repeat(g_tok / cp, cp)
  gathered = g_tok * (cp - 1) / cp + g_prefix / cp  # KV rows each rank receives
  r_recv = np.repeat(gathered, cp) * comm.kv_row_bytes
  return SystemLoad(name="wlb" if cp == 1 else f"wlb_cp{cp}", area=r_area, tokens=r_tok,
                    send=r_recv.copy(), recv=r_recv, cp=cp,
                    attn_ms=np.repeat(g_ms / cp, cp) if kernel is not None else None)


def per_document_cp(doc_lens, num_ranks: int, buffer_len: int, comm: CommModel,
                    kernel=None) -> SystemLoad:
  """(c) Every document split head+tail over all ranks (CP = N), KV all-gathered."""
  out = wlb_packing(doc_lens, num_ranks, buffer_len, comm, cp=num_ranks,
                    token_cap=float(num_ranks), kernel=kernel)
  return dataclasses.replace(out, name="per_doc_cp")
