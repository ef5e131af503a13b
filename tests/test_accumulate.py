"""Gradient accumulation without a pipeline (`train.microbatches=K`, mesh.pipe=1): a step of K
micro-batches on `data` ranks computes the loss and gradients of one step on K x data ranks.

'The same global batch': with K micro-batches, micro-batch i of step s is the source's batch
s * K + i (data buffers; documents never cross a micro-batch). The step on K x data ranks that
it must equal is the one whose buffers are those micro-batches' buffers in order (micro-batch 0's
on ranks 0 .. data - 1, then micro-batch 1's, ...): `joined` below packs their documents, in
order, into K x data buffers, and the test checks that it holds exactly those buffers."""

import jax
import numpy as np
import pytest

from distca_jax import attention as attention_lib
from distca_jax import mesh as mesh_lib
from distca_jax.data.sources import make_batch, synthetic_from_config
from distca_jax.train import accumulate
from distca_jax.train.step import Trainer

from helpers import small_config, tree_rel_err

T, DATA, K = 128, 4, 2


def joined(mbs):
  """The K x data-buffer batch whose buffers are the micro-batches' buffers, in order."""
  lens = np.concatenate([b.layout.doc_lens for b in mbs])
  tokens = np.concatenate([b.tokens.reshape(-1) for b in mbs])  # full batches: the stream
  return make_batch(lens, tokens, len(mbs) * DATA, T)


def _placed(trainer, cfg, batch):
  ctx = attention_lib.host_context(trainer.config.attention, batch, trainer.shape)
  return trainer.put_batch(batch, ctx)


@pytest.mark.parametrize("impl", ["colocated", "distca"])
def test_data4_with_two_microbatches_equals_data8(impl):
  base = [f"attention.impl={impl}", f"data.tokens_per_device={T}", "data.length_scale=4"]
  cfg4 = small_config(*base, f"mesh.data={DATA}", f"train.microbatches={K}")
  cfg8 = small_config(*base, f"mesh.data={DATA * K}")
  t4 = Trainer(cfg4, mesh_lib.make_mesh(cfg4.mesh, jax.devices()[:DATA]))
  t8 = Trainer(cfg8, mesh_lib.make_mesh(cfg8.mesh, jax.devices()[:DATA * K]))
  assert t4.accumulates and not t8.accumulates

  source = synthetic_from_config(cfg4.data, t4.shape.vocab_size, DATA)
  step = 3
  mbs = [source.batch(step * K + i) for i in range(K)]
  whole = joined(mbs)
  for name in ("tokens", "targets", "loss_mask", "positions"):
    np.testing.assert_array_equal(getattr(whole, name),
                                  np.concatenate([getattr(b, name) for b in mbs]), name)
  # A document spanning buffers inside a micro-batch, so attention crosses devices in both.
  assert (whole.layout.doc_offset > 0).any()
  # ...and the loop's own view of the step (its FLOP and token counts) is that batch.
  step_view = accumulate.MicroBatches(tuple(mbs), (), ()).as_batch()
  np.testing.assert_array_equal(step_view.layout.segment_ids(), whole.layout.segment_ids())
  assert accumulate.MicroBatches(tuple(mbs), (), ()).step_tokens == whole.loss_mask.sum()

  state8 = t8.init_state(0)
  params = jax.device_get(state8.params)
  state4 = t4.init_state(1)
  state4.params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, state4.params))

  (loss8, count8), grads8 = jax.jit(jax.value_and_grad(t8.loss_fn, has_aux=True))(
      state8.params, *_placed(t8, cfg8, whole))

  step_tokens = float(whole.loss_mask.sum())
  zero, _ = t4._accumulation_fns(state4)
  acc = zero(state4.params)
  tokens = np.float32(step_tokens)
  for b in mbs:
    acc = t4._jitted_step(state4)(state4.params, acc, *_placed(t4, cfg4, b), tokens)
  assert float(acc["tokens"]) == float(count8) == step_tokens
  assert abs(float(acc["loss"]) - float(loss8)) <= 1e-5 * abs(float(loss8))
  assert tree_rel_err(jax.device_get(acc["grads"]), jax.device_get(grads8)) <= 1e-5
