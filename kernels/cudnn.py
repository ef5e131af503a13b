"""cuDNN backend (GPU, Hopper or later): JAX's cuDNN fused attention over packed segments.

cuDNN's causal mask in JAX is aligned top-left, so each task is run as two packed segments:
  part A: its q queries x the first kv - q keys (the prefix before the shard), no mask;
  part B: its q queries x its last q keys (the diagonal square), causal (top-left = bottom-right
          for a square).
The two are merged by their LSEs.

The backward is the Pallas backward (`pallas.backward_from_stats`) fed the merged O and LSE, not
cuDNN's. cuDNN's packed backward writes dK/dV per segment without accumulating, so segments that
share key rows (several shards of one document over one deduplicated prefix, which the
scheduler produces on purpose) would overwrite each other's gradients. A flash backward needs only
P = exp(S - LSE) and rowsum(dO * O), so any backward fed the global statistics is exact.

This leans on the private `jax._src.cudnn.fused_attention_stablehlo` (packed layout, softmax
statistics). Its statistics for packed input have shape [segments, heads, T]; this module reads
entry [m, h, i] as the LSE of row i of segment m (cuDNN's per-sequence Stats tensor, with the
valid segments packed to the left).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import pallas
from .tasks import TaskTable, row_owner

NEG_INF = float("-inf")


def _fa():
  from jax._src.cudnn import fused_attention_stablehlo as fa
  return fa


def _owner(tasks: TaskTable, T: int):
  """Per row: owning task index (0 if none), covered flag, row index within the task."""
  owner, covered = row_owner(tasks, T)
  return owner, covered, jnp.arange(T, dtype=jnp.int32) - tasks.q_start[owner]


def _segments(tasks: TaskTable, part: str):
  """API-style packed description of one part: seqlens [1, M] and offsets [1, M + 1], -1 padded;
  plus per task its rank among the valid segments (cuDNN packs valid segments to the left)."""
  prefix = tasks.kv_len - tasks.q_len
  if part == "A":
    q_len, kv_off, kv_len = tasks.q_len, tasks.kv_start, prefix
  else:
    q_len, kv_off, kv_len = tasks.q_len, tasks.kv_start + prefix, tasks.q_len
  valid = (q_len > 0) & (kv_len > 0)
  neg = jnp.full_like(q_len, -1)
  pad = jnp.full((1,), -1, jnp.int32)
  qsl = jnp.where(valid, q_len, neg)[None]
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, tasks, scale):
  return _forward(q, k, v, tasks, scale)


def _attention_fwd(q, k, v, tasks, scale):
  o, lse = _forward(q, k, v, tasks, scale)
  return (o, lse), (q, k, v, tasks, o, lse)


def _attention_bwd(scale, res, cts):
  q, k, v, tasks, o, lse = res
  do, dlse = cts
  dlse = jnp.where(jnp.isfinite(lse), dlse.astype(jnp.float32), 0.0)
  dq, dk, dv = pallas.backward_from_stats(q, k, v, tasks, o, lse, do, dlse, scale)
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, *, scale: float | None = None):
  """O [T, H, D] in q's dtype and LSE [T, H] float32. GPU (Hopper+) only; bf16/fp16 inputs."""
  if jax.default_backend() != "gpu":
    raise RuntimeError("the cudnn kernel backend needs a GPU")
  if q_TxHxD.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"the cudnn kernel backend takes bf16 or fp16, not {q_TxHxD.dtype}")
  T, H, D = q_TxHxD.shape
  scale = D ** -0.5 if scale is None else float(scale)
  tasks = TaskTable(*(jnp.asarray(a, jnp.int32) for a in tasks))
  return _attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale)
