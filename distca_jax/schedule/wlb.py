"""WLB-LLM-style packing: the baseline CAD is measured against (docs/METHOD.md, "The baseline").

One step's documents are re-packed across the `N` data ranks into buffers of `cap` tokens (the
token cap, a real limit: it is the compiled buffers' length), greedily by workload
`area + token_weight · tokens` (WLB-LLM's α·l² + β·l), so ranks hold unequal token counts but
near-equal attention + linear work. The ranks form `N / cp` context-parallel groups of `cp`
consecutive ranks; a document longer than a rank's share (by default: whose workload exceeds a
rank's share of the step's, or that exceeds the cap; `adaptive_pack` also tries every document)
is split over one group with per-document context parallelism: cut into `2·cp` chunks, rank i of
the group takes the head+tail pair (i, 2cp−1−i) (equal causal cost per pair), and every rank of
the group all-gathers the group's K/V. `cp = 1`: whole documents only.

This is the one packing code of the baseline: the trainer runs it (`data.packing=wlb`,
`distca_jax/wlb_attention.py`) and the simulator's `wlb` / `wlb_best` rows price it
(`baselines.wlb_packing`), so the simulated and the trained baseline cannot drift apart.

Re-packing instead of truncation: when the workload-greedy placement leaves a document without
room under the cap, the same CP size is tried placing by free tokens (worst fit), then the next
larger CP size (the next divisor of N), and last the in-order layout of `data/packing.pack`
(every rank its nominal tokens; a document that overflows a rank continues on the next, with one
group of all N ranks). `WlbPacking.cp` is the group size that ran, `repacked` why it differs.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np

from distca_jax.data.packing import Layout, pack
from distca_jax.schedule.cost import range_area


def wlb_buffer_len(tokens_per_rank: int, token_cap: float) -> int:
  """A rank's buffer length under the cap: `token_cap × tokens_per_rank`, rounded up to the
  128-token attention tile when the nominal length is a multiple of it."""
  if token_cap < 1:
    raise ValueError(f"wlb: token_cap must be >= 1 (a rank must hold its share), got {token_cap}")
  cap = int(math.ceil(token_cap * tokens_per_rank - 1e-9))
  return -(-cap // 128) * 128 if tokens_per_rank % 128 == 0 else cap


@dataclasses.dataclass(frozen=True)
class WlbPacking:
  """One step's documents packed across ranks.

  layout: `num_ranks` buffers of `cap` tokens; shards in (buffer, buffer_offset) order, NOT in
    document order (a CP document's head and tail chunks sit side by side in one buffer).
  cp: context-parallel group size that ran (groups are consecutive ranks); each rank of a group
    with a split document all-gathers its group's K/V.
  requested_cp: the size asked for; `repacked`: "" or why the packing differs from a plain
    workload-greedy one at that size ("worst-fit", "cp=4", "in-order").
  """

  layout: Layout
  cp: int
  requested_cp: int
  repacked: str = ""

  @property
  def tokens(self) -> np.ndarray:
    """Real tokens per rank, float64 [N]."""
    lay = self.layout
    return np.bincount(lay.buffer, weights=lay.length, minlength=lay.num_buffers).astype(np.float64)

  @property
  def area(self) -> np.ndarray:
    """Causal attention area (query-key pairs) per rank, float64 [N]."""
    lay = self.layout
    a = range_area(lay.doc_offset, lay.doc_offset + lay.length)
    return np.bincount(lay.buffer, weights=a, minlength=lay.num_buffers)

  def exchanging_groups(self) -> np.ndarray:
    """bool [N / cp]: groups holding a document split over more than one rank (they gather)."""
    lay, g = self.layout, self.cp
    split = np.zeros(lay.doc_lens.size, bool)
    first = np.full(lay.doc_lens.size, -1)
    first[lay.doc] = lay.buffer  # any one buffer of each document
    split[lay.doc[lay.buffer != first[lay.doc]]] = True
    out = np.zeros(lay.num_buffers // g, bool)
    out[lay.buffer[split[lay.doc]] // g] = True
    return out

  def gathered_rows(self) -> np.ndarray:
    """Per rank, the K/V rows it receives per layer: the real tokens of the other ranks of its
    group when the group all-gathers (a split document in it), else 0. float64 [N]."""
    tok, g = self.tokens, self.cp
    group_tok = np.repeat(tok.reshape(-1, g).sum(1), g)
    return np.where(np.repeat(self.exchanging_groups(), g), group_tok - tok, 0.0)


def cp_chunks(length: int, cp: int) -> list[list[tuple[int, int]]]:
  """Per group rank i, the document ranges [(lo, hi), ...] of its head+tail pair (i, 2cp−1−i)
  of a document of `length` cut into 2·cp near-equal chunks (empty chunks left out)."""
  b = [(j * length) // (2 * cp) for j in range(2 * cp + 1)]
  out = []
  for i in range(cp):
    pair = [(b[i], b[i + 1]), (b[2 * cp - 1 - i], b[2 * cp - i])]
    out.append([(lo, hi) for lo, hi in pair if hi > lo])
  return out


def _greedy(lens, n: int, cap: int, cp: int, split_min: int | None, token_weight: float,
            worst_fit: bool):
  """Pieces per rank [(doc, lo, hi), ...], or None when a document finds no room."""
  work = range_area(0, lens) + token_weight * lens
  order = np.argsort(-work, kind="stable")
  load = np.zeros(n)
  tok = np.zeros(n, np.int64)
  pieces = [[] for _ in range(n)]
  if split_min is None:  # a rank's share of the step's work, or more tokens than fit a rank
    is_cp = (work > work.sum() / n) | (lens > cap)
  else:
    is_cp = lens > split_min
  is_cp &= cp > 1
  # Split documents are the longest, so they come first in workload order: place them group by
  # group (a group takes the document where its most loaded rank ends least loaded).
  for d in order[is_cp[order]].tolist():
    chunks = cp_chunks(int(lens[d]), cp)
    c_tok = np.array([sum(hi - lo for lo, hi in c) for c in chunks])
    c_area = np.array([sum(range_area(lo, hi) for lo, hi in c) for c in chunks])
    c_work = c_area + token_weight * c_tok
    tok_g, load_g = tok.reshape(-1, cp), load.reshape(-1, cp)
    fits = ((tok_g + c_tok) <= cap).all(1)
    if not fits.any():
      return None
    key = (cap - (tok_g + c_tok)).min(1) if worst_fit else -(load_g + c_work).max(1)
    g = int(np.argmax(np.where(fits, key, -np.inf)))
    for i, c in enumerate(chunks):
      r = g * cp + i
      pieces[r] += [(d, lo, hi) for lo, hi in c]
      tok[r] += c_tok[i]
      load[r] += c_work[i]
  # Whole documents: the least loaded rank with room (worst fit: the one with the most room).
  heap = [(-(cap - int(tok[r])) if worst_fit else load[r], r) for r in range(n)]
  heapq.heapify(heap)
  for d in order[~is_cp[order]].tolist():
    L = int(lens[d])
    aside = []
    while heap:
      key, r = heapq.heappop(heap)
      if tok[r] + L <= cap:
        break
      aside.append((key, r))
    else:
      return None
    pieces[r].append((d, 0, L))
    tok[r] += L
    load[r] += work[d]
    heapq.heappush(heap, (-(cap - int(tok[r])) if worst_fit else load[r], r))
    for x in aside:
      heapq.heappush(heap, x)
  return pieces


def _layout(pieces, lens, n: int, cap: int) -> Layout:
  buf, boff, doc, doff, length = [], [], [], [], []
  for r, ps in enumerate(pieces):
    off = 0
    for d, lo, hi in ps:
      buf.append(r), boff.append(off), doc.append(d), doff.append(lo), length.append(hi - lo)
      off += hi - lo
  i64 = lambda x: np.asarray(x, np.int64)
  return Layout(num_buffers=n, buffer_len=cap, doc_lens=lens, buffer=i64(buf),
                buffer_offset=i64(boff), doc=i64(doc), doc_offset=i64(doff), length=i64(length))


def cp_sizes(num_ranks: int) -> list[int]:
  """The CP group sizes a packing may use: the powers of two dividing `num_ranks`, and N."""
  out = [c for c in (1 << k for k in range(num_ranks.bit_length())) if num_ranks % c == 0]
  return sorted(set(out) | {num_ranks})


def wlb_pack(doc_lens, num_ranks: int, tokens_per_rank: int, *, cp: int = 1,
             token_cap: float = 1.5, token_weight: float = 0.0,
             split_min: int | None = None) -> WlbPacking:
  """Packs one step's documents across `num_ranks` ranks (module docstring).

  Args:
    doc_lens: the step's document lengths (>= 1), at most num_ranks * tokens_per_rank tokens.
    tokens_per_rank: the nominal tokens per rank (T); buffers hold `wlb_buffer_len(T, cap)`.
    cp: context-parallel group size (divides num_ranks).
    token_cap: a rank holds at most token_cap × T tokens (rounded up to 128).
    token_weight: workload per token in area units (the linear layers), WLB's β / α.
    split_min: documents longer than this are split over a CP group (cp > 1); default (None):
      those whose workload exceeds a rank's share of the step's (total / N), or that exceed the
      cap (0: every document, per-document CP of the whole batch).
  """
  lens = np.asarray(doc_lens, np.int64).reshape(-1)
  n, t = num_ranks, tokens_per_rank
  if lens.size and lens.min() < 1:
    raise ValueError(f"wlb_packing: document lengths must be >= 1, found {int(lens.min())}")
  if cp < 1 or n % cp:
    raise ValueError(f"wlb_packing: cp = {cp} must divide num_ranks = {n}")
  if int(lens.sum()) > n * t:
    raise ValueError(f"wlb_packing: {int(lens.sum())} tokens exceed {n} ranks x {t}")
  cap = wlb_buffer_len(t, token_cap)
  for size in [cp] + [c for c in cp_sizes(n) if c > cp and c % cp == 0]:
    for worst_fit in (False, True):
      pieces = _greedy(lens, n, cap, size, split_min, token_weight, worst_fit)
      if pieces is not None:
        why = [f"cp={size}"] if size != cp else []
        why = ",".join(why + (["worst-fit"] if worst_fit else []))
        return WlbPacking(_layout(pieces, lens, n, cap), size, cp, why)
  # Always fits: every rank its nominal T tokens in order, documents continuing across ranks.
  lay = pack(lens, n, t)
  return WlbPacking(dataclasses.replace(lay, buffer_len=cap), n, cp, "in-order")


# ------------------------------------------------------------------------------ cost model


@dataclasses.dataclass(frozen=True)
class WlbCost:
  """Per-layer time of a packing as the simulator prices a baseline (`sim/engine.py`
  `_baseline`): per rank, linear work `tokens × lin_ms_per_token` plus the kernel's attention
  time of its shards, plus its K/V all-gather (`gathered_rows × kv_row_bytes` over NVLink when
  the group fits in a node of `gpus_per_node` GPUs at `tensor_parallel` GPUs per rank, else the
  network) of which `cp_overlap` hides under compute; the slowest rank sets the time.

  kernel: an object with `fwdbwd_ms(q, kv)` (`cost.AnalyticKernel` or `cost.TimeTable`).
  static: every rank's linear work is its whole buffer (`cap` rows, padding included), as in a
    compiled step of static shapes (the trainer's); else its real tokens, as in variable-length
    training (WLB-LLM's, the simulator's rows). Under static shapes a rank's spare room costs
    as much as tokens, so a tight cap is the strong baseline there.
  """

  lin_ms_per_token: float
  kernel: object
  kv_row_bytes: float
  nvlink_gbps: float
  network_gbps: float
  gpus_per_node: int
  tensor_parallel: int
  cp_overlap: float
  static: bool = False

  @property
  def token_weight(self) -> float:
    """Linear work per token in attention-area units (WLB's β / α), from a 4K-token task."""
    per_area = float(self.kernel.fwdbwd_ms(4096, 4096)) / float(4096 * 4097 / 2)
    return self.lin_ms_per_token / max(per_area, 1e-30)

  def attn_ms(self, packing: WlbPacking) -> np.ndarray:
    lay = packing.layout
    ms = self.kernel.fwdbwd_ms(lay.length, lay.doc_offset + lay.length)
    return np.bincount(lay.buffer, weights=ms, minlength=lay.num_buffers)

  def comm_ms(self, packing: WlbPacking) -> np.ndarray:
    same_node = packing.cp * self.tensor_parallel <= self.gpus_per_node
    gbps = self.nvlink_gbps if same_node else self.network_gbps
    return packing.gathered_rows() * self.kv_row_bytes / (gbps * 1e6)

  def rank_ms(self, packing: WlbPacking) -> np.ndarray:
    """Per rank ms per layer: compute plus the K/V all-gather compute does not hide."""
    rows = np.full(packing.layout.num_buffers, float(packing.layout.buffer_len))
    tokens = rows if self.static else packing.tokens
    compute = tokens * self.lin_ms_per_token + self.attn_ms(packing)
    comm = self.comm_ms(packing)
    overlap = 0.0 if packing.cp == 1 else self.cp_overlap
    return compute + comm - overlap * np.minimum(comm, compute)

  def step_ms(self, packing: WlbPacking) -> float:
    return float(self.rank_ms(packing).max())


def adaptive_pack(doc_lens, num_ranks: int, tokens_per_rank: int, cost: WlbCost, *, cp: int,
                  token_cap: float = 1.5) -> WlbPacking:
  """At CP size `cp`, the packing `cost` prices faster of two: only the documents longer than a
  rank's share split over a group, or every document (WLB-LLM chooses per batch between
  per-sequence and per-document sharding the same way; splitting short documents balances
  finer but gathers more K/V and cuts kernel tiles). The first of equals: fewer splits. Under
  a `static` cost, where every rank computes its whole buffer, balancing attention alone
  (token weight 0) is tried too."""
  best, best_ms = None, math.inf
  weights = (cost.token_weight, 0.0) if cost.static else (cost.token_weight,)
  for split_min in ((None, 0) if cp > 1 else (None,)):
    for token_weight in weights:
      p = wlb_pack(doc_lens, num_ranks, tokens_per_rank, cp=cp, token_cap=token_cap,
                   token_weight=token_weight, split_min=split_min)
      ms = cost.step_ms(p)
      if ms < best_ms:
        best, best_ms = p, ms
  return best


def best_packing(doc_lens, num_ranks: int, tokens_per_rank: int, cost: WlbCost, *,
                 token_cap: float = 1.5, sizes=None) -> WlbPacking:
  """`data.wlb_cp=auto`: of the CP sizes `sizes` (default every `cp_sizes`), the
  `adaptive_pack` that `cost` prices fastest (the first of equals: the smallest group)."""
  sizes = cp_sizes(num_ranks) if sizes is None else sizes
  best, best_ms = None, math.inf
  for cp in sizes:
    p = adaptive_pack(doc_lens, num_ranks, tokens_per_rank, cost, cp=cp, token_cap=token_cap)
    ms = cost.step_ms(p)
    if ms < best_ms:
      best, best_ms = p, ms
  return best


def wlb_cost_for_model(shape, tensor_parallel: int, *, linear_tflops: float,
                       attention_tflops: float, nvlink_gbps: float, network_gbps: float,
                       gpus_per_node: int, cp_overlap: float, kernel=None,
                       static: bool = False) -> WlbCost:
  """The simulator's baseline price for a model shape (`sim/engine.py`: linear layers at
  `linear_tflops` shared by `tensor_parallel` GPUs; attention by `kernel`, default the analytic
  kernel at `attention_tflops` for the rank's heads)."""
  from distca_jax.schedule.cost import AnalyticKernel, CommModel

  comm = CommModel.for_model(shape, tensor_parallel)
  if kernel is None:
    kernel = AnalyticKernel(heads=comm.heads, head_dim=shape.head_dim,
                            tflops_fwd=attention_tflops, tflops_fwdbwd=attention_tflops)
  lin = shape.matmul_flops_per_token() / shape.layers * 3.0
  return WlbCost(lin_ms_per_token=lin / (tensor_parallel * linear_tflops * 1e12) * 1e3,
                 kernel=kernel, kv_row_bytes=comm.kv_row_bytes, nvlink_gbps=nvlink_gbps,
                 network_gbps=network_gbps, gpus_per_node=gpus_per_node,
                 tensor_parallel=tensor_parallel, cp_overlap=cp_overlap, static=static)
