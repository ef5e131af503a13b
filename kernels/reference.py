"""Reference backend: dense masked attention in plain XLA. The correctness oracle; CPU friendly.

Cost is O(T * S) whatever the tasks: use it for tests and small shapes only.

Shapes: T query rows, S key rows, H query heads, K KV heads, G = H / K query heads a KV head,
D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .tasks import TaskTable, row_bounds


def attention(q_TxHxD: jax.Array, k_SxKxD: jax.Array, v_SxKxD: jax.Array, tasks: TaskTable,
              *, scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  """O [T, H, D] in q's dtype and LSE [T, H] float32 (natural log, -inf for uncovered rows).

  Computed in float32 (float64 if the inputs are float64); GQA: query head h reads KV head
  h // (H // K).
  """
  T, H, D = q_TxHxD.shape
  S, K, _ = k_SxKxD.shape
  if H % K:
    raise ValueError(f"GQA: {H} query heads are not a multiple of {K} KV heads")
  scale = D ** -0.5 if scale is None else scale
  acc = jnp.promote_types(q_TxHxD.dtype, jnp.float32)
  lo, hi = row_bounds(tasks, T)
  cols = jnp.arange(S, dtype=jnp.int32)
  mask_TxS = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
  q = q_TxHxD.astype(acc).reshape(T, K, H // K, D)
  s_KxGxTxS = jnp.einsum("tkgd,skd->kgts", q, k_SxKxD.astype(acc)) * scale
  s_KxGxTxS = jnp.where(mask_TxS, s_KxGxTxS, -jnp.inf)
  m = jnp.max(s_KxGxTxS, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s_KxGxTxS - m)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  safe = jnp.where(denom > 0, denom, 1.0)
  o = jnp.einsum("kgts,skd->tkgd", p / safe, v_SxKxD.astype(acc))
  lse = jnp.where(denom > 0, jnp.log(safe) + m, -jnp.inf)[..., 0]  # [K, G, T]
  lse_TxH = jnp.transpose(lse, (2, 0, 1)).reshape(T, H)
  return o.reshape(T, H, D).astype(q_TxHxD.dtype), lse_TxH.astype(jnp.float32)
