"""What a run reports while it trains: TensorBoard scalars, the progress bar with its ETA, and a
NaN/Inf in the loss or the gradients stopping the run with the step and the quantity named."""

import dataclasses
import glob
import os
import struct
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distca_jax import mesh as mesh_lib
from distca_jax.launch_env import enable_compile_cache
from distca_jax.models.presets import resolve
from distca_jax.train import loop
from distca_jax.train.checkpoint import Checkpointer
from distca_jax.train.step import Trainer
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


def test_nan_loss_stops_the_run_naming_step_and_quantity(tmp_path):
  """A NaN parameter (planted in a checkpoint at step 2) makes step 3's loss NaN."""
  devices = jax.devices()[:4]
  base = small_config(*TINY, f"train.out_dir={tmp_path / 'a'}")
  mesh = mesh_lib.make_mesh(base.mesh, devices)
  state = Trainer(base, mesh).init_state(base.train.seed)
  poisoned = jax.tree.map(lambda x: x, state)
  leaves, treedef = jax.tree.flatten(poisoned.params)
  leaves[0] = leaves[0] * jnp.nan
  poisoned.params = jax.tree.unflatten(treedef, leaves)
  with Checkpointer(tmp_path / "ck", save_every=2, keep=1) as ck:
    ck.maybe_save(2, poisoned, {"step": 2, "model": dataclasses.asdict(resolve(base.model))})
  config = small_config(*TINY, "checkpoint.every=2", f"checkpoint.dir={tmp_path / 'ck'}",
                        f"train.out_dir={tmp_path / 'b'}")
  with pytest.raises(loop.NonFiniteError, match=r"^step 3: loss is nan"):
    loop.run(config, devices=devices, log=lambda *a: None)


def test_nonfinite_gradients_and_infinite_loss_are_named():
  finite = {"loss": np.float32(2.0), "grads_finite": np.bool_(True), "grad_norm": np.float32(1.0)}
  loop._check_finite(0, finite)  # no error
  with pytest.raises(loop.NonFiniteError, match=r"^step 7: gradients contain NaN or Inf \(grad_norm=nan\)"):
    loop._check_finite(6, dict(finite, grads_finite=np.bool_(False), grad_norm=np.float32(np.nan)))
  with pytest.raises(loop.NonFiniteError, match=r"^step 1: loss is inf"):
    loop._check_finite(0, dict(finite, loss=np.float32(np.inf)))
