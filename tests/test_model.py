"""The model against an independent plain-jnp Llama, and its causality / document isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distca_jax import attention as attn
from distca_jax import mesh as mesh_lib
from distca_jax.data.sources import SyntheticSource, make_batch, synthetic_from_config
from distca_jax.models.presets import resolve
from distca_jax.train.step import Trainer, device_batch_arrays, put_global
from helpers import pure_params, reference_hidden, reference_loss, rel_err, small_config


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


@pytest.mark.parametrize("T,chunk", [(96, 32), (80, 32)])  # several chunks; chunk not dividing T
def test_cross_entropy_and_grads_matches_autodiff(T, chunk):
  from distca_jax.train.loss import chunked_cross_entropy, cross_entropy_and_grads

  k = jax.random.split(jax.random.key(0), 4)
  h = jax.random.normal(k[0], (2, T, 16))
  w = jax.random.normal(k[1], (16, 50)) * 0.3
  t = jax.random.randint(k[2], (2, T), 0, 50)
  m = (jax.random.uniform(k[3], (2, T)) < 0.8).astype(jnp.float32)
  scale, acc = 0.37, jnp.full((16, 50), 0.5)
  f = lambda h, w: chunked_cross_entropy(h, w, t, m, chunk=chunk) * scale
  loss, (dh, dw) = jax.value_and_grad(f, argnums=(0, 1))(h, w)
  got_loss, got_dh, got_acc = cross_entropy_and_grads(h, w, t, m, scale, acc, chunk=chunk)
  assert rel_err(got_loss, loss) < 1e-6
  assert rel_err(got_dh, dh) < 1e-6
  assert rel_err(got_acc, acc + dw) < 1e-6
