"""Next-token cross-entropy over real tokens, computed in chunks of the sequence.

The LM head's logits for a 64K-token buffer and a 128K vocabulary would take 32 GiB in fp32, so
the head and the softmax run chunk by chunk under `jax.checkpoint`: only the hidden states are
kept for the backward pass and the logits of one chunk exist at a time.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _token_loss(h_BxCxD, w_DxV, t_BxC, m_BxC):
  """Sum of -log p(target) over the masked tokens of one chunk."""
  logits = jnp.einsum("bcd,dv->bcv", h_BxCxD, w_DxV.astype(h_BxCxD.dtype),
                      preferred_element_type=jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, t_BxC[..., None], axis=-1)[..., 0]
  return jnp.sum((logz - picked) * m_BxC)


def _chunked(chunk: int, *arrays_BxT):
  """[B, T, ...] arrays -> [n, B, chunk, ...]; when `chunk` does not divide T, the largest
  power-of-two part of it that does (never one chunk of T: its fp32 logits would not fit)."""
  B, T = arrays_BxT[0].shape[:2]
  chunk = math.gcd(T, chunk)
  return tuple(a.reshape((B, T // chunk, chunk) + a.shape[2:]).swapaxes(0, 1) for a in arrays_BxT)


def chunked_cross_entropy(h_BxTxD: jax.Array, w_DxV: jax.Array, targets_BxT: jax.Array,
                          mask_BxT: jax.Array, chunk: int = 2048) -> jax.Array:
  """Sum over masked tokens of -log p(target) (fp32 scalar), `T` split into chunks of `chunk`
  tokens (see `_chunked`)."""
  one = jax.checkpoint(lambda h, t, m: _token_loss(h, w_DxV, t, m))
  hs, ts, ms = _chunked(chunk, h_BxTxD, targets_BxT, mask_BxT)
  if hs.shape[0] == 1:
    return one(hs[0], ts[0], ms[0])
  total, _ = jax.lax.scan(lambda acc, x: (acc + one(*x), None), jnp.zeros((), jnp.float32), (hs, ts, ms))
  return total


def cross_entropy_and_grads(h_BxTxD: jax.Array, w_DxV: jax.Array, targets_BxT: jax.Array,
                            mask_BxT: jax.Array, scale: jax.Array, dw_acc_DxV: jax.Array,
                            chunk: int = 2048) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`scale * chunked_cross_entropy(...)`, its gradient with respect to `h`, and
  `dw_acc + ` its gradient with respect to `w`, chunk by chunk: the head gradient is added into
  the accumulator as each chunk is differentiated (no second [D, V] buffer). For gradient
  accumulation over micro-batches (the pipeline)."""
  B, T, D = h_BxTxD.shape
  grad = jax.value_and_grad(lambda h, w, t, m: _token_loss(h, w, t, m) * scale, argnums=(0, 1))

  def one(carry, x):
    total, dw = carry
    h, t, m = x
    loss, (dh, dw_chunk) = grad(h, w_DxV, t, m)
    return (total + loss, dw + dw_chunk.astype(dw.dtype)), dh

  xs = _chunked(chunk, h_BxTxD, targets_BxT, mask_BxT)
  (total, dw), dh = jax.lax.scan(one, (jnp.zeros((), jnp.float32), dw_acc_DxV), xs)
  return total, dh.swapaxes(0, 1).reshape(B, T, D), dw
