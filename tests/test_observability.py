"""What a run reports while it trains and when it ends: TensorBoard scalars, the progress bar with
its ETA, the summary's text; and a NaN/Inf in the loss, the gradients or the updated state
stopping the run with the step, the quantity and the leaf named, before anything is saved."""

import dataclasses
import glob
import os
import struct
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distca_jax.launch_env import enable_compile_cache
from distca_jax.train import loop
from distca_jax.train.checkpoint import Checkpointer
from distca_jax.train.finite import NonFiniteError, check_step, first_nonfinite_leaf, tree_all_finite
from distca_jax.train.summary import Summary, format_summary
from helpers import small_config

# Same programs as tests/test_resume.py (4 data ranks, train.steps=4): shared compilation cache.
TINY = ("model.layers=1", "model.hidden=64", "model.ffn=128", "model.vocab_size=256",
        "data.length_scale=64", "data.seed=4", "train.steps=4")


@pytest.fixture(autouse=True, scope="module")
def _cache():
  enable_compile_cache(os.environ.setdefault("DISTCA_TEST_COMPILE_CACHE",
                                             tempfile.mkdtemp(prefix="distca_compile_cache_")))
  if jax.device_count() < 4:
    pytest.skip("needs 4 CPU devices")


def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
  """tag -> [(step, value)] from tensorboardX event files (TFRecord framing: u64 length,
  u32 crc, payload, u32 crc)."""
  from tensorboardX.proto import event_pb2

  out: dict[str, list] = {}
  for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
    raw = open(path, "rb").read()
    pos = 0
    while pos + 12 <= len(raw):
      (length,) = struct.unpack("<Q", raw[pos:pos + 8])
      event = event_pb2.Event.FromString(raw[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      for v in event.summary.value:
        out.setdefault(v.tag, []).append((event.step, v.simple_value))
  return out


def test_tensorboard_scalars_and_progress_bar(tmp_path, capsys):
  config = small_config(*TINY, "train.stop_at_step=2", "train.tensorboard=true", "train.progress=true",
                        "train.peak_tflops=1", f"train.out_dir={tmp_path}")
  summary = loop.run(config, devices=jax.devices()[:4], log=lambda *a: None)
  scalars = _scalars(tmp_path / "tb")
  for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "attention_imbalance",
              "attention_imbalance_after", "compile_count"):
    assert [s for s, _ in scalars[f"train/{tag}"]] == [1, 2], tag
  assert [v for _, v in scalars["train/loss"]] == pytest.approx(summary.losses)
  imb_before = [v for _, v in scalars["train/attention_imbalance"]]
  imb_after = [v for _, v in scalars["train/attention_imbalance_after"]]
  assert all(a <= b + 1e-9 and a >= 1.0 for a, b in zip(imb_after, imb_before))
  # Peak memory comes from device.memory_stats(), which the CPU backend does not keep.
  has_stats = bool(jax.devices()[0].memory_stats())
  assert ("train/peak_memory_gib" in scalars) == has_stats
  # tqdm's bar on stderr: position, total and the remaining-time estimate.
  err = capsys.readouterr().err
  assert "train" in err and "2/2" in err and "<" in err


def test_nan_learning_rate_is_never_committed_and_the_leaf_is_named(tmp_path):
  """optim.lr=NaN (accepted by an older loader): step 1's loss and gradients are finite, its
  update is not. The run stops at step 1 naming the parameters' first leaf, and no checkpoint is
  committed, although one is due at every step."""
  config = small_config(*TINY, "checkpoint.every=1", f"train.out_dir={tmp_path}")
  config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=float("nan"),
                                                                 warmup_steps=0))
  with pytest.raises(NonFiniteError, match=r"^step 1: the update made the parameters non-finite "
                                           r"\(first: params/\S+; lr=nan"):
    loop.run(config, devices=jax.devices()[:4], log=lambda *a: None)
  with Checkpointer(tmp_path / "checkpoints", save_every=1, keep=1, read_only=True) as ck:
    assert ck.all_steps() == []


def test_nonfinite_quantities_are_named():
  finite = {"loss": np.float32(2.0), "grads_finite": np.bool_(True), "grad_norm": np.float32(1.0),
            "lr": np.float32(0.1), "state_finite": np.bool_(True)}
  state = {"params": {"a": jnp.zeros(3), "b": jnp.ones(2)}, "opt_state": {"mu": jnp.zeros(2)},
           "step": jnp.int32(1)}
  check_step(0, finite, state)  # no error
  with pytest.raises(NonFiniteError, match=r"^step 7: gradients contain NaN or Inf \(grad_norm=nan\)"):
    check_step(6, dict(finite, grads_finite=np.bool_(False), grad_norm=np.float32(np.nan)))
  with pytest.raises(NonFiniteError, match=r"^step 1: loss is inf"):
    check_step(0, dict(finite, loss=np.float32(np.inf)))
  # The step's flag says the state is bad; the leaf is then found on the host.
  bad = dict(state, params={"a": jnp.zeros(3), "b": jnp.asarray([1.0, np.inf])})
  assert first_nonfinite_leaf(bad) == "params/b" and first_nonfinite_leaf(state) is None
  with pytest.raises(NonFiniteError, match=r"^step 3: the update made the parameters non-finite "
                                           r"\(first: params/b; lr=0.1"):
    check_step(2, dict(finite, state_finite=np.bool_(False)), bad)
  moments = dict(state, opt_state={"mu": jnp.asarray([np.nan, 0.0])})
  with pytest.raises(NonFiniteError, match=r"optimizer state non-finite \(first: opt_state/mu"):
    check_step(2, dict(finite, state_finite=np.bool_(False)), moments)
  # Inside a jitted step the flag is one reduction over every float leaf (ints are skipped).
  assert bool(jax.jit(tree_all_finite)(state)) and not bool(jax.jit(tree_all_finite)(moments))


def _summary(**fields) -> Summary:
  base = dict(steps=1, losses=[6.5], step_times_s=[], compile_s=3.0, compile_count=1,
              tokens_per_s=float("nan"), mfu=None, host_wait_s=0.0, attention_imbalance=1.5,
              devices=4, mesh_shape={"data": 4, "pipe": 1, "tensor": 1})
  return Summary(**{**base, **fields})


def test_summary_text_says_what_it_measured():
  # One step: it compiled, so no step was timed: "n/a", not "nan ms; nan tokens/s".
  text = format_summary(_summary())
  assert "nan" not in text and "median step n/a" in text
  timed = format_summary(_summary(steps=3, losses=[3.0, 2.0, 1.0], step_times_s=[0.01, 0.03],
                                  tokens_per_s=5000.0))
  assert "median step 20.0 ms; 5,000 tokens/s" in timed
  # A colocated run's "after" is what CAD's plan would reach, said so; a distca run's, its own.
  colocated = format_summary(_summary(attention_imbalance_after=1.33))
  assert "CAD's plan would reach 1.33 (planned, not run" in colocated
  distca = _summary(attention="distca", attention_imbalance_after=1.1, colocated_steps=0, steps=4,
                    losses=[1.0] * 4)
  assert "CAD-scheduled 1.10" in format_summary(distca)
  assert "CAD on 4 of 4 steps" in format_summary(distca)  # said also when CAD ran on every step
  gated = format_summary(dataclasses.replace(distca, colocated_steps=1))
  assert "CAD on 3 of 4 steps; the others ran colocated" in gated
  stopped = format_summary(_summary(start_step=4, interrupted="SIGTERM", saved_step=5,
                                    out_dir="runs/x"))
  assert "stopped by SIGTERM after step 5; checkpoint at step 5; resume: the same command with " \
         "train.out_dir=runs/x" in stopped


def test_summary_says_accumulation_and_each_sources_tokens():
  text = format_summary(_summary(microbatches=4, data_tokens={"long": 600, "short": 400}))
  assert "4 micro-batches a step (gradient accumulation)" in text
  assert "data: long 600 tokens (60.0%), short 400 tokens (40.0%)" in text
  one = format_summary(_summary(data_tokens={"synthetic": 1000}))
  assert "micro-batches" not in one and "data:" not in one  # nothing to say for one source
