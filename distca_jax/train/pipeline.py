"""Pipeline parallelism over the `pipe` mesh axis, lock-step 1F1B, attention served by every stage.

The model's L decoder blocks are split into S = mesh.pipe stages of L/S consecutive blocks; the
block parameters are stacked `[S, L/S, ...]` with the stage dimension sharded over `pipe`. A step
trains on M micro-batches (each a `Batch` of one buffer per data rank) and runs a static sequence
of ticks. In a tick *every* stage runs forward, or every stage runs backward (the paper's modified
1F1B, docs/METHOD.md "4D parallelism"):

  forward tick f:  stage s runs micro-batch f - s         (f = 0 .. M+S-2)
  backward tick b: stage s runs micro-batch b - (S-1-s)   (b = 0 .. M+S-2)
  order:           F0 .. F(S-1), B0, FS, B1, F(S+1), ..., then the remaining B ticks

A stage without a micro-batch in a tick (warm-up and drain) computes on an empty buffer: its rows
hold no tokens, so it only serves attention. The forward of a tick is one SPMD program over all
stages: every block's projections run per stage (`vmap` over the stage dimension, sharded over
`pipe`), then ONE core attention call over all S x data rows — so with `attention.impl=distca` a
tick's CA-tasks from every stage and replica are balanced together over every device, with one
plan per tick — then the rest of the block per stage. Stages pass activations forward, and
gradients backward, with `ppermute` over `pipe` inside `shard_map`.

With ping-pong (`attention.pingpong`, CAD), every micro-batch runs as two nano-batches of half
its tokens, Ping and Pong (`dispatch.split_pingpong_batch`), side by side in each row; a tick
then has two plans and two core attention calls per block, Ping's and Pong's, so one stream's
exchange overlaps the other's projections and MLP in forward and backward ticks alike. A document
cut between the halves stays exact: Pong's attention reads Ping's K/V of its prefix (`prior_kv`).
With `attention.pingpong=false` a tick is one stream (the ablation).

Forward ticks keep only each block's input; a backward tick recomputes each of its blocks, last
first, from that input and differentiates it (`jax.vjp` per block): one forward and one backward
per block, as full remat costs in the unpipelined model. A stage keeps the block inputs of the
micro-batches in flight — at most 2S-1 for the first stage in this lock-step order — and XLA frees
each as soon as its backward has run. Gradients accumulate in place: block gradients by
`.at[].add`, the LM head's chunk by chunk (`cross_entropy_and_grads`), the embedding's by one
scatter-add per micro-batch. The embedding and the LM head + loss run outside the stages (first
stage's input, last stage's output); the head's tokens are split over every stage's device.

The host side (the tick order `Schedule`, each tick's layout and plans, `host_context`) is
`train/pipeline_host.py`; this module is the parameters' layout and the device step.

Parameters: `split_blocks` turns a `Llama`'s state into `{"embed", "final_norm", "lm_head",
"blocks"}` plain arrays (blocks stacked), `join_blocks` reverses it, so the pipelined model is
numerically the same model as the unpipelined one (tests compare them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distca_jax.train.loss import cross_entropy_and_grads
from distca_jax.train.pipeline_host import Schedule

# ----------------------------------------------------------------------------- parameters


def split_blocks(params: Any, layers: int, stages: int) -> dict[str, Any]:
  """`Llama` parameter state (nnx.State or its pure dict) -> pipeline layout, blocks stacked
  [stages, layers / stages, ...]."""
  pure = params.to_pure_dict() if hasattr(params, "to_pure_dict") else params
  if layers % stages:
    raise ValueError(f"{layers} layers do not split into {stages} pipeline stages")
  per = layers // stages
  blocks = [pure["blocks"][i] for i in range(layers)]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs).reshape((stages, per) + xs[0].shape), *blocks)
  return {"embed": pure["embed"], "final_norm": pure["final_norm"], "lm_head": pure["lm_head"],
          "blocks": stacked}


def join_blocks(pipelined: dict[str, Any]) -> dict[str, Any]:
  """The inverse of `split_blocks`: the pure-dict state of the unpipelined `Llama`."""
  stacked = pipelined["blocks"]
  S, per = jax.tree.leaves(stacked)[0].shape[:2]
  flat = jax.tree.map(lambda x: x.reshape((S * per,) + x.shape[2:]), stacked)
  blocks = {i: jax.tree.map(lambda x, i=i: x[i], flat) for i in range(S * per)}
  return {"embed": pipelined["embed"], "final_norm": pipelined["final_norm"],
          "lm_head": pipelined["lm_head"], "blocks": blocks}


def pipeline_shardings(llama_shardings: Any, mesh: Mesh) -> dict[str, Any]:
  """Shardings of the pipeline layout from the unpipelined model's (an nnx.State of
  NamedSharding): block parameters gain (pipe, None) in front."""
  pure = llama_shardings.to_pure_dict() if hasattr(llama_shardings, "to_pure_dict") else llama_shardings
  stage = lambda s: NamedSharding(mesh, P("pipe", None, *s.spec))
  return {"embed": pure["embed"], "final_norm": pure["final_norm"], "lm_head": pure["lm_head"],
          "blocks": jax.tree.map(stage, pure["blocks"][0])}


def relayout_state(state: Any, from_stages: int, to_stages: int, layers: int,
                   canonical_template: Any) -> Any:
  """A `TrainState` in the parameter layout of `from_stages` stages -> that of `to_stages` (1: the
  unpipelined model's nnx.State, built on `canonical_template`; S > 1: `split_blocks`'s stacked
  dict): the parameters and every parameter-shaped part of the optimizer state (AdamW's
  moments). Reshapes only; jit it with the target shardings."""
  params_def = jax.tree.structure(state.params)

  def convert(tree):
    pure = tree.to_pure_dict() if isinstance(tree, nnx.State) else tree
    canonical = join_blocks(pure) if from_stages > 1 else pure
    if to_stages > 1:
      return split_blocks(canonical, layers, to_stages)
    out = jax.tree.map(lambda x: x, canonical_template)
    nnx.replace_by_pure_dict(out, canonical)
    return out

  is_params = lambda node: jax.tree.structure(node) == params_def
  opt_state = jax.tree.map(lambda n: convert(n) if is_params(n) else n, state.opt_state,
                           is_leaf=is_params)
  return dataclasses.replace(state, params=convert(state.params), opt_state=opt_state)



# ----------------------------------------------------------------------------- device side


def _merge(graphdef, abstract_state, pure):
  state = jax.tree.map(lambda x: x, abstract_state)
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def _tick_barrier(*carry):
  """Ends a tick. Everything a later tick reads passes through here, so it becomes available only
  once this whole tick is computed: the compiler cannot move work between ticks of the unrolled
  schedule (it would, e.g., run every micro-batch's LM head early and keep all their logits
  alive at once)."""
  return jax.lax.optimization_barrier(carry)


class PipelinedLlama:
  """Loss and gradients of a `Llama` run as a pipeline (functional: parameters are the
  `split_blocks` layout, plain arrays).

  `model` is an (abstract) `Llama` built with the core attention and `constrain` to use; only its
  structure is read.
  """

  def __init__(self, model, mesh: Mesh, core_attention: Callable):
    self.mesh = mesh
    self.stages = mesh.shape["pipe"]
    self.layers = len(model.blocks)
    if self.layers % self.stages:
      raise ValueError(f"model.layers = {self.layers} is not a multiple of mesh.pipe = {self.stages}")
    self.per_stage = self.layers // self.stages
    self.block_def, self.block_state = nnx.split(model.blocks[0], nnx.Param)
    self.norm_def, self.norm_state = nnx.split(model.final_norm, nnx.Param)
    self.dtype = model.dtype
    self.core_attention = core_attention
    row_spec = P("pipe", "data")
    S = self.stages
    self._send_forward = jax.shard_map(
        lambda x: jax.lax.ppermute(x, "pipe", [(i, (i + 1) % S) for i in range(S)]),
        mesh=mesh, in_specs=row_spec, out_specs=row_spec, check_vma=False)
    self._send_backward = jax.shard_map(
        lambda x: jax.lax.ppermute(x, "pipe", [((i + 1) % S, i) for i in range(S)]),
        mesh=mesh, in_specs=row_spec, out_specs=row_spec, check_vma=False)

  # One decoder layer of every stage at once: x [S, B, T, D], block params [S, ...]. With
  # ping-pong (`attn_ctx` a (Ping, Pong) tuple) each row is Ping's half then Pong's: both
  # streams' projections first, then each stream's core attention (Pong's reading Ping's K/V of
  # the document cut between them, `prior_kv`), so one stream's exchange has the other's work
  # beside it, as in the unpipelined model (`Attention.core`).
  def _layer(self, block_SxP, x_SxBxTxD, pos_SxBxT, attn_ctx):
    S, B = x_SxBxTxD.shape[:2]
    block = functools.partial(_merge, self.block_def, self.block_state)
    per_stage = functools.partial(jax.vmap, spmd_axis_name="pipe")
    ctxs = attn_ctx if isinstance(attn_ctx, tuple) else (attn_ctx,)
    xs = jnp.split(x_SxBxTxD, len(ctxs), axis=2)
    poss = jnp.split(pos_SxBxT, len(ctxs), axis=2)
    rows = lambda a: a.reshape((S * B,) + a.shape[2:])
    project = per_stage(lambda p, x, pos: block(p).attention_inputs(x, pos))
    qkv = [tuple(rows(a) for a in project(block_SxP, x, pos)) for x, pos in zip(xs, poss)]
    outs = [self.core_attention(*qkv[i], ctx) if i == 0 else
            self.core_attention(*qkv[i], ctx, prior_kv=qkv[i - 1][1:])
            for i, ctx in enumerate(ctxs)]
    finish = per_stage(lambda p, x, o: (b := block(p)).finish(x, b.attn.output(o)))
    ys = [finish(block_SxP, x, o.reshape((S, B) + o.shape[1:])) for x, o in zip(xs, outs)]
    return ys[0] if len(ys) == 1 else jnp.concatenate(ys, axis=2)

  def stage_forward(self, blocks, x_SxBxTxD, pos_SxBxT, attn_ctx):
    """Every stage's L/S blocks on its own input: [S, B, T, D] -> the input of each block and the
    stage output (a forward tick: nothing is differentiated, nothing but the block inputs is
    kept)."""
    block_inputs = []
    for i in range(self.per_stage):
      block_inputs.append(x_SxBxTxD)
      x_SxBxTxD = self._layer(jax.tree.map(lambda a: a[:, i], blocks), x_SxBxTxD, pos_SxBxT, attn_ctx)
    return tuple(block_inputs), x_SxBxTxD

  def stage_backward(self, blocks, block_inputs, dy_SxBxTxD, pos_SxBxT, attn_ctx, grads_blocks):
    """A backward tick: each block, last first, recomputed from its saved input and
    differentiated (one forward and one backward per block, as under full remat). Returns the
    gradient of the stage input and `grads_blocks` with this tick's gradients added."""
    for i in reversed(range(self.per_stage)):
      params_i = jax.tree.map(lambda a: a[:, i], blocks)
      _, vjp = jax.vjp(lambda b, x: self._layer(b, x, pos_SxBxT, attn_ctx), params_i, block_inputs[i])
      g_i, dy_SxBxTxD = vjp(dy_SxBxTxD)
      grads_blocks = jax.tree.map(lambda G, g: G.at[:, i].add(g), grads_blocks, g_i)
    return dy_SxBxTxD, grads_blocks

  def _head(self, head, acc, h_BxTxD, targets_BxT, mask_BxT, scale):
    """Final norm, LM head and cross-entropy of some tokens: (loss * scale, gradient of h, `acc`
    with the head's parameter gradients added chunk by chunk, in place)."""
    norm = lambda p, h: _merge(self.norm_def, self.norm_state, p)(h)
    h_normed, norm_vjp = jax.vjp(norm, head["final_norm"], h_BxTxD)
    loss, dh_normed, acc_w = cross_entropy_and_grads(
        h_normed, head["lm_head"], targets_BxT, mask_BxT, scale, acc["lm_head"])
    g_norm, dh = norm_vjp(dh_normed)
    return loss, dh, {"final_norm": jax.tree.map(jnp.add, acc["final_norm"], g_norm), "lm_head": acc_w}

  def _head_all_stages(self, head, acc_S, h_BxTxD, targets_BxT, mask_BxT, scale):
    """The LM head of the last stage's output, its tokens split over the S stages' devices (the
    head of a 128K vocabulary costs as much as several decoder blocks; on the last stage alone it
    would leave every other stage waiting at the tick barrier). `acc_S`: per-stage gradient
    accumulators [S, ...], sharded over `pipe`, summed once at the end of the step."""
    S = self.stages
    B, T = targets_BxT.shape
    by_stage = lambda a: self._on_stages(a.reshape((B, S, T // S) + a.shape[2:]).swapaxes(0, 1))
    per_stage = jax.vmap(lambda acc, h, t, m: self._head(head, acc, h, t, m, scale),
                         spmd_axis_name="pipe")
    loss_S, dh_S, acc_S = per_stage(acc_S, by_stage(h_BxTxD), by_stage(targets_BxT), by_stage(mask_BxT))
    return jnp.sum(loss_S), dh_S.swapaxes(0, 1).reshape(h_BxTxD.shape), acc_S

  def _on_stages(self, x):
    """`x` [S, ...] laid out one slice per pipeline stage."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P("pipe")))

  def value_and_grad(self, params, arrays, forward_ctx, backward_ctx, schedule: Schedule):
    """(mean loss over real tokens, token count), gradients — the same values as
    `jax.value_and_grad` of the unpipelined model's loss."""
    S, M = self.stages, schedule.microbatches
    tokens, targets, masks = arrays["tokens"], arrays["targets"], arrays["loss_mask"]
    count = jnp.sum(masks)
    norm = 1.0 / jnp.maximum(count, 1.0)
    stage_id = jnp.arange(S).reshape(S, 1, 1, 1)
    hidden = params["embed"].shape[1]
    pick = lambda ctx, t: jax.tree.map(lambda a: a[t], ctx)
    head = {"final_norm": params["final_norm"], "lm_head": params["lm_head"]}

    grads = jax.tree.map(jnp.zeros_like, {k: v for k, v in params.items() if k in ("embed", "blocks")})
    head_acc = jax.tree.map(lambda a: self._on_stages(jnp.zeros((S,) + a.shape, a.dtype)), head)
    loss = jnp.zeros((), jnp.float32)
    inputs: dict[int, tuple[jax.Array, ...]] = {}  # forward tick -> every stage's block inputs
    last_out: dict[int, jax.Array] = {}    # micro-batch -> last stage's output
    y = None                               # the previous forward tick's outputs
    dx = None                              # the previous backward tick's input gradients
    for kind, t in schedule.ticks:
      if kind == "F":
        with jax.named_scope(f"pipeline_forward_{t}"):
          first = (jnp.take(params["embed"], tokens[t], axis=0).astype(self.dtype) if t < M
                   else jnp.zeros(tokens.shape[1:] + (hidden,), self.dtype))
          from_prev = jnp.zeros_like(first)[None] if y is None else self._send_forward(y)
          x = jnp.where(stage_id == 0, first[None], from_prev)
          inputs[t], y = self.stage_forward(params["blocks"], x, arrays["forward_positions"][t],
                                            pick(forward_ctx, t))
          m_last = schedule.forward_mb(t, S - 1)
          if m_last is not None:
            last_out[m_last] = y[S - 1]
        y, dx, grads, head_acc, loss, inputs, last_out = _tick_barrier(
            y, dx, grads, head_acc, loss, inputs, last_out)
        continue
      with jax.named_scope(f"pipeline_backward_{t}"):
        # Cotangent of every stage's output: the loss gradient for the last stage, the next
        # stage's input gradient (sent back) for the others.
        m_last = schedule.backward_mb(t, S - 1)
        if m_last is not None:
          l, dy_last, head_acc = self._head_all_stages(head, head_acc, last_out.pop(m_last),
                                                       targets[m_last], masks[m_last], norm)
          loss = loss + l
        else:
          dy_last = jnp.zeros(y.shape[1:], y.dtype)
        back = jnp.zeros_like(y) if dx is None else self._send_backward(dx)
        dy = jnp.where(stage_id == S - 1, dy_last[None].astype(y.dtype), back)
        # Each stage's saved block inputs: stage s runs micro-batch m, forwarded at tick m + s.
        saved = [jnp.zeros_like(y)] * self.per_stage
        for s in range(S):
          m = schedule.backward_mb(t, s)
          if m is not None:
            tick_inputs = inputs[schedule.forward_tick_of(m, s)]
            saved = [jnp.where(stage_id == s, a, b) for a, b in zip(tick_inputs, saved)]
            if s == 0:
              del inputs[m]  # the first stage is the last to need forward tick m's inputs
        dx, grads["blocks"] = self.stage_backward(
            params["blocks"], saved, dy, arrays["backward_positions"][t], pick(backward_ctx, t),
            grads["blocks"])
        m_first = schedule.backward_mb(t, 0)
        if m_first is not None:  # embedding gradient, scattered into the accumulator in place
          grads["embed"] = grads["embed"].at[tokens[m_first].reshape(-1)].add(
              dx[0].reshape(-1, hidden).astype(grads["embed"].dtype))
      y, dx, grads, head_acc, loss, inputs, last_out = _tick_barrier(
          y, dx, grads, head_acc, loss, inputs, last_out)
    grads.update(jax.tree.map(lambda a: jnp.sum(a, axis=0), head_acc))
    return (loss, count), grads
