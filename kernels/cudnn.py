"""cuDNN backend (GPU, Hopper or later): JAX's cuDNN fused attention over packed segments.

cuDNN's causal mask in JAX is aligned top-left, so each task is run as two packed segments:
  part A: its q queries x the first kv - q keys (the prefix before the shard), no mask;
  part B: its q queries x its last q keys (the diagonal square), causal (top-left = bottom-right
          for a square).
The two are merged by their LSEs. The backward calls cuDNN's backward on both parts with the
*merged* O and LSE (a flash backward only needs P = exp(S - LSE) and rowsum(dO * O), so feeding
the global statistics gives each part its exact share of dQ, dK, dV); the LSE cotangent is folded
into O (O' = O - dLSE * dO / |dO|^2 shifts rowsum(dO * O') by -dLSE).

This leans on the private `jax._src.cudnn.fused_attention_stablehlo` (packed layout, softmax
statistics). Its statistics for packed input have shape [segments, heads, T]; this module reads
entry [m, h, i] as the LSE of row i of segment m. If the private backward cannot be traced on the
installed JAX, the Pallas backward kernels (which take the same O and LSE) are used instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import pallas
from .tasks import TaskTable

NEG_INF = float("-inf")


def _fa():
  from jax._src.cudnn import fused_attention_stablehlo as fa
  return fa


def _owner(tasks: TaskTable, T: int):
  """Per row: owning task index (0 if none), covered flag, row index within the task."""
  rows = jnp.arange(T, dtype=jnp.int32)
  in_task = (rows[None, :] >= tasks.q_start[:, None]) & (
      rows[None, :] < (tasks.q_start + tasks.q_len)[:, None])
  owner = jnp.argmax(in_task, axis=0)
  return owner, jnp.any(in_task, axis=0), rows - tasks.q_start[owner]


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


def _part_bwd(q, k, v, tasks, part, scale, o, lse, do):
  fa = _fa()
  T = q.shape[0]
  seg, valid, rank = _segments(tasks, part)
  M = tasks.q_start.shape[0]
  # Global LSE laid out as the part's statistics: [m, h, i] = LSE[q_start[m] + i, h].
  i = jnp.arange(T)
  rows = jnp.clip(tasks.q_start[:, None] + i[None, :], 0, T - 1)  # [M, T]
  act = jnp.where((i[None, :] < tasks.q_len[:, None])[..., None], lse[rows], 0.0)  # [M, T, H]
  act = jnp.transpose(act, (0, 2, 1))
  # Valid segments are packed to the left, in order.
  order = jnp.argsort(jnp.where(valid, rank, M + jnp.arange(M)))
  act = act[order].astype(jnp.float32)
  empty = jnp.zeros(0, q.dtype)
  grads = fa._dot_product_attention_bwd_p_wrapper.bind(
      q[None], k[None], v[None], empty, *seg, empty, empty, act, o[None], do[None],
      scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False),
      mask_type=_mask_type(part), layout=fa.AttentionLayout.BTNH.value,
      sliding_window_length=None)
  dq, dk, dv = grads[0][0], grads[1][0], grads[2][0]
  owner, covered, _ = _owner(tasks, T)
  dq = jnp.where((covered & valid[owner])[:, None, None], dq, 0)
  return dq, dk, dv


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
  try:
    do32 = do.astype(jnp.float32)
    n2 = jnp.sum(do32 * do32, axis=-1)
    c = jnp.where(n2 > 0, dlse / jnp.where(n2 > 0, n2, 1.0), 0.0)
    o_shift = (o.astype(jnp.float32) - c[..., None] * do32).astype(o.dtype)
    dqa, dka, dva = _part_bwd(q, k, v, tasks, "A", scale, o_shift, lse, do)
    dqb, dkb, dvb = _part_bwd(q, k, v, tasks, "B", scale, o_shift, lse, do)
    f32 = lambda a, b, like: (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(like.dtype)
    return f32(dqa, dqb, q), f32(dka, dkb, k), f32(dva, dvb, v), None
  except Exception:  # noqa: BLE001 (private API moved: the Pallas backward takes the same O/LSE)
    dq, dk, dv = pallas.backward_from_stats(q, k, v, tasks, o, lse, do, dlse, scale)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, *, scale: float | None = None):
  """O [T, H, D] in q's dtype and LSE [T, H] float32. GPU (Hopper+) only; bf16/fp16 inputs."""
  if jax.default_backend() != "gpu":
    raise RuntimeError("the cudnn kernel backend needs a GPU")
  T, H, D = q_TxHxD.shape
  scale = D ** -0.5 if scale is None else float(scale)
  tasks = TaskTable(*(jnp.asarray(a, jnp.int32) for a in tasks))
  return _attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale)
