"""Shared test utilities: small configs, an independent plain-jnp Llama, parameter access, the
launch scripts as modules."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from distca_jax.config import load_config


def launch_script(name: str):
  """launch/<name>.py, or the investigation tool launch/tools/<name>.py, as a module (launch/ is
  scripts, not a package)."""
  launch = Path(__file__).resolve().parents[1] / "launch"
  path = launch / f"{name}.py"
  if not path.exists():
    path = launch / "tools" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"launch_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def small_config(*overrides: str):
  # gate off, min_imbalance=1: distca's exchange runs on every layout, however balanced (tests
  # that check the gates set them themselves).
  base = ["model.dtype=float32", "model.remat=none", "data.tokens_per_device=256",
          "data.length_scale=16", "train.progress=false", "train.tensorboard=false",
          "attention.gate=false", "attention.min_imbalance=1.0"]
  return load_config(None, base + list(overrides))


def pure_params(state) -> dict:
  """nnx.State -> nested dict of arrays."""
  from flax import nnx

  return nnx.to_pure_dict(state)


def reference_hidden(p: dict, shape, tokens_flat: np.ndarray, positions_flat: np.ndarray,
                     segments_flat: np.ndarray, eps: float = 1e-5) -> jnp.ndarray:
  """Plain-jnp Llama forward over the flat token stream, attention computed document by document
  with explicit slicing (independent of task tables, windows and meshes). Returns [S, D]."""
  H, K, E = shape.heads, shape.kv_heads, shape.head_dim
  x = jnp.asarray(p["embed"])[tokens_flat]

  def norm(x, scale):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale

  def rot(x, pos):
    inv = shape.rope_theta ** (-np.arange(0, E, 2) / E)
    ang = pos[:, None, None] * inv
    x1, x2 = x[..., : E // 2], x[..., E // 2:]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)

  # Document boundaries in the flat stream.
  bounds = []
  start = 0
  for i in range(1, len(segments_flat) + 1):
    if i == len(segments_flat) or segments_flat[i] != segments_flat[start]:
      if segments_flat[start] >= 0:
        bounds.append((start, i))
      start = i
  for blk in p["blocks"].values() if isinstance(p["blocks"], dict) else p["blocks"]:
    a = blk["attn"]
    h = norm(x, blk["attn_norm"]["scale"])
    q = rot(jnp.einsum("sd,dhe->she", h, a["wq"]), positions_flat)
    k = rot(jnp.einsum("sd,dke->ske", h, a["wk"]), positions_flat)
    v = jnp.einsum("sd,dke->ske", h, a["wv"])
    o = jnp.zeros_like(q)
    for s, e in bounds:
      qd = q[s:e].reshape(e - s, K, H // K, E)
      sc = jnp.einsum("tkge,ske->kgts", qd, k[s:e]) / np.sqrt(E)
      causal = np.tril(np.ones((e - s, e - s), bool))
      sc = jnp.where(causal, sc, -jnp.inf)
      od = jnp.einsum("kgts,ske->tkge", jax.nn.softmax(sc, -1), v[s:e]).reshape(e - s, H, E)
      o = o.at[s:e].set(od)
    x = x + jnp.einsum("she,hed->sd", o, a["wo"])
    m = blk["mlp"]
    h = norm(x, blk["mlp_norm"]["scale"])
    x = x + (jax.nn.silu(h @ m["w_gate"]) * (h @ m["w_up"])) @ m["w_down"]
  return norm(x, p["final_norm"]["scale"])


def reference_loss(p, shape, batch) -> jnp.ndarray:
  h = reference_hidden(p, shape, batch.tokens.reshape(-1), batch.positions.reshape(-1),
                       batch.segment_ids.reshape(-1))
  logits = h @ p["lm_head"]
  logp = jax.nn.log_softmax(logits, -1)
  picked = jnp.take_along_axis(logp, batch.targets.reshape(-1)[:, None], -1)[:, 0]
  mask = batch.loss_mask.reshape(-1)
  return -jnp.sum(picked * mask) / jnp.maximum(mask.sum(), 1.0)


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def tree_rel_err(a, b) -> float:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  num = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)) for x, y in zip(la, lb))
  den = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in lb)
  return float(np.sqrt(num / max(den, 1e-30)))


def reference_value_and_grad(params, shape, batch):
  """Jitted (loss, grads) of `reference_loss` on one batch (the batch is a trace-time constant:
  its documents unroll into the traced program, the same arithmetic as eager, far faster)."""
  return jax.jit(jax.value_and_grad(lambda p: reference_loss(p, shape, batch)))(params)
