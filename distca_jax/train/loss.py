"""Next-token cross-entropy over real tokens, computed in chunks of the sequence.

The LM head's logits for a 64K-token buffer and a 128K vocabulary would take 32 GiB in fp32, so
the head and the softmax run chunk by chunk under `jax.checkpoint`: only the hidden states are
kept for the backward pass and the logits of one chunk exist at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def chunked_cross_entropy(h_BxTxD: jax.Array, w_DxV: jax.Array, targets_BxT: jax.Array,
                          mask_BxT: jax.Array, chunk: int = 2048) -> jax.Array:
  """Sum over masked tokens of -log p(target) (fp32 scalar). `T` is split into chunks of `chunk`
  (or one chunk if T is not a multiple)."""
  B, T, D = h_BxTxD.shape
  if T % chunk:
    chunk = T
  n = T // chunk

  @jax.checkpoint
  def one(h_BxCxD, t_BxC, m_BxC):
    logits = jnp.einsum("bcd,dv->bcv", h_BxCxD, w_DxV.astype(h_BxCxD.dtype),
                        preferred_element_type=jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, t_BxC[..., None], axis=-1)[..., 0]
    return jnp.sum((logz - picked) * m_BxC)

  if n == 1:
    return one(h_BxTxD, targets_BxT, mask_BxT)
  hs = h_BxTxD.reshape(B, n, chunk, D).swapaxes(0, 1)
  ts = targets_BxT.reshape(B, n, chunk).swapaxes(0, 1)
  ms = mask_BxT.reshape(B, n, chunk).swapaxes(0, 1)
  total, _ = jax.lax.scan(lambda acc, x: (acc + one(*x), None), jnp.zeros((), jnp.float32), (hs, ts, ms))
  return total
