"""The model against an independent plain-jnp Llama, and its causality / document isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distca_jax import attention as attn
from distca_jax import mesh as mesh_lib
from distca_jax.data.sources import make_batch, synthetic_from_config
from distca_jax.models.presets import resolve
from distca_jax.train.step import Trainer
from helpers import (pure_params, reference_hidden, reference_loss, rel_err, small_config,
                     tree_rel_err)


def _one_device_trainer(cfg):
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1])
  return Trainer(cfg, mesh), mesh


def _hidden(trainer, params, batch):
  arrays, ctx = trainer.put_batch(batch, attn.host_context(trainer.config.attention, batch.layout))

  @jax.jit
  def forward(params, arrays, ctx):
    return nnx.merge(trainer.graphdef, params)(arrays["tokens"], arrays["positions"], ctx)

  return forward(params, arrays, ctx)


def test_forward_matches_plain_jnp_reference():
  cfg = small_config("mesh.data=1", "data.tokens_per_device=512")
  trainer, _ = _one_device_trainer(cfg)
  state = trainer.init_state(3)
  batch = synthetic_from_config(cfg.data, resolve(cfg.model).vocab_size, 1).batch(0)
  assert len(batch.layout.doc_lens) >= 3, "want several packed documents"
  h = _hidden(trainer, state.params, batch)
  ref = reference_hidden(pure_params(state.params), trainer.shape, batch.tokens.reshape(-1),
                         batch.positions.reshape(-1), batch.segment_ids.reshape(-1))
  assert rel_err(np.asarray(h).reshape(ref.shape), ref) < 1e-5


def test_gradient_isolation_causal_and_per_document():
  """d hidden[i] / d embedding[j] is zero for j > i and for j in another document."""
  cfg = small_config("mesh.data=1", "data.tokens_per_device=128")
  trainer, mesh = _one_device_trainer(cfg)
  state = trainer.init_state(0)
  batch = make_batch(np.array([40, 50, 38]), np.arange(128, dtype=np.int32) % 97, 1, 128)
  arrays, ctx = trainer.put_batch(batch, attn.host_context(cfg.attention, batch.layout))
  model = nnx.merge(trainer.graphdef, state.params)
  x = jnp.take(model.embed[...], arrays["tokens"], axis=0)
  seg = batch.segment_ids[0]
  hidden = lambda x: model.from_embeddings((x,), (arrays["positions"],), (ctx,))[0]
  # One compiled gradient for every probed token (i is traced).
  grad_fn = jax.jit(jax.grad(lambda x, i, probe: jnp.dot(hidden(x)[0, i], probe)))
  for i in (0, 39, 40, 65, 89, 90, 127):
    probe = jax.random.normal(jax.random.key(i), (trainer.shape.hidden,))
    g = grad_fn(x, i, probe)
    norms = np.linalg.norm(np.asarray(g[0]), axis=-1)
    allowed = (np.arange(128) <= i) & (seg == seg[i])
    assert np.all(norms[~allowed] == 0.0), f"token {i} depends on tokens it must not see"
    assert np.all(norms[allowed] > 0.0), f"token {i} ignores tokens it should see"


def test_rope_restarts_per_document():
  """A document's outputs do not depend on where in the buffer it is packed."""
  cfg = small_config("mesh.data=1", "data.tokens_per_device=128")
  trainer, _ = _one_device_trainer(cfg)
  state = trainer.init_state(1)
  rng = np.random.default_rng(0)
  doc = rng.integers(0, 512, 60).astype(np.int32)
  other = rng.integers(0, 512, 37).astype(np.int32)
  alone = make_batch(np.array([60]), doc, 1, 128)
  shifted = make_batch(np.array([37, 60]), np.concatenate([other, doc]), 1, 128)
  h_alone = np.asarray(_hidden(trainer, state.params, alone))[0, :60]
  h_shift = np.asarray(_hidden(trainer, state.params, shifted))[0, 37:97]
  assert rel_err(h_shift, h_alone) < 1e-5
  assert np.array_equal(shifted.positions[0, 37:97], np.arange(60))


def test_loss_matches_reference_on_one_device():
  cfg = small_config("mesh.data=1")
  trainer, _ = _one_device_trainer(cfg)
  state = trainer.init_state(0)
  batch = synthetic_from_config(cfg.data, 512, 1).batch(5)
  arrays, ctx = trainer.put_batch(batch, attn.host_context(cfg.attention, batch.layout))
  loss, _ = jax.jit(trainer.loss_fn)(state.params, arrays, ctx)
  assert abs(float(loss) - float(reference_loss(pure_params(state.params), trainer.shape, batch))) < 1e-5


def test_dense_reference_is_the_slicing_reference():
  """helpers' dense reference (one masked [S, S] attention, the batch as arguments) gives the loss
  and gradients of the document-by-document one, on a batch with a document over two buffers,
  several short ones and padding."""
  from helpers import dense_reference_value_and_grad, reference_value_and_grad

  cfg = small_config("mesh.data=1", "model.layers=2")
  trainer, _ = _one_device_trainer(cfg)
  params = pure_params(trainer.init_state(2).params)
  lens = np.array([150, 41, 30, 9])
  batch = make_batch(lens, np.random.default_rng(0).integers(0, 512, lens.sum()).astype(np.int32),
                     2, 128)
  seg = batch.segment_ids
  assert (seg < 0).any() and set(seg[0][seg[0] >= 0]) & set(seg[1])  # padding; a spanning document
  want_loss, want_grads = reference_value_and_grad(params, trainer.shape, batch)
  loss, grads = dense_reference_value_and_grad(params, trainer.shape, batch)
  assert abs(float(loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss))
  assert tree_rel_err(grads, want_grads) <= 1e-6


@pytest.mark.parametrize("T,chunk", [(96, 32), (80, 32)])  # several chunks; chunk not dividing T
def test_cross_entropy_and_grads_matches_autodiff(T, chunk):
  from distca_jax.train.loss import chunked_cross_entropy, cross_entropy_and_grads

  k = jax.random.split(jax.random.key(0), 4)
  h = jax.random.normal(k[0], (2, T, 16))
  w = jax.random.normal(k[1], (16, 50)) * 0.3
  t = jax.random.randint(k[2], (2, T), 0, 50)
  m = (jax.random.uniform(k[3], (2, T)) < 0.8).astype(jnp.float32)
  scale, acc = 0.37, jnp.full((16, 50), 0.5)
  # Plain autodiff (logits recomputed in the backward), not the fused path built on the function
  # under test.
  f = lambda h, w: chunked_cross_entropy(h, w, t, m, chunk=chunk, fuse_grad=False) * scale
  loss, (dh, dw) = jax.value_and_grad(f, argnums=(0, 1))(h, w)
  got_loss, got_dh, got_acc = cross_entropy_and_grads(h, w, t, m, scale, acc, chunk=chunk)
  assert rel_err(got_loss, loss) < 1e-6
  assert rel_err(got_dh, dh) < 1e-6
  assert rel_err(got_acc, acc + dw) < 1e-6


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_fused_cross_entropy_matches_autodiff_and_dense_reference(dtype, tol):
  """The loss whose forward computes its gradients: value and gradients against autodiff of the
  recomputing loss and of a dense one ([T, V] logits at once), with a scale inside and an
  upstream cotangent other than 1."""
  from distca_jax.train.loss import chunked_cross_entropy

  k = jax.random.split(jax.random.key(1), 4)
  h = jax.random.normal(k[0], (2, 96, 16)).astype(dtype)
  w = jax.random.normal(k[1], (16, 50)) * 0.3
  t = jax.random.randint(k[2], (2, 96), 0, 50)
  m = (jax.random.uniform(k[3], (2, 96)) < 0.8).astype(jnp.float32)

  def dense(h, w):
    logits = jnp.einsum("btd,dv->btv", h.astype(jnp.float32), w)
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, t[..., None], -1)[..., 0]
    return jnp.sum(nll * m) * 0.37

  grad = lambda f: jax.jit(jax.value_and_grad(lambda h, w: 3.0 * f(h, w), argnums=(0, 1)))
  fused = grad(lambda h, w: chunked_cross_entropy(h, w, t, m, chunk=32, scale=0.37))(h, w)
  plain = grad(lambda h, w: chunked_cross_entropy(h, w, t, m, chunk=32, scale=0.37,
                                                  fuse_grad=False))(h, w)
  ref = grad(dense)(h, w)
  for want in (plain, ref):
    assert rel_err(fused[0], want[0]) < tol
    assert rel_err(np.asarray(fused[1][0], np.float32), np.asarray(want[1][0], np.float32)) < tol
    assert rel_err(fused[1][1], want[1][1]) < tol
  assert fused[1][0].dtype == dtype and fused[1][1].dtype == jnp.float32


def _grad_of_policy(remat, layers=1):
  cfg = small_config("mesh.data=1", f"model.remat={remat}", f"model.layers={layers}")
  trainer, _ = _one_device_trainer(cfg)
  state = trainer.init_state(0)
  batch = synthetic_from_config(cfg.data, resolve(cfg.model).vocab_size, 1).batch(0)
  arrays, ctx = trainer.put_batch(batch, attn.host_context(cfg.attention, batch.layout))
  f = jax.jit(jax.grad(lambda p: trainer.loss_fn(p, arrays, ctx)[0]))
  return f(state.params), f.lower(state.params).as_text()


def test_remat_policies_same_gradients_and_what_they_recompute():
  """Every policy gives the gradients of no remat. The matmuls the backward recomputes: none
  under save_proj (core attention and the projections kept), the MLP's gate and up under
  save_attn, all of them under full."""
  from distca_jax.models.llama import AUTO_ORDER, REMAT_POLICIES

  assert set(AUTO_ORDER) <= set(REMAT_POLICIES) and AUTO_ORDER[0] == "none" and AUTO_ORDER[-1] == "full"
  grads, dots = {}, {}
  for remat in REMAT_POLICIES:  # one layer: each policy's recomputation shows in its block
    grads[remat], text = _grad_of_policy(remat)
    dots[remat] = text.count("stablehlo.dot_general")
  for remat, g in grads.items():
    assert tree_rel_err(g, grads["none"]) < 1e-6, remat
  assert dots["none"] == dots["save_proj"] < dots["save_attn"] < dots["full"]


def test_remat_auto_takes_the_first_policy_that_fits(monkeypatch):
  """`model.remat=auto` with the device's free memory faked: huge -> none; nothing -> every
  candidate compiled, full taken; in between -> the first in order whose need fits. The chosen
  step runs from the executable the choice compiled (one compile) and trains as a fixed policy
  does."""
  from distca_jax.models.llama import AUTO_ORDER
  from distca_jax.train import remat as remat_lib

  def auto_trainer(free):
    monkeypatch.setattr(remat_lib, "fixed_policy", lambda config, mesh: (None, ""))
    monkeypatch.setattr(remat_lib, "free_device_bytes", lambda mesh: free)
    cfg = small_config("mesh.data=1", "model.remat=auto", "model.layers=1")
    trainer, _ = _one_device_trainer(cfg)
    batch = synthetic_from_config(cfg.data, resolve(cfg.model).vocab_size, 1).batch(0)
    arrays, ctx = trainer.put_batch(batch, attn.host_context(cfg.attention, batch.layout))
    state, metrics = trainer.step(trainer.init_state(0), arrays, ctx)
    state, metrics = trainer.step(state, arrays, ctx)
    return trainer, float(metrics["loss"])

  trainer, loss = auto_trainer(1 << 50)
  assert trainer.remat == "none" and [c["policy"] for c in trainer.remat_candidates] == ["none"]
  assert trainer.compile_count() == 1 and "none needs" in trainer.remat_reason
  trainer, _ = auto_trainer(1)
  assert trainer.remat == "full" and [c["policy"] for c in trainer.remat_candidates] == list(AUTO_ORDER)
  assert not any(c["fits"] for c in trainer.remat_candidates)
  needs = {c["policy"]: c["need_bytes"] for c in trainer.remat_candidates}
  free = int(needs["save_proj"] / (1 - remat_lib.MEMORY_MARGIN)) + 1
  want = next(p for p in AUTO_ORDER if needs[p] <= free * (1 - remat_lib.MEMORY_MARGIN))
  trainer, loss_mid = auto_trainer(free)
  assert trainer.remat == want and trainer.compile_count() == 1
  monkeypatch.undo()
  fixed, _ = _one_device_trainer(small_config("mesh.data=1", "model.remat=full",
                                                 "model.layers=1"))
  batch = synthetic_from_config(fixed.config.data, fixed.shape.vocab_size, 1).batch(0)
  arrays, ctx = fixed.put_batch(batch, attn.host_context(fixed.config.attention, batch.layout))
  state, _ = fixed.step(fixed.init_state(0), arrays, ctx)
  _, metrics = fixed.step(state, arrays, ctx)
  assert abs(float(metrics["loss"]) - loss) < 1e-5 and abs(loss_mid - loss) < 1e-5


def test_remat_auto_resolves_without_compiling_on_cpu_and_in_the_pipeline():
  from distca_jax.train import remat as remat_lib

  cfg = small_config("mesh.data=1", "model.remat=auto")
  trainer, _ = _one_device_trainer(cfg)
  assert trainer.remat == "full" and "CPU" in trainer.remat_reason
  if jax.device_count() >= 2:
    piped = small_config("mesh.data=1", "mesh.pipe=2", "model.remat=auto", "attention.pingpong=false")
    mesh = mesh_lib.make_mesh(piped.mesh, jax.devices()[:2])
    remat, why = remat_lib.fixed_policy(piped, mesh)
    assert remat == "full" and "pipeline" in why
  assert small_config().model.remat == "none"  # the tests' own configs still choose


def _all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _all_eqns(inner)


def test_pingpong_makes_each_vocabulary_gradient_once():
  """With ping-pong the embedding and the LM head run once over the streams joined along T: the
  gradient adds no two per-stream [V, D] weight gradients (each a full fp32 copy of the
  vocabulary's weights, a step's largest elementwise work at a 128K vocabulary)."""
  cfg = small_config("mesh.data=1", "data.tokens_per_device=256", "attention.impl=distca",
                     "attention.gate=false")
  trainer, _ = _one_device_trainer(cfg)
  state = trainer.init_state(0)
  batch = synthetic_from_config(cfg.data, trainer.shape.vocab_size, 1).batch(0)
  arrays, ctx = trainer.put_batch(batch, attn.host_context(cfg.attention, batch, trainer.shape))
  assert isinstance(arrays["tokens"], tuple) and len(arrays["tokens"]) == 2
  jaxpr = jax.make_jaxpr(jax.grad(lambda p: trainer.loss_fn(p, arrays, ctx)[0]))(state.params)
  V, D = trainer.shape.vocab_size, trainer.shape.hidden
  sums = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "add_any"
          and any(getattr(v.aval, "shape", None) in ((V, D), (D, V)) for v in e.outvars)]
  assert not sums
