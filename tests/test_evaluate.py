"""Held-out evaluation: its loss is the training loss function's on the same batch (no update),
the position buckets' losses are the loss restricted to their tokens and add up to the total,
CAD evaluates what colocated attention does, and a run's evaluations reach the log, TensorBoard,
summary.json and `launch/eval.py`."""

import json

import jax
import numpy as np
import pytest

from distca_jax import mesh as mesh_lib
from distca_jax.train import evaluate, loop
from distca_jax.train.step import Trainer
from helpers import launch_script, small_config

# One layer; buckets at 64 and 192 split the documents of a 256-token buffer's batch.
BASE = ["model.layers=1", "data.distribution=prolong", "eval.batches=2", "eval.buckets=[64, 192]"]


def _evaluator(devices, *overrides):
  cfg = small_config(f"mesh.data={devices}", *BASE, *overrides)
  mesh = mesh_lib.make_mesh(cfg.mesh, devices=jax.devices()[:devices])
  trainer = Trainer(cfg, mesh)
  state = trainer.init_state(0)
  return trainer, state, evaluate.make_evaluator(trainer.config, trainer, loop.make_source)


def test_eval_loss_is_the_training_loss_and_buckets_partition_it():
  trainer, state, evaluator = _evaluator(2)
  before = jax.device_get(state.params)
  result = evaluator(state.params, 0)
  # The training loss function on each held-out batch, no update: the token-weighted mean.
  loss_fn = jax.jit(trainer.loss_fn)  # one compile for every batch and bucket mask below
  losses, counts = zip(*(jax.device_get(loss_fn(state.params, a, c)) for a, c in evaluator.inputs))
  assert result.loss == pytest.approx(np.average(losses, weights=counts), rel=1e-5)
  assert result.tokens == int(sum(counts))
  jax.tree.map(np.testing.assert_array_equal, before, jax.device_get(state.params))
  # Each bucket's loss is the training loss over only its tokens (by in-document position)...
  assert result.buckets == ["0-64", "64-192", "192+"]
  edges = [0, 64, 192, np.inf]
  for b, (lo, hi) in enumerate(zip(edges, edges[1:])):
    sums = tokens = 0.0
    for arrays, ctx in evaluator.inputs:
      pos = np.asarray(arrays["positions"])
      mask = np.asarray(arrays["loss_mask"]) * ((pos >= lo) & (pos < hi))
      masked = dict(arrays, loss_mask=jax.device_put(mask, arrays["loss_mask"].sharding))
      loss, count = jax.device_get(loss_fn(state.params, masked, ctx))
      sums, tokens = sums + loss * count, tokens + count
    assert result.bucket_tokens[b] == int(tokens) > 0
    assert result.bucket_loss[b] == pytest.approx(sums / tokens, rel=1e-5)
  # ... and the buckets weighted by their tokens give the total.
  total = np.dot(result.bucket_loss, result.bucket_tokens) / sum(result.bucket_tokens)
  assert total == pytest.approx(result.loss, rel=1e-6)
  # The same held-out batches every time: the same parameters evaluate the same.
  again = evaluator(state.params, 0)
  assert again.loss == result.loss and evaluator.compile_count() == 1


def test_eval_under_cad_is_colocated_eval():
  """Gate off: every held-out batch runs CAD's exchange (ping-pong split included); the losses
  are colocated attention's on the same parameters."""
  _, state, colocated = _evaluator(4)
  _, _, cad = _evaluator(4, "attention.impl=distca")
  want, got = colocated(state.params, 0), cad(state.params, 0)
  assert cad.cad_batches == 2 and colocated.cad_batches == 0
  assert got.loss == pytest.approx(want.loss, rel=1e-5)
  np.testing.assert_allclose(got.bucket_loss, want.bucket_loss, rtol=1e-5)
  assert got.bucket_tokens == want.bucket_tokens


def test_default_buckets_scale_to_the_context():
  assert evaluate.default_buckets(1 << 20) == (4096, 16384, 65536, 131072)
  assert evaluate.default_buckets(16384) == (512, 2048, 8192, 16384)
  assert evaluate.bucket_names((512, 2048, 8192, 16384)) == ["0-512", "512-2K", "2K-8K", "8K-16K", "16K+"]
  assert evaluate.due(4, 2, 5) and evaluate.due(5, 2, 5) and not evaluate.due(3, 2, 5)
  assert evaluate.due(5, 0, 5) and not evaluate.due(4, 0, 5)


def test_a_run_evaluates_and_eval_py_reads_its_checkpoint(tmp_path, capsys):
  cfg = small_config(*BASE, "mesh.data=8", "data.tokens_per_device=128", "train.steps=2", "eval.every=1",
                     "train.tensorboard=true", f"train.out_dir={tmp_path}")
  lines = []
  summary = loop.run(cfg, devices=jax.devices()[:8], log=lines.append)
  assert [e["step"] for e in summary.evals] == [1, 2]
  assert summary.eval_loss == summary.evals[-1]["loss"] and summary.eval_compile_count == 1
  assert sum(l.startswith("eval at step ") for l in lines) == 2
  saved = json.loads((tmp_path / "summary.json").read_text())
  assert saved["eval_loss"] == summary.eval_loss
  assert "eval loss" in loop.format_summary(summary)
  from test_train import _scalars

  scalars = _scalars(tmp_path / "tb")
  assert [s for s, _ in scalars["eval/loss"]] == [1, 2]
  assert "eval/loss_pos_0-64" in scalars and "eval/perplexity" in scalars
  # The saved checkpoint evaluated without training: the loss the run logged at its end.
  assert launch_script("eval").main([str(tmp_path)]) == 0
  out = json.loads((tmp_path / "eval-step2.json").read_text())
  assert out["loss"] == pytest.approx(summary.eval_loss, rel=1e-6)
  assert "eval at step 2: loss" in capsys.readouterr().out
  assert launch_script("eval").main([str(tmp_path), "--step", "7"]) == 2
  assert "checkpoint error: checkpoint step 7" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["mesh.pipe=2", "model.layers=2", "attention.pingpong=false", "train.microbatches=2",
      "eval.batches=1"], "eval.batches: evaluation does not run with mesh.pipe > 1"),
    (["data.packing=wlb", "eval.batches=1"], "eval.batches: evaluation does not run"),
    (["eval.buckets=[64, 64]"], "eval.buckets: bucket starts must increase"),
    (["eval.batches=1", "eval.source=corpus"], "eval.corpus_tokens and eval.corpus_offsets"),
    (["eval.batches=1", "eval.source=synthetic", "eval.distribution=/nonexistent.json"],
     "eval.distribution"),
])
def test_bad_eval_configs_name_the_field(overrides, message):
  from distca_jax.config import ConfigError, load_config

  with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
    load_config(None, overrides)
