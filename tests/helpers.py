"""Shared test utilities: small configs, an independent plain-jnp Llama, parameter access, the
launch scripts as modules, and the dispatch arrays' numpy specification (`simulate_dispatch`)."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from distca_jax import dispatch
from distca_jax import gate as gate_lib
from distca_jax.config import load_config
from distca_jax.data.sources import make_batch, synthetic_from_config
from distca_jax.schedule.plan import make_plan


def child_env(**extra: str) -> dict[str, str]:
  """The environment of a process a test starts: on the CPU, with the suite's compile flags
  (tests/conftest.py) but not its device count (the script sets its own)."""
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=os.environ.get("DISTCA_TEST_XLA_FLAGS", ""), **extra)


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


def dense_reference_value_and_grad(params, shape, batch):
  """(loss, grads) of `reference_loss` on one batch with attention as one dense [S, S] product
  masked to causal pairs of one document (a contiguous run of one segment id in the flat stream,
  as `reference_hidden` slices them). The batch's arrays are arguments, not constants: batches of
  one size share one compiled program, however their documents fall."""
  seg_S = batch.segment_ids.reshape(-1)
  run_S = np.cumsum(np.r_[True, seg_S[1:] != seg_S[:-1]]) - 1
  flat = lambda a: jnp.asarray(a.reshape(-1))
  return _dense_value_and_grad(params, shape, flat(batch.tokens), flat(batch.positions),
                               jnp.asarray(np.where(seg_S >= 0, run_S, -1)), flat(batch.targets),
                               flat(batch.loss_mask))


@functools.partial(jax.jit, static_argnums=1)
def _dense_value_and_grad(params, shape, tokens_S, positions_S, run_S, targets_S, mask_S,
                          eps: float = 1e-5):
  H, K, E = shape.heads, shape.kv_heads, shape.head_dim
  S = tokens_S.shape[0]
  # Padding rows (run -1) attend to themselves alone (no NaN row), and their output is zeroed.
  mask_SxS = (((run_S[:, None] == run_S[None, :]) & (run_S[:, None] >= 0)) | jnp.eye(S, dtype=bool))
  mask_SxS &= jnp.tril(jnp.ones((S, S), bool))
  norm = lambda x, scale: x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale

  def rot(x):
    ang = positions_S[:, None, None] * shape.rope_theta ** (-np.arange(0, E, 2) / E)
    x1, x2 = x[..., : E // 2], x[..., E // 2:]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang),
                            x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)

  def loss(p):
    x = p["embed"][tokens_S]
    for blk in p["blocks"].values() if isinstance(p["blocks"], dict) else p["blocks"]:
      a, m = blk["attn"], blk["mlp"]
      h = norm(x, blk["attn_norm"]["scale"])
      q = rot(jnp.einsum("sd,dhe->she", h, a["wq"])).reshape(S, K, H // K, E)
      k, v = rot(jnp.einsum("sd,dke->ske", h, a["wk"])), jnp.einsum("sd,dke->ske", h, a["wv"])
      logits = jnp.where(mask_SxS, jnp.einsum("tkge,ske->kgts", q, k) / np.sqrt(E), -jnp.inf)
      o = jnp.einsum("kgts,ske->tkge", jax.nn.softmax(logits, -1), v).reshape(S, H, E)
      x = x + jnp.einsum("she,hed->sd", jnp.where((run_S >= 0)[:, None, None], o, 0.0), a["wo"])
      h = norm(x, blk["mlp_norm"]["scale"])
      x = x + (jax.nn.silu(h @ m["w_gate"]) * (h @ m["w_up"])) @ m["w_down"]
    logp = jax.nn.log_softmax(norm(x, p["final_norm"]["scale"]) @ p["lm_head"], -1)
    picked = jnp.take_along_axis(logp, targets_S[:, None], -1)[:, 0]
    return -jnp.sum(picked * mask_S) / jnp.maximum(mask_S.sum(), 1.0)

  return jax.value_and_grad(loss)(params)


# ----------------------------------------------------------------------------- dispatch spec


def _attention_np(q_TxHxD, k_SxKxD, v_SxKxD):
  """Bottom-right causal attention of one task, float64 numpy; GQA (head h reads h // (H/K))."""
  t, h, dim = q_TxHxD.shape
  s, kh, _ = k_SxKxD.shape
  k = np.repeat(k_SxKxD, h // kh, axis=1)
  v = np.repeat(v_SxKxD, h // kh, axis=1)
  logits = np.einsum("thd,shd->hts", q_TxHxD, k) / np.sqrt(dim)
  mask = np.arange(s)[None, :] <= (s - t + np.arange(t))[:, None]
  logits = np.where(mask[None], logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("hts,shd->thd", p, v)


def simulate_exchange(send_NxS, count_NxN, recv_rows: int):
  """numpy: the packed receive buffers [N, recv_rows, ...] an exchange makes of the packed send
  buffers `send_NxS` when device d sends count[d, s] rows to s (the format's definition, a loop
  over pairs: independent of the offsets the plan carries)."""
  n = count_NxN.shape[0]
  out = np.zeros((n, recv_rows) + send_NxS.shape[2:], send_NxS.dtype)
  for s in range(n):
    at = 0
    for d in range(n):
      c = int(count_NxN[d, s])
      start = int(count_NxN[d, :s].sum())
      out[s, at:at + c] = send_NxS[d, start:start + c]
      at += c
  return out


def simulate_dispatch(plan, layout, heads: int = 2, kv_heads: int = 1, head_dim: int = 8,
                      seed: int = 0) -> float:
  """Runs a `DispatchPlan`'s data movement in numpy and returns the max |error| against direct
  attention: the executable specification of the arrays training runs.

  Random q [N, T, H, D] and k, v [N, T, K, D] per home buffer; per device: the local rows and the
  packed send buffer gathered (padding zeroed); the exchange (server s receives d's rows for it,
  in order of d, `simulate_exchange`); with relays a second K/V round, each relay's rows gathered
  from its [local T | round-1 Rkv] rows; the server's K/V gather over [local T | Rkv | Rkv2];
  reference attention per task of its table; the reverse exchange back into the send slots; each
  returned row written to its home row, over the local rows' outputs in place. The reference is
  per-document causal attention computed from the layout alone (each document's rows
  concatenated in position order). A plan that writes a padding row, misses a real one or writes
  one twice returns inf."""
  if layout.prior is not None:
    raise ValueError("simulate_dispatch: a layout with prior shards reads another stream's K/V")
  n, t = layout.num_buffers, layout.buffer_len
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((n, t, heads, head_dim))
  k = rng.standard_normal((n, t, kv_heads, head_dim))
  v = rng.standard_normal((n, t, kv_heads, head_dim))
  home = np.arange(n)[:, None]
  keep = lambda valid, x: np.where(valid.reshape(valid.shape + (1, 1)), x, 0.0)
  server_q = np.concatenate(
      [keep(plan.local_q_valid, q),
       simulate_exchange(keep(plan.q.send_valid, q[home, plan.q.send_idx]), plan.q.send_count,
                         plan.q.recv_rows)], axis=1)

  def kv_rows(x):  # [local T | round 1 | round 2]: a relay forwards from its [local | round 1]
    for r in (plan.kv, plan.kv2):
      sent = keep(r.send_valid, x[home, r.send_idx])
      x = np.concatenate([x, simulate_exchange(sent, r.send_count, r.recv_rows)], axis=1)
    return x

  server_kv = [keep(plan.server_kv_valid, kv_rows(x)[home, plan.server_kv_idx]) for x in (k, v)]
  out = np.zeros_like(server_q)
  for s in range(n):
    for j in range(plan.q_start.shape[-1]):
      qs, ql, ks, kl = (int(x[s, j]) for x in (plan.q_start, plan.q_len, plan.kv_start, plan.kv_len))
      if ql:
        out[s, qs:qs + ql] = _attention_np(server_q[s, qs:qs + ql], server_kv[0][s, ks:ks + kl],
                                           server_kv[1][s, ks:ks + kl])
  back = simulate_exchange(out[:, t:], plan.q.recv_count, plan.q.send_rows)
  got = keep(plan.local_q_valid, out[:, :t])
  written = plan.local_q_valid.astype(np.int64)
  for d in range(n):
    slots = np.flatnonzero(plan.q.send_valid[d])
    got[d, plan.q.send_idx[d, slots]] = back[d, slots]
    np.add.at(written[d], plan.q.send_idx[d, slots], 1)
  seg, pos = layout.segment_ids(), layout.positions()
  want = np.zeros_like(got)
  for g in range(np.asarray(layout.doc_lens).size):
    dd, rr = np.nonzero(seg == g)
    o = np.argsort(pos[dd, rr], kind="stable")
    dd, rr = dd[o], rr[o]
    want[dd, rr] = _attention_np(q[dd, rr], k[dd, rr], v[dd, rr])
  if (written != (seg >= 0)).any():
    return float("inf")
  return float(np.abs(got - want).max(initial=0.0))


def dispatch_of(plan, layout):
  """The `DispatchPlan` of a scheduler plan (its tasks at its capacities, tiled exchange)."""
  from distca_jax.dispatch import build_dispatch

  return build_dispatch(plan.tasks, layout, plan.capacities)


# ----------------------------------------------------------------------------- CAD steps in tests


def layout_batch(kind: str, n: int, seed: int, T: int = 256):
  """A batch of `n` buffers of T tokens whose documents are laid out as `kind` says."""
  rng = np.random.default_rng(seed)
  total = n * T
  if kind == "span_all":      # one document spanning every device
    lens = np.array([total - 37, 37])
  elif kind == "long_on_one":  # device 0 holds all the long documents, the rest many short ones
    lens = np.concatenate([[T // 2, T // 2], np.full((total - T) // 16, 16)])
  elif kind == "wide_prefix":  # one document over buffers 0 and 1, short ones elsewhere: the
    # planner spreads its second shard's queries, so many servers need buffer 0's K/V
    lens = np.concatenate([[2 * T], np.full((total - 2 * T) // 16, 16)])
  elif kind == "equal":        # nothing to balance
    lens = np.full(total // 64, 64)
  else:
    raise ValueError(kind)
  return make_batch(lens, rng.integers(0, 512, lens.sum()).astype(np.int32), n, T)


def run_step(cfg, batch, n, shapes=None):
  """(loss, grads, params, model shape, host context) of one step of `cfg` on `n` devices."""
  from distca_jax import attention as attn
  from distca_jax import mesh as mesh_lib
  from distca_jax.train.step import Trainer

  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:n])
  trainer = Trainer(cfg, mesh)
  state = trainer.init_state(0)
  ctx = attn.host_context(cfg.attention, batch, trainer.shape, shapes=shapes)
  arrays, dctx = trainer.put_batch(batch, ctx)
  (loss, _), grads = jax.jit(jax.value_and_grad(trainer.loss_fn, has_aux=True))(state.params, arrays, dctx)
  return float(loss), pure_params(grads), pure_params(state.params), trainer.shape, ctx


# Batches of at most this many tokens take the dense reference: one program per size, where the
# slicing reference unrolls every document (a batch of 16-token documents compiles for a minute).
DENSE_REFERENCE_TOKENS = 4096


def reference_over(params, shape, batches):
  """Token-weighted mean loss over nano-batches, single-device plain jnp."""
  counts = [float(b.loss_mask.sum()) for b in batches]
  outs = [(dense_reference_value_and_grad if b.tokens.size <= DENSE_REFERENCE_TOKENS
           else reference_value_and_grad)(params, shape, b) for b in batches]
  loss = sum(l * c for (l, _), c in zip(outs, counts)) / sum(counts)
  grads = jax.tree.map(lambda *g: sum(x * c for x, c in zip(g, counts)) / sum(counts), *[g for _, g in outs])
  return float(loss), grads


def plan_for_layout(attention_config, layout, shape, devices=None):
  """The scheduler's plan of one nano-batch and its checked dispatch arrays at the plan's own
  capacities (tiled exchange), planned as the trainer plans an unpipelined stream."""
  plan = make_plan(layout, gate_lib.comm_model(shape, attention_config),
                   epsilon=attention_config.epsilon,
                   min_imbalance=attention_config.min_imbalance_for(pipelined=False))
  d = dispatch.build_dispatch(plan.tasks, layout, plan.capacities, devices=devices)
  dispatch.validate_plan(d, layout, devices)
  return plan, d


def prefer_streams(monkeypatch, streams: int):
  """Make the gate's model prefer `streams` streams where a step may run one or two (a ping-pong
  split that cuts a document longer than half the step)."""
  real = gate_lib.predicted_cad_saving  # (a bonus larger than any gap between the two options)
  monkeypatch.setattr(gate_lib, "predicted_cad_saving", lambda shape, layout, plans, *a:
                      real(shape, layout, plans, *a) + (100.0 if len(plans) == streams else 0.0))


def global_plan(n: int, dist: str, T: int = 256):
  """(batch, the scheduler's global plan) of the sampler's first batch of `dist` over `n` data
  ranks, planned as the trainer plans it (no arrays)."""
  from distca_jax.models.presets import resolve

  cfg = small_config(f"mesh.data={n}", f"data.tokens_per_device={T}", "attention.impl=distca",
                     f"data.distribution={dist}")
  batch = synthetic_from_config(cfg.data, 512, n).batch(0)
  comm = gate_lib.comm_model(resolve(cfg.model), cfg.attention)
  return batch, make_plan(batch.layout, comm, epsilon=cfg.attention.epsilon)



# ----------------------------------------------------------------------------- Hugging Face side
# Written from transformers' Llama / Qwen2 definitions, independently of models/hf.py:
# tensor names, nn.Linear's [out, in] weights, rotate-half RoPE with cos/sin scaled by the
# attention factor, repeat_kv's grouping (query head h reads key/value head h // (H / K)).

HF_TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96,
               hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=96, rms_norm_eps=1e-5, rope_theta=10_000.0,
               tie_word_embeddings=False, hidden_act="silu", max_position_embeddings=256,
               torch_dtype="float32")


def hf_tensors(cfg: dict, seed: int = 0, dtype=np.float32) -> dict:
  """Random parameters of `cfg` under Hugging Face's names and layouts."""
  rng = np.random.default_rng(seed)
  D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
  H, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  E = cfg.get("head_dim") or D // H
  r = lambda *s, scale=1.0: (rng.standard_normal(s) * scale).astype(dtype)
  t = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": 1 + r(D, scale=0.1)}
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    t.update({p + "input_layernorm.weight": 1 + r(D, scale=0.1),
              p + "post_attention_layernorm.weight": 1 + r(D, scale=0.1),
              p + "self_attn.q_proj.weight": r(H * E, D, scale=D ** -0.5),
              p + "self_attn.k_proj.weight": r(K * E, D, scale=D ** -0.5),
              p + "self_attn.v_proj.weight": r(K * E, D, scale=D ** -0.5),
              p + "self_attn.o_proj.weight": r(D, H * E, scale=(H * E) ** -0.5),
              p + "mlp.gate_proj.weight": r(F, D, scale=D ** -0.5),
              p + "mlp.up_proj.weight": r(F, D, scale=D ** -0.5),
              p + "mlp.down_proj.weight": r(D, F, scale=F ** -0.5)})
    if cfg["architectures"] == ["Qwen2ForCausalLM"]:
      t.update({p + "self_attn.q_proj.bias": r(H * E, scale=0.5),
                p + "self_attn.k_proj.bias": r(K * E, scale=0.5),
                p + "self_attn.v_proj.bias": r(K * E, scale=0.5)})
  if not cfg.get("tie_word_embeddings"):
    t["lm_head.weight"] = r(V, D, scale=D ** -0.5)
  return t


def write_hf_checkpoint(path, cfg: dict, tensors: dict, shards: int = 1) -> None:
  """config.json and model.safetensors, or `shards` files with model.safetensors.index.json."""
  import json
  from safetensors.numpy import save_file

  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(cfg))
  if shards == 1:
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return
  names = sorted(tensors)
  weight_map = {}
  for i in range(shards):
    file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: tensors[n] for n in names[i::shards]}
    save_file(part, str(path / file), metadata={"format": "pt"})
    weight_map.update({n: file for n in part})
  (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def hf_inv_freq(cfg: dict) -> tuple[np.ndarray, float]:
  """(inverse frequencies, attention factor) by the published formulas: plain RoPE, linear,
  Meta's Llama 3.1 `apply_scaling` (a loop over frequencies), and YaRN's reference
  implementation (correction dims rounded outwards, a linear ramp over dimensions)."""
  import math

  E = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
  base = cfg["rope_theta"]
  freqs = [1.0 / base ** (2 * i / E) for i in range(E // 2)]
  rs = cfg.get("rope_scaling") or {"rope_type": "default"}
  kind = rs["rope_type"]
  if kind == "linear":
    return np.array([f / rs["factor"] for f in freqs]), 1.0
  if kind == "llama3":
    old, lo, hi, s = (rs["original_max_position_embeddings"], rs["low_freq_factor"],
                      rs["high_freq_factor"], rs["factor"])
    out = []
    for f in freqs:
      wavelen = 2 * math.pi / f
      if wavelen < old / hi:
        out.append(f)
      elif wavelen > old / lo:
        out.append(f / s)
      else:
        smooth = (old / wavelen - lo) / (hi - lo)
        out.append((1 - smooth) * f / s + smooth * f)
    return np.array(out), 1.0
  if kind == "yarn":
    s, L = rs["factor"], rs["original_max_position_embeddings"]
    dim_of = lambda rot: E * math.log(L / (rot * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(dim_of(rs.get("beta_fast", 32))), 0)
    high = min(math.ceil(dim_of(rs.get("beta_slow", 1))), E - 1)
    out = []
    for i, f in enumerate(freqs):
      ramp = min(max((i - low) / (high - low), 0.0), 1.0)
      out.append(f / s * ramp + f * (1 - ramp))
    return np.array(out), rs.get("attention_factor", 0.1 * math.log(s) + 1.0)
  return np.array(freqs), 1.0


def hf_logits(t: dict, cfg: dict, tokens: np.ndarray) -> np.ndarray:
  """[T, V] float64 logits of one document (positions 0..T-1), transformers' equations in numpy."""
  w = {k: np.asarray(v, np.float64) for k, v in t.items()}
  D, H, K = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
  E, T, eps = cfg.get("head_dim") or D // H, len(tokens), cfg["rms_norm_eps"]
  inv, attn_factor = hf_inv_freq(cfg)
  emb = np.concatenate([np.outer(np.arange(T), inv)] * 2, -1)  # [T, E]
  cos, sin = np.cos(emb) * attn_factor, np.sin(emb) * attn_factor

  def norm(x, g):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g

  def linear(x, name):
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y

  def rotate(x):  # [n, T, E]
    return x * cos + np.concatenate([-x[..., E // 2:], x[..., :E // 2]], -1) * sin

  x = w["model.embed_tokens.weight"][tokens]
  mask = np.triu(np.full((T, T), -np.inf), 1)
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = norm(x, w[p + "input_layernorm.weight"])
    q = rotate(linear(h, p + "self_attn.q_proj").reshape(T, H, E).transpose(1, 0, 2))
    k = rotate(linear(h, p + "self_attn.k_proj").reshape(T, K, E).transpose(1, 0, 2))
    v = linear(h, p + "self_attn.v_proj").reshape(T, K, E).transpose(1, 0, 2)
    k, v = np.repeat(k, H // K, axis=0), np.repeat(v, H // K, axis=0)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(E) + mask
    s = np.exp(s - s.max(-1, keepdims=True))
    o = (s / s.sum(-1, keepdims=True)) @ v
    x = x + linear(o.transpose(1, 0, 2).reshape(T, H * E), p + "self_attn.o_proj")
    h = norm(x, w[p + "post_attention_layernorm.weight"])
    g = linear(h, p + "mlp.gate_proj")
    x = x + linear(g / (1 + np.exp(-g)) * linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
  x = norm(x, w["model.norm.weight"])
  head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
  return x @ head.T


def hf_batch_loss(t: dict, cfg: dict, batch) -> float:
  """Mean loss of a packed `Batch` by `hf_logits`: each document a run of one segment id in the
  flat stream (its buffers in order), its targets and mask the batch's."""
  seg, tokens = batch.segment_ids.reshape(-1), batch.tokens.reshape(-1)
  targets, mask = batch.targets.reshape(-1), batch.loss_mask.reshape(-1).astype(np.float64)
  total, start = 0.0, 0
  for end in [*np.flatnonzero(seg[1:] != seg[:-1]) + 1, len(seg)]:
    if seg[start] >= 0:
      logits = hf_logits(t, cfg, tokens[start:end])
      logp = logits - logits.max(-1, keepdims=True)
      logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
      total -= (logp[np.arange(end - start), targets[start:end]] * mask[start:end]).sum()
    start = end
  return total / mask.sum()


def hf_loss(t: dict, cfg: dict, doc_lens, tokens_flat: np.ndarray) -> float:
  """Mean next-token loss over documents (each from position 0; a document's last token has no
  target), by `hf_logits`."""
  total, count, start = 0.0, 0, 0
  for n in doc_lens:
    doc = tokens_flat[start:start + n]
    logits = hf_logits(t, cfg, doc)[:-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    total -= logp[np.arange(n - 1), doc[1:]].sum()
    count += n - 1
    start += n
  return total / count
