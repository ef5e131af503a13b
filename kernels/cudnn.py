"""cuDNN backend (GPU, Hopper or later): JAX's cuDNN fused attention over packed segments.

cuDNN's causal mask in JAX is aligned top-left, so each task is run as two packed segments:
  part A: its q queries x the first kv - q keys (the prefix before the shard), no mask;
  part B: its q queries x its last q keys (the diagonal square), causal (top-left = bottom-right
          for a square).
The forward merges the two by their LSEs.

The backward (`backward=`) is ours by default: the Triton backward kernels where jax-triton is
installed, else the Pallas ones, fed the merged O and LSE. cuDNN's own backward (`"cudnn"`) is an
ablation, measured slower or out of memory (docs/PERFORMANCE.md, "cuDNN's backward on packed
CA-tasks"): its packed backward keeps a float32 dQ workspace per segment padded to the whole
buffer, O(segments x T x H x D) (32 GiB for 15 tasks at 64K, 150 GiB at 128K), and its calls per
colour cost most on many short documents. It is run per part on the merged O and
LSE: a flash backward needs only P = exp(S - LSE) and rowsum(dO * O), so each part's backward fed
the global statistics gives exactly that part's share of dQ, dK and dV. One catch: cuDNN's packed
backward *writes* dK/dV per segment rather than adding, so segments whose key ranges overlap
(several shards of one document over one deduplicated prefix, which the scheduler produces on
purpose) would overwrite each other. The segments of a part are therefore coloured (greedy
interval colouring on the device: no two segments of one colour share a key row) and each
colour is one cuDNN call, its rows masked and summed. Tables from the dispatch need one colour
for part B and, for part A, as many as the most shards of one document on the server.
A non-zero LSE cotangent (cuDNN's backward has no input for it) takes our backward there.

This leans on the private `jax._src.cudnn.fused_attention_stablehlo` (packed layout, softmax
statistics, the backward primitive). Its statistics for packed input have shape
[segments, heads, T]: entry [m, h, i] is the LSE of row i of segment m, with the valid segments
packed to the left (cuDNN's per-sequence Stats tensor).

Shapes: T query rows, S key rows, H query heads, K KV heads, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import pallas
from .common import installed
from .tasks import TaskTable, row_owner

NEG_INF = float("-inf")
BACKWARDS = ("auto", "triton", "pallas", "mosaic", "cudnn")


def _fa():
  from jax._src.cudnn import fused_attention_stablehlo as fa
  return fa


def _owner(tasks: TaskTable, T: int):
  """Per row: owning task index (0 if none), covered flag, row index within the task."""
  owner, covered = row_owner(tasks, T)
  return owner, covered, jnp.arange(T, dtype=jnp.int32) - tasks.q_start[owner]


def _part_keys(tasks: TaskTable, part: str):
  """Per task: the part's key range (offset, length) and whether the part has any work."""
  prefix = tasks.kv_len - tasks.q_len
  if part == "A":
    kv_off, kv_len = tasks.kv_start, prefix
  else:
    kv_off, kv_len = tasks.kv_start + prefix, tasks.q_len
  return kv_off, kv_len, (tasks.q_len > 0) & (kv_len > 0)


def _segments(tasks: TaskTable, part: str, select=None):
  """API-style packed description of the part's selected tasks: seqlens [1, M] and offsets
  [1, M + 1], -1 padded; the selection mask; per task its rank among the selected segments
  (cuDNN packs valid segments to the left)."""
  kv_off, kv_len, valid = _part_keys(tasks, part)
  if select is not None:
    valid = valid & select
  neg = jnp.full_like(tasks.q_len, -1)
  pad = jnp.full((1,), -1, jnp.int32)
  qsl = jnp.where(valid, tasks.q_len, neg)[None]
  kvsl = jnp.where(valid, kv_len, neg)[None]
  qo = jnp.concatenate([jnp.where(valid, tasks.q_start, neg), pad])[None]
  ko = jnp.concatenate([jnp.where(valid, kv_off, neg), pad])[None]
  rank = jnp.cumsum(valid.astype(jnp.int32)) - 1
  return (qsl, kvsl, qo, ko), valid, rank


def _mask_type(part):
  fa = _fa()
  return fa.MaskType.PADDING_CAUSAL if part == "B" else fa.MaskType.PADDING


def _part_fwd(q, k, v, tasks, part, scale):
  """One part: O [T, H, D] and LSE [T, H] (-inf / 0 on rows outside the part)."""
  fa = _fa()
  T = q.shape[0]
  seg, valid, rank = _segments(tasks, part)
  o, stats = fa.dot_product_attention(
      q[None], k[None], v[None], None, None, *seg, scale=scale, mask_type=_mask_type(part),
      qkv_layout="BTNH", return_residual=True)
  owner, covered, local = _owner(tasks, T)
  in_part = covered & valid[owner]
  lse_TxH = stats[jnp.clip(rank[owner], 0, stats.shape[0] - 1), :, jnp.clip(local, 0, T - 1)]
  lse_TxH = jnp.where(in_part[:, None], lse_TxH, NEG_INF)
  o = jnp.where(in_part[:, None, None], o[0], 0)
  return o, lse_TxH.astype(jnp.float32)


def _forward(q, k, v, tasks, scale):
  oa, la = _part_fwd(q, k, v, tasks, "A", scale)
  ob, lb = _part_fwd(q, k, v, tasks, "B", scale)
  lse = jnp.logaddexp(la, lb)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  wa, wb = jnp.exp(la - safe), jnp.exp(lb - safe)
  o = wa[..., None] * oa.astype(jnp.float32) + wb[..., None] * ob.astype(jnp.float32)
  return o.astype(q.dtype), lse


def interval_colors(start, length, live):
  """Greedy interval colouring (jnp, traceable, O(C^2) for C intervals): per interval a colour in
  [0, C) such that live intervals of one colour never overlap (-1 for dead ones), and the number
  of colours used. Intervals are taken by start; each gets the lowest colour whose last interval
  has ended, which uses as few colours as the deepest overlap (optimal for intervals)."""
  start, length = jnp.asarray(start, jnp.int32), jnp.asarray(length, jnp.int32)
  live = jnp.asarray(live)
  C = start.shape[0]
  end = start + length
  order = jnp.argsort(jnp.where(live, start, jnp.iinfo(jnp.int32).max), stable=True)

  def step(ends, t):
    free = ends <= start[t]
    c = jnp.argmax(free)  # some colour is always free: C colours for C intervals
    ends = jnp.where(live[t], ends.at[c].set(end[t]), ends)
    return ends, jnp.where(live[t], c, -1)

  _, colors_sorted = jax.lax.scan(step, jnp.full((C,), jnp.iinfo(jnp.int32).min, jnp.int32),
                                  order)
  colors = jnp.zeros((C,), jnp.int32).at[order].set(colors_sorted.astype(jnp.int32))
  return colors, jnp.max(colors) + 1


def _covered_rows(n, start, length, select):
  """Per row of n: whether a selected range [start, start + length) covers it (ranges of the
  selection are disjoint). O(n + C): +1 at each start, -1 at each end, running sum."""
  w = select.astype(jnp.int32)
  marks = jnp.zeros((n + 1,), jnp.int32).at[jnp.minimum(start, n)].add(w)
  marks = marks.at[jnp.minimum(start + length, n)].add(-w)
  return jnp.cumsum(marks)[:n] > 0


def _part_bwd(q, k, v, tasks, part, scale, o, lse, do):
  """This part's dQ [T, H, D], dK, dV [S, K, D] (float32) from the merged O and LSE: one cuDNN
  backward call per colour of the part's segments."""
  fa = _fa()
  T, H, _ = q.shape
  S = k.shape[0]
  kv_off, kv_len, live = _part_keys(tasks, part)
  colors, n_colors = interval_colors(kv_off, kv_len, live)
  owner, covered, local = _owner(tasks, T)
  empty = jnp.zeros((0,), q.dtype)
  C = tasks.q_start.shape[0]

  def one_color(r, acc):
    dq, dk, dv = acc
    select = colors == r
    seg, valid, rank = _segments(tasks, part, select)
    rows = covered & valid[owner]
    # Statistics in cuDNN's packed layout: the merged LSE of row i of the m-th valid segment
    # at [m, :, i]; rows of no selected segment are dropped.
    m = jnp.where(rows, rank[owner], C)
    stats = jnp.zeros((C, T, H), jnp.float32).at[m, local].set(lse, mode="drop")
    grads = fa._dot_product_attention_bwd_p_wrapper.bind(
        q[None], k[None], v[None], empty, *seg, empty, empty, stats.transpose(0, 2, 1),
        o[None], do[None], scale=scale, seed=42, dropout_rate=0.0,
        variadic_args=(False, False), mask_type=_mask_type(part),
        layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None)
    dq_r, dk_r, dv_r = (g[0] for g in grads[:3])
    keys = _covered_rows(S, kv_off, kv_len, valid)[:, None, None]
    return (dq + jnp.where(rows[:, None, None], dq_r.astype(jnp.float32), 0),
            dk + jnp.where(keys, dk_r.astype(jnp.float32), 0),
            dv + jnp.where(keys, dv_r.astype(jnp.float32), 0))

  zeros = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
           jnp.zeros(v.shape, jnp.float32))
  return jax.lax.fori_loop(0, n_colors, one_color, zeros)


def _cudnn_backward(q, k, v, tasks, o, lse, do, scale):
  ga = _part_bwd(q, k, v, tasks, "A", scale, o, lse, do)
  gb = _part_bwd(q, k, v, tasks, "B", scale, o, lse, do)
  return tuple((a + b).astype(x.dtype) for a, b, x in zip(ga, gb, (q, k, v)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, tasks, scale, backward):
  return _forward(q, k, v, tasks, scale)


def _attention_fwd(q, k, v, tasks, scale, backward):
  o, lse = _forward(q, k, v, tasks, scale)
  return (o, lse), (q, k, v, tasks, o, lse)


def _attention_bwd(scale, backward, res, cts):
  q, k, v, tasks, o, lse = res
  do, dlse = cts
  dlse = jnp.where(jnp.isfinite(lse), dlse.astype(jnp.float32), 0.0)
  if backward == "triton":
    from . import triton
    ours = lambda: triton.backward_from_stats(q, k, v, tasks, o, lse, do, dlse, scale)
  elif backward == "mosaic":
    from . import mosaic
    ours = lambda: mosaic.backward_from_stats(q, k, v, tasks, o, lse, do, dlse, scale)
  else:
    ours = lambda: pallas.backward_from_stats(q, k, v, tasks, o, lse, do, dlse, scale)
  if backward != "cudnn":
    dq, dk, dv = ours()
  else:
    dq, dk, dv = jax.lax.cond(jnp.any(dlse != 0), ours,
                              lambda: _cudnn_backward(q, k, v, tasks, o, lse, do, scale))
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, *, scale: float | None = None,
              backward: str = "auto"):
  """O [T, H, D] in q's dtype and LSE [T, H] float32. GPU (Hopper+) only; bf16/fp16 inputs.
  `backward`: "triton", "mosaic" or "pallas" (our backward kernels fed the merged statistics;
  "auto" takes triton where jax-triton is installed) or "cudnn" (cuDNN's backward per part and
  colour; an ablation, see the module docstring)."""
  if jax.default_backend() != "gpu":
    raise RuntimeError("the cudnn kernel backend needs a GPU")
  if q_TxHxD.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"the cudnn kernel backend takes bf16 or fp16, not {q_TxHxD.dtype}")
  if backward not in BACKWARDS:
    raise ValueError(f"cudnn backend: backward {backward!r}, choose one of {BACKWARDS}")
  if backward == "auto":
    backward = "triton" if installed("triton") else "pallas"
  T, H, D = q_TxHxD.shape
  scale = D ** -0.5 if scale is None else float(scale)
  tasks = TaskTable(*(jnp.asarray(a, jnp.int32) for a in tasks))
  return _attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale, backward)
