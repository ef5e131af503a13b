"""Sharded training (several device counts and mesh shapes) equals a single-device reference:
loss and every parameter gradient, fp32, on random packed batches."""

import jax
import numpy as np
import optax
import pytest

from distca_jax import attention as attn
from distca_jax import mesh as mesh_lib
from distca_jax.data.sources import make_batch, synthetic_from_config
from distca_jax.models.presets import resolve
from distca_jax.train.step import Trainer
from helpers import pure_params, reference_loss, reference_value_and_grad, rel_err, small_config, tree_rel_err


def _loss_and_grads(cfg, batch):
  devices = jax.devices()[: cfg.mesh.data * cfg.mesh.tensor]
  mesh = mesh_lib.make_mesh(cfg.mesh, devices)
  trainer = Trainer(cfg, mesh)
  state = trainer.init_state(0)
  _assert_moments_follow_params(trainer, state)
  arrays, ctx = trainer.put_batch(batch, attn.host_context(cfg.attention, batch.layout))
  (loss, _), grads = jax.jit(jax.value_and_grad(trainer.loss_fn, has_aux=True))(state.params, arrays, ctx)
  return float(loss), pure_params(grads), pure_params(state.params), trainer.shape


def _assert_moments_follow_params(trainer, state):
  """Each optimizer moment is sharded as its parameter (not replicated on every device)."""
  def same(moment, param):
    assert moment.sharding.is_equivalent_to(param.sharding, param.ndim), (moment.sharding, param.sharding)
    return moment

  optax.tree_map_params(trainer.tx, same, state.opt_state, state.params)


@pytest.mark.parametrize("data,tensor,fsdp,dist", [
    (2, 1, True, "pretrain"),
    (4, 1, False, "prolong"),
    (2, 2, True, "prolong"),
    (8, 1, True, "pretrain"),
    (4, 2, True, "pretrain"),
])
def test_sharded_loss_and_grads_match_reference(data, tensor, fsdp, dist):
  cfg = small_config(f"mesh.data={data}", f"mesh.tensor={tensor}", f"mesh.fsdp={fsdp}",
                     f"data.distribution={dist}", "data.tokens_per_device=128", "model.layers=1")
  batch = synthetic_from_config(cfg.data, 512, data).batch(data + tensor)
  loss, grads, params, shape = _loss_and_grads(cfg, batch)
  ref_loss, ref_grads = reference_value_and_grad(params, shape, batch)
  assert abs(loss - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
  assert tree_rel_err(grads, ref_grads) < 1e-5


def test_document_spanning_every_device():
  """One document longer than all buffers but the last: its prefix comes from every device."""
  cfg = small_config("mesh.data=4", "data.tokens_per_device=128", "model.layers=1")
  rng = np.random.default_rng(1)
  lens = np.array([3 * 128 + 50, 70, 8])
  batch = make_batch(lens, rng.integers(0, 512, lens.sum()).astype(np.int32), 4, 128)
  loss, grads, params, shape = _loss_and_grads(cfg, batch)
  ref_loss, ref_grads = reference_value_and_grad(params, shape, batch)
  assert abs(loss - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
  assert tree_rel_err(grads, ref_grads) < 1e-5
