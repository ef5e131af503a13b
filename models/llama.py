"""A Llama-3-style decoder in Flax NNX.

The model knows nothing about meshes or devices. Two seams connect it to the rest of the system:
- `core_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, attn_ctx) -> o_BxTxHxD` computes
  softmax(QK^T)V for packed documents. `attn_ctx` is an opaque pytree passed through `__call__`
  (segment information, task tables, dispatch plans): the model never looks inside it. With
  several streams (ping-pong), every stream after the first is called with
  `prior_kv=(k, v)` of the stream before it as well, which its context may read (a document
  cut between the two).
- `constrain(x, logical_axes)` pins an activation's layout by logical axis names; the default
  does nothing. `distca_jax.mesh` supplies one that maps names to mesh axes.

Every parameter carries `logical_axes` metadata, one name per dimension, which one table in
`distca_jax/mesh.py` maps to mesh axes, and `init`, its initial distribution (`Init`), which the
trainer uses to initialise each parameter straight into its sharding.

Shape suffixes: B batch (one row per device buffer), T tokens, D model width, H query heads,
K key/value heads, E head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from .presets import ModelShape
from .rope import attention_factor, inv_freq

CoreAttention = Callable[[jax.Array, jax.Array, jax.Array, Any], jax.Array]
Constrain = Callable[[jax.Array, tuple[str | None, ...]], jax.Array]


def _identity_constrain(x, _axes):
  return x


def join_streams(x_BxT):
  """Ping-pong's per-stream arrays (a tuple) joined along T, stream after stream, as `Llama`
  returns its hidden states; a single array as it is."""
  return jnp.concatenate(x_BxT, axis=1) if isinstance(x_BxT, tuple) else x_BxT


@dataclasses.dataclass(frozen=True)
class Init:
  """A parameter's initial distribution: normal with standard deviation `std`, or the constant
  `fill` where `std` is 0. A value (hashable), so the trainer compiles one initialiser per
  distinct (Init, shape, sharding) rather than one program drawing every parameter."""

  std: float = 0.0
  fill: float = 0.0

  def __call__(self, key, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    if self.std == 0.0:
      return jnp.full(shape, self.fill, dtype)
    return self.std * jax.random.normal(key, shape, dtype)


def _param(rngs: nnx.Rngs, init: Init, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> nnx.Param:
  return nnx.Param(init(rngs.params(), shape), logical_axes=axes, init=init)


def rope(x_BxTxNxE: jax.Array, positions_BxT: jax.Array, theta: float, scaling=None) -> jax.Array:
  """Rotary embedding (rotate-half form, as Hugging Face's Llama) at the given in-document
  positions, computed in fp32; `scaling`: a `rope.RopeScaling` or None."""
  with jax.named_scope("rope"):  # the profiler's step parts (distca_jax/train/profile.py)
    return _rope(x_BxTxNxE, positions_BxT, theta, scaling)


def _rope(x_BxTxNxE, positions_BxT, theta, scaling):
  E = x_BxTxNxE.shape[-1]
  freqs_E2 = jnp.asarray(inv_freq(E, theta, scaling))
  angle_BxTxE2 = positions_BxT[..., None].astype(jnp.float32) * freqs_E2
  # YaRN's attention factor scales cos and sin (1 otherwise), as Hugging Face applies it.
  scale = attention_factor(scaling)
  sin = (jnp.sin(angle_BxTxE2) * scale)[:, :, None, :]
  cos = (jnp.cos(angle_BxTxE2) * scale)[:, :, None, :]
  x1, x2 = jnp.split(x_BxTxNxE.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxE.dtype)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=("norm",),
                           init=Init(fill=1.0))
    self.eps = eps

  def __call__(self, x):
    with jax.named_scope("rmsnorm"):
      x32 = x.astype(jnp.float32)
      y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
      return (y * self.scale[...]).astype(x.dtype)


class Attention(nnx.Module):
  """Projections, RoPE and the output projection; core attention goes through the seam."""

  def __init__(self, shape: ModelShape, dtype, core_attention: CoreAttention, constrain: Constrain,
               rngs: nnx.Rngs):
    D, H, K, E = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim
    init = Init(std=D ** -0.5)
    self.wq = _param(rngs, init, (D, H, E), ("embed", "heads", "head_dim"))
    self.wk = _param(rngs, init, (D, K, E), ("embed", "kv_heads", "head_dim"))
    self.wv = _param(rngs, init, (D, K, E), ("embed", "kv_heads", "head_dim"))
    self.wo = _param(rngs, Init(std=(H * E) ** -0.5), (H, E, D),
                     ("heads", "head_dim", "embed"))
    if shape.qkv_bias:
      zeros = Init()
      self.bq = _param(rngs, zeros, (H, E), ("heads", "head_dim"))
      self.bk = _param(rngs, zeros, (K, E), ("kv_heads", "head_dim"))
      self.bv = _param(rngs, zeros, (K, E), ("kv_heads", "head_dim"))
    self.qkv_bias = shape.qkv_bias
    self.theta = shape.rope_theta
    self.rope_scaling = shape.rope_scaling
    self.dtype = dtype
    self.core_attention = core_attention
    self.constrain = constrain

  def project(self, x_BxTxD, positions_BxT):
    """Q, K, V of one stream, RoPE applied: the inputs of core attention."""
    c = lambda w: w[...].astype(self.dtype)
    q = jnp.einsum("btd,dhe->bthe", x_BxTxD, c(self.wq))
    k = jnp.einsum("btd,dke->btke", x_BxTxD, c(self.wk))
    v = jnp.einsum("btd,dke->btke", x_BxTxD, c(self.wv))
    if self.qkv_bias:
      q, k, v = q + c(self.bq), k + c(self.bk), v + c(self.bv)
    q = rope(q, positions_BxT, self.theta, self.rope_scaling)
    k = rope(k, positions_BxT, self.theta, self.rope_scaling)
    q = self.constrain(q, ("batch", "seq", "heads", "head_dim"))
    k = self.constrain(k, ("batch", "seq", "kv_heads", "head_dim"))
    return q, k, self.constrain(v, ("batch", "seq", "kv_heads", "head_dim"))

  def output(self, o_BxTxHxE):
    out = jnp.einsum("bthe,hed->btd", o_BxTxHxE.astype(self.dtype), self.wo[...].astype(self.dtype))
    return checkpoint_name(out, "attn_out")

  def core(self, qkv, attn_ctxs):
    """Core attention of every stream, issued after all projections, so that one stream's
    dispatch has independent work (the other stream's) to overlap with. A later stream may read
    the K/V rows of the one before it (`prior_kv`: a document cut between two streams)."""
    return tuple(self.core_attention(q, k, v, ctx) if i == 0 else
                 self.core_attention(q, k, v, ctx, prior_kv=qkv[i - 1][1:])
                 for i, ((q, k, v), ctx) in enumerate(zip(qkv, attn_ctxs)))

  def __call__(self, xs_BxTxD, positions_BxT, attn_ctxs):
    """Tuples in, tuple out: one entry per nano-batch stream (see `Llama`)."""
    qkv = tuple(self.project(x, pos) for x, pos in zip(xs_BxTxD, positions_BxT))
    return tuple(self.output(o) for o in self.core(qkv, attn_ctxs))


class MLP(nnx.Module):
  """SwiGLU."""

  def __init__(self, shape: ModelShape, dtype, rngs: nnx.Rngs):
    D, F = shape.hidden, shape.ffn
    self.w_gate = _param(rngs, Init(std=D ** -0.5), (D, F), ("embed", "mlp"))
    self.w_up = _param(rngs, Init(std=D ** -0.5), (D, F), ("embed", "mlp"))
    self.w_down = _param(rngs, Init(std=F ** -0.5), (F, D), ("mlp", "embed"))
    self.dtype = dtype

  def __call__(self, x_BxTxD):
    c = lambda w: w[...].astype(self.dtype)
    gate = checkpoint_name(jnp.einsum("btd,df->btf", x_BxTxD, c(self.w_gate)), "mlp_gate")
    up = checkpoint_name(jnp.einsum("btd,df->btf", x_BxTxD, c(self.w_up)), "mlp_up")
    with jax.named_scope("swiglu"):
      h = jax.nn.silu(gate) * up
    return jnp.einsum("btf,fd->btd", h, c(self.w_down))


class Block(nnx.Module):
  def __init__(self, shape: ModelShape, dtype, core_attention, constrain, rngs: nnx.Rngs, eps: float):
    self.attn_norm = RMSNorm(shape.hidden, eps)
    self.attn = Attention(shape, dtype, core_attention, constrain, rngs)
    self.mlp_norm = RMSNorm(shape.hidden, eps)
    self.mlp = MLP(shape, dtype, rngs)
    self.constrain = constrain

  def __call__(self, xs_BxTxD, positions_BxT, attn_ctxs):
    attn_out = self.attn(tuple(self.attn_norm(x) for x in xs_BxTxD), positions_BxT, attn_ctxs)
    return tuple(self.finish(x, o) for x, o in zip(xs_BxTxD, attn_out))

  # The block cut at the seam, for callers that run core attention themselves (the pipeline
  # runs every stage's projections, then one core attention over all stages' rows):
  # block(x) == finish(x, attn.output(core_attention(*attention_inputs(x))))
  def attention_inputs(self, x_BxTxD, positions_BxT):
    return self.attn.project(self.attn_norm(x_BxTxD), positions_BxT)

  def finish(self, x_BxTxD, attn_out_BxTxD):
    """Residual, MLP and residual after the attention's output projection."""
    x = x_BxTxD + attn_out_BxTxD
    return self.constrain(x + self.mlp(self.mlp_norm(x)), ("batch", "seq", "act_embed"))

  # The same cut over tuples of streams, for the remat policies that keep core attention out of
  # the rematerialised region (`_remat_block`).
  def streams_attention_inputs(self, xs_BxTxD, positions_BxT):
    return tuple(self.attention_inputs(x, pos) for x, pos in zip(xs_BxTxD, positions_BxT))

  def streams_finish(self, xs_BxTxD, os_BxTxHxE):
    return tuple(self.finish(x, self.attn.output(o)) for x, o in zip(xs_BxTxD, os_BxTxHxE))


class Llama(nnx.Module):
  """Token embedding, `layers` decoder blocks, final RMSNorm; `__call__` returns the final hidden
  states, and `logits` / the loss in `distca_jax.train` apply the LM head (`head_weight`;
  chunked, so the [T, V] logits never exist at once)."""

  def __init__(self, shape: ModelShape, *, dtype=jnp.bfloat16, remat: str = "full",
               core_attention: CoreAttention, constrain: Constrain = _identity_constrain,
               norm_eps: float = 1e-5, rngs: nnx.Rngs):
    self.shape = shape
    self.dtype = dtype
    self.embed = _param(rngs, Init(std=1.0), (shape.vocab_size, shape.hidden),
                        ("vocab", "embed"))
    self.blocks = nnx.List([Block(shape, dtype, core_attention, constrain, rngs, norm_eps)
                            for _ in range(shape.layers)])
    self.final_norm = RMSNorm(shape.hidden, norm_eps)
    if not shape.tie_embeddings:
      self.lm_head = _param(rngs, Init(std=shape.hidden ** -0.5),
                            (shape.hidden, shape.vocab_size), ("embed", "vocab"))
    self.remat = remat
    self.constrain = constrain

  def head_weight(self) -> jax.Array:
    """The LM head [D, V]: its own parameter, or the embedding's transpose when tied."""
    return self.embed[...].T if self.shape.tie_embeddings else self.lm_head[...]

  def __call__(self, tokens_BxT, positions_BxT, attn_ctx):
    """Final hidden states [B, T, D] in the compute dtype.

    Ping-pong: `tokens_BxT`, `positions_BxT` and `attn_ctx` may be tuples, one entry per
    nano-batch stream; the streams' hidden states then come back joined along T, stream after
    stream (`join_streams`). Streams share the weights but no data, so the compiler may run one
    stream's attention communication beside another's compute. The embedding and the LM head
    run once over the joined rows: run per stream, each would make its own [V, D] fp32 weight
    gradient for the backward to add.
    """
    if not isinstance(tokens_BxT, tuple):
      x = jnp.take(self.embed[...], tokens_BxT, axis=0)
      return self.from_embeddings((x,), (positions_BxT,), (attn_ctx,))[0]
    cuts = np.cumsum([t.shape[1] for t in tokens_BxT])[:-1]
    x = jnp.take(self.embed[...], join_streams(tokens_BxT), axis=0)
    xs = tuple(jnp.split(x, cuts, axis=1))
    return join_streams(self.from_embeddings(xs, tuple(positions_BxT), tuple(attn_ctx)))

  def from_embeddings(self, xs_BxTxD, positions_BxT, attn_ctxs) -> tuple[jax.Array, ...]:
    """The decoder stack on already-embedded tokens, tuples of streams (tests differentiate
    through it)."""
    xs = tuple(self.constrain(x.astype(self.dtype), ("batch", "seq", "act_embed")) for x in xs_BxTxD)
    for block in self.blocks:
      xs = _remat_block(block, self.remat)(xs, tuple(positions_BxT), tuple(attn_ctxs))
    return tuple(self.final_norm(x) for x in xs)


# What each `model.remat` policy keeps for the backward pass, from the most kept (fastest, most
# memory) to the least. `model.remat=auto` tries them in this order (`AUTO_ORDER`) and takes
# the first whose compiled step fits the device (`distca_jax/train/remat.py`).
#   none       everything autodiff saves; nothing recomputed.
#   save_proj  core attention outside the recomputed region (its kernel's residuals Q, K, V, O and
#              the softmax statistics are kept), plus the output projection and the MLP's gate
#              and up projections (`checkpoint_name`); the backward recomputes only elementwise
#              work (RMSNorm, RoPE, SwiGLU's product).
#   save_attn  as save_proj without the MLP's projections: the backward recomputes the gate and
#              up matmuls (two of the block's seven).
#   full       only the block's input kept; the whole block, attention included, runs again.
REMAT_POLICIES = ("none", "save_proj", "save_attn", "full")
AUTO_ORDER = REMAT_POLICIES
_SAVED_NAMES = {"save_proj": ("attn_out", "mlp_gate", "mlp_up"), "save_attn": ("attn_out",)}


def _remat_block(block: Block, remat: str):
  """The block's call over tuples of streams, rematerialised in the backward pass as `remat`
  says (`REMAT_POLICIES`)."""
  if remat == "none":
    return block
  if remat in _SAVED_NAMES:
    policy = jax.checkpoint_policies.save_only_these_names(*_SAVED_NAMES[remat])
    inputs = nnx.remat(Block.streams_attention_inputs, policy=policy)
    finish = nnx.remat(Block.streams_finish, policy=policy)

    def call(xs, positions, attn_ctxs):
      # Core attention between the two recomputed halves: its residuals are saved, so the
      # backward never runs the attention forward again.
      os = block.attn.core(inputs(block, xs, positions), attn_ctxs)
      return finish(block, xs, os)

    return call
  if remat != "full":
    raise ValueError(f"remat: one of {REMAT_POLICIES}, got {remat!r}")
  return functools.partial(nnx.remat(Block.__call__), block)
