"""Next-token cross-entropy over real tokens, computed in chunks of the sequence.

The LM head's logits for a 64K-token buffer and a 128K vocabulary would take 32 GiB in fp32, so
the head and the softmax run chunk by chunk and the logits of one chunk exist at a time. Under
differentiation the forward pass also differentiates each chunk while its logits exist
(`fuse_grad`, the default): the gradients with respect to the hidden states and the head are
the residuals, so the backward pass never computes the logits a second time (the head is a
fifth of a 1B model's matmul FLOPs at a 128K vocabulary).
"""

from __future__ import annotations

import functools
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
                          mask_BxT: jax.Array, chunk: int = 2048, scale: jax.Array | float = 1.0,
                          fuse_grad: bool = True) -> jax.Array:
  """`scale` times the sum over masked tokens of -log p(target) (fp32 scalar), `T` split into
  chunks of `chunk` tokens (see `_chunked`). `scale` (e.g. 1 / the token count) is applied
  inside, before the backward's matmuls, as autodiff of `sum * scale` would; it takes no
  gradient. `fuse_grad=False`: plain autodiff, each chunk's logits recomputed in the backward."""
  scale = jnp.asarray(scale, jnp.float32)
  with jax.named_scope("lm_head_loss"):  # the profiler's step parts (train/profile.py)
    if fuse_grad:
      return _fused_cross_entropy(h_BxTxD, w_DxV, targets_BxT, mask_BxT, scale, chunk)
    return _recompute_cross_entropy(h_BxTxD, w_DxV, targets_BxT, mask_BxT, chunk) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused_cross_entropy(h_BxTxD, w_DxV, targets_BxT, mask_BxT, scale, chunk):
  return _recompute_cross_entropy(h_BxTxD, w_DxV, targets_BxT, mask_BxT, chunk) * scale


def _fused_fwd(h_BxTxD, w_DxV, targets_BxT, mask_BxT, scale, chunk):
  total, dh, dw = cross_entropy_and_grads(h_BxTxD, w_DxV, targets_BxT, mask_BxT, scale,
                                          jnp.zeros(w_DxV.shape, jnp.float32), chunk)
  return total, (dh, dw.astype(w_DxV.dtype))


def _fused_bwd(chunk, res, g):
  dh, dw = res
  # g is 1 under value_and_grad of the mean loss: the products are exact there.
  return ((g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), None, None, None)


_fused_cross_entropy.defvjp(_fused_fwd, _fused_bwd)


def _recompute_cross_entropy(h_BxTxD, w_DxV, targets_BxT, mask_BxT, chunk):
  one = jax.checkpoint(lambda h, t, m: _token_loss(h, w_DxV, t, m))
  hs, ts, ms = _chunked(chunk, h_BxTxD, targets_BxT, mask_BxT)
  if hs.shape[0] == 1:
    return one(hs[0], ts[0], ms[0])
  total, _ = jax.lax.scan(lambda acc, x: (acc + one(*x), None), jnp.zeros((), jnp.float32), (hs, ts, ms))
  return total


def _chunk_loss_and_grads(h_BxCxD, w_DxV, t_BxC, m_BxC, scale):
  """`scale` times one chunk's loss, and its gradients with respect to `h` (h's dtype) and `w`
  (fp32), written out instead of autodiff so that XLA fuses the softmax's backward into one pass
  over the fp32 logits: the target's logit is picked by comparison with an iota (autodiff of a
  gather scatters into a zeroed [C, V] buffer), and the logits' gradient enters the two matmuls
  in the compute dtype (a float32 operand would make them float32 matmuls)."""
  logits = jnp.einsum("bcd,dv->bcv", h_BxCxD, w_DxV, preferred_element_type=jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == t_BxC[..., None]
  picked = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
  total = jnp.sum((logz - picked) * m_BxC) * scale
  g_BxC = (m_BxC * scale)[..., None]
  dlogits = ((jnp.exp(logits - logz[..., None]) - hit) * g_BxC).astype(h_BxCxD.dtype)
  dh = jnp.einsum("bcv,dv->bcd", dlogits, w_DxV, preferred_element_type=jnp.float32)
  dw = jnp.einsum("bcd,bcv->dv", h_BxCxD, dlogits, preferred_element_type=jnp.float32)
  return total, dh.astype(h_BxCxD.dtype), dw


def cross_entropy_and_grads(h_BxTxD: jax.Array, w_DxV: jax.Array, targets_BxT: jax.Array,
                            mask_BxT: jax.Array, scale: jax.Array, dw_acc_DxV: jax.Array,
                            chunk: int = 2048) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`scale * chunked_cross_entropy(...)`, its gradient with respect to `h`, and
  `dw_acc + ` its gradient with respect to `w`, chunk by chunk: the head gradient is added into
  the accumulator as each chunk is differentiated (no second [D, V] buffer). For gradient
  accumulation over micro-batches (the pipeline) and the fused loss's forward."""
  B, T, D = h_BxTxD.shape
  # The head in the compute dtype once, not once per chunk inside the loop.
  w_c = w_DxV.astype(h_BxTxD.dtype)

  def one(carry, x):
    total, dw = carry
    loss, dh, dw_chunk = _chunk_loss_and_grads(*x[:1], w_c, *x[1:], scale)
    return (total + loss, dw + dw_chunk.astype(dw.dtype)), dh

  xs = _chunked(chunk, h_BxTxD, targets_BxT, mask_BxT)
  (total, dw), dh = jax.lax.scan(one, (jnp.zeros((), jnp.float32), dw_acc_DxV), xs)
  return total, dh.swapaxes(0, 1).reshape(B, T, D), dw


def bucketed_cross_entropy(h_BxTxD: jax.Array, w_DxV: jax.Array, targets_BxT: jax.Array,
                           mask_BxT: jax.Array, bucket_BxT: jax.Array, buckets: int,
                           chunk: int = 2048) -> tuple[jax.Array, jax.Array]:
  """Per bucket, the sum over masked tokens of -log p(target) and their count ([buckets] fp32
  each; `bucket_BxT` in [0, buckets)), chunk by chunk as `chunked_cross_entropy` computes the
  loss: one pass of the LM head whatever the number of buckets. Forward only (evaluation)."""
  w_c = w_DxV.astype(h_BxTxD.dtype)

  def one(carry, x):
    h, t, m, b = x
    logits = jnp.einsum("bcd,dv->bcv", h, w_c, preferred_element_type=jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == t[..., None]
    picked = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    onehot = (b[..., None] == jnp.arange(buckets)).astype(jnp.float32) * m[..., None]
    sums, counts = carry
    # Elementwise, not a matmul: a float32 matmul may run in TF32 on a GPU.
    losses = jnp.sum((logz - picked)[..., None] * onehot, axis=(0, 1))
    return (sums + losses, counts + onehot.sum((0, 1))), None

  zeros = jnp.zeros((buckets,), jnp.float32)
  with jax.named_scope("lm_head_loss"):
    (sums, counts), _ = jax.lax.scan(one, (zeros, zeros),
                                     _chunked(chunk, h_BxTxD, targets_BxT, mask_BxT, bucket_BxT))
  return sums, counts
