"""The training loop end to end, in-process: the default job's path (tiny model, synthetic Pretrain
documents, 8 simulated devices), shortened; the guard that stops a run whose loss, gradients or
state stop being finite; the run's directory (one per run by default, never reused silently);
checkpoint saves that cannot succeed; and that the suite's runs stay out of the checkout."""

import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from distca_jax.config import ConfigError, load_config
from distca_jax.train import checkpoint as checkpoint_lib
from distca_jax.train import loop
from distca_jax.train.checkpoint import CheckpointSaveError
from helpers import child_env

ROOT = Path(__file__).resolve().parents[1]


# The default job, made small and quick to learn: short buffers that still hold several documents
# and documents spanning devices (length_scale), a shorter warm-up and a higher peak rate.
FAST = ["model.dtype=float32", "model.remat=none", "data.tokens_per_device=256",
        "data.length_scale=16", "optim.lr=0.01", "optim.warmup_steps=1", "train.progress=false"]


def _scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
  """Scalars of every TensorBoard event file under `tb_dir`, read from the TFRecord framing
  (u64 length, u32 crc, payload, u32 crc) with tensorboardX's Event proto."""
  from tensorboardX.proto import event_pb2

  out: dict[str, list[tuple[int, float]]] = {}
  for path in tb_dir.glob("events.out.tfevents.*"):
    data = path.read_bytes()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      for value in event.summary.value:
        out.setdefault(value.tag, []).append((event.step, value.simple_value))
  return out


def test_default_job_short_run_learns(tmp_path):
  steps = 8
  # Without its held-out evaluation (a second compilation; tests/test_evaluate.py runs it in the
  # loop), so that CAD's step costs the suite no more than it must.
  cfg = load_config(ROOT / "configs" / "tiny.yaml",
                    FAST + [f"train.steps={steps}", f"train.out_dir={tmp_path}", "eval.batches=0"])
  assert cfg.model.preset == "tiny" and cfg.data.source == "synthetic"
  assert cfg.data.distribution == "pretrain" and cfg.attention.impl == "distca"
  summary = loop.run(cfg, devices=jax.devices()[:8], log=lambda *_: None)

  assert summary.devices == 8
  assert summary.mesh_shape == {"data": 8, "pipe": 1, "tensor": 1}
  assert summary.steps == steps and len(summary.losses) == steps
  assert all(math.isfinite(x) for x in summary.losses)
  first, last = sum(summary.losses[:2]) / 2, sum(summary.losses[-2:]) / 2
  assert last < first - 0.5, summary.losses
  # Every step either compiled or was timed, and the step compiled for few context shapes.
  assert 1 <= summary.compile_count <= 4
  assert len(summary.step_times_s) + summary.compile_count >= steps
  assert summary.tokens_per_s > 0 and summary.compile_s > 0 and summary.host_wait_s >= 0
  assert summary.mfu is None  # CPU: no known peak, and none configured
  assert summary.attention_imbalance >= 1.0

  saved = json.loads((tmp_path / "summary.json").read_text())
  assert saved["losses"] == pytest.approx(summary.losses)
  assert saved["steps"] == steps
  assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == steps

  scalars = _scalars(tmp_path / "tb")
  for tag in ("train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s",
              "train/attention_imbalance"):
    assert [s for s, _ in scalars[tag]] == list(range(1, steps + 1)), tag
  assert [v for _, v in scalars["train/loss"]] == pytest.approx(summary.losses, rel=1e-5)

  # CAD ran every step (the default job turns the gate off), balancing what the layout left
  # uneven, moving rows between devices.
  assert summary.colocated_steps == 0
  assert summary.attention_imbalance_after < summary.attention_imbalance
  assert summary.moved_rows["query"] > 0 and summary.moved_rows["kv"] > 0
  text = loop.format_summary(summary)
  assert "loss" in text and "tokens/s" in text
  assert f"CAD on {steps} of {steps} steps" in text and "exchange moved" in text


def test_non_finite_loss_stops_naming_the_step(tmp_path):
  # A learning rate of 1e30 from the first step: the update of step 1 blows the parameters up
  # (caught in the update itself where it overflows, else in step 2's loss). One layer on two devices keeps the compile short.
  cfg = load_config(None, FAST + ["model.layers=1", "mesh.data=2", "data.tokens_per_device=128",
                                  "optim.lr=1.0e+30", "optim.warmup_steps=0", "train.steps=4",
                                  "train.tensorboard=false", f"train.out_dir={tmp_path}"])
  with pytest.raises(loop.NonFiniteError,
                     match=r"step [123]: (loss is|gradients|the update made the parameters)"):
    loop.run(cfg, devices=jax.devices()[:2], log=lambda *_: None)


@pytest.mark.parametrize("devices", [1, 2])
def test_step_compiles_once_for_one_shape(devices):
  """Steps on batches of one shape reuse one executable and one dispatch-cache entry: the initial
  state is placed (committed) as the step's outputs are, so step 2 does not count (or, where
  executables differ in placement, pay for) a second compilation."""
  from distca_jax import attention as attention_lib
  from distca_jax import mesh as mesh_lib
  from distca_jax.data.sources import synthetic_from_config
  from distca_jax.train.step import Trainer

  cfg = load_config(None, FAST + [f"mesh.data={devices}"])
  mesh = mesh_lib.make_mesh(cfg.mesh, devices=jax.devices()[:devices])
  trainer = Trainer(cfg, mesh)
  state = trainer.init_state(0)
  batch = synthetic_from_config(cfg.data, trainer.shape.vocab_size, devices).batch(0)
  arrays, ctx = trainer.put_batch(batch, attention_lib.host_context(cfg.attention, batch,
                                                                    trainer.shape))
  for _ in range(3):
    state, _ = trainer.step(state, arrays, ctx)
  assert trainer.compile_count() == 1


@pytest.mark.parametrize("impl", ["colocated", "distca"])
def test_step_lowers_each_mosaic_kernel_once(monkeypatch, impl):
  """The training step lowered for CUDA with the mosaic kernels: its kernel call sites and
  distinct kernels do not grow with the layers (each distinct Mosaic GPU kernel compiles once a
  process; per-layer copies cost seconds each). Guards the model and the attention layers
  against whatever would give each layer a kernel of its own."""
  pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  from distca_jax import attention as attention_lib
  from distca_jax import kernels
  from distca_jax.kernels import mosaic
  from distca_jax import mesh as mesh_lib
  from distca_jax.data.sources import synthetic_from_config
  from distca_jax.train.step import Trainer

  monkeypatch.setattr(kernels, "resolve_backend", lambda backend, *a, **k: "mosaic")

  def kernel_calls(layers):
    config = load_config(None, ["model.preset=tiny", "model.head_dim=64", f"model.layers={layers}",
                                "mesh.data=1", "data.tokens_per_device=1024",
                                f"attention.impl={impl}", "attention.kernel=mosaic",
                                "attention.gate=false", "attention.min_imbalance=1.0"])
    mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices()[:1])
    trainer = Trainer(config, mesh)
    batch = synthetic_from_config(config.data, trainer.shape.vocab_size, 1).batch(0)
    ctx = attention_lib.host_context(config.attention, batch, trainer.shape)
    arrays, dctx = trainer.abstract_batch(batch, ctx)  # lowered, never run: shapes only
    text = trainer.lower(trainer.abstract_state(), arrays, dctx, platforms=("cuda",)).as_text()
    return mosaic.lowered_kernels(text)

  two, four = kernel_calls(2), kernel_calls(4)
  assert two[0] >= 2 and two[1] >= 2, two
  assert four == two, (two, four)


# One layer on two devices: the run-directory tests compile one small program (shared).
QUICK = FAST + ["model.layers=1", "mesh.data=2", "data.tokens_per_device=128", "train.steps=2",
                "train.tensorboard=false", "train.imbalance_after=false",
                "attention.impl=colocated", "eval.batches=0"]


def _quick(*overrides):
  return load_config(None, QUICK + list(overrides))


def test_a_run_without_out_dir_gets_its_own_directory_outside_the_checkout():
  """No train.out_dir: runs/<name>-<time> under the working directory, linked as runs/latest,
  with a checkpoint at its end. The suite runs from a temporary directory (tests/conftest.py),
  so this run, like every test's, leaves the checkout's runs/ alone."""
  assert Path.cwd().resolve() != ROOT and ROOT not in Path.cwd().resolve().parents
  before = sorted(os.listdir(ROOT / "runs")) if (ROOT / "runs").exists() else None
  lines = []
  first = loop.run(_quick(), devices=jax.devices()[:2], log=lines.append, name="quick")
  second = loop.run(_quick(), devices=jax.devices()[:2], log=lambda *a: None, name="quick")
  a, b = Path(first.out_dir), Path(second.out_dir)
  assert a.parent == b.parent == Path("runs") and a != b  # same second: a suffix tells them apart
  assert a.name.startswith("quick-") and (a / "summary.json").exists()
  assert (Path("runs") / "latest").resolve() == b.resolve()
  assert lines[0] == f"run directory {a} (runs/latest links it)"
  assert first.saved_step == 2 and sorted(os.listdir(a / "checkpoints")) == ["2"]
  after = sorted(os.listdir(ROOT / "runs")) if (ROOT / "runs").exists() else None
  assert after == before


def test_a_directory_with_checkpoints_is_resumed_or_refused_never_restarted(tmp_path):
  out = tmp_path / "run"
  loop.run(_quick(f"train.out_dir={out}"), devices=jax.devices()[:2], log=lambda *a: None)
  # Checkpoints off, or resume off: it would start from step 0 over them. One line says how to go on.
  for setting, how in [("checkpoint.every=0", "checkpoint.every=N"),
                       ("checkpoint.resume=false", "checkpoint.resume=true")]:
    with pytest.raises(ConfigError) as err:
      loop.run(_quick(f"train.out_dir={out}", setting), devices=jax.devices()[:2], log=lambda *a: None)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"train.out_dir: {out / 'checkpoints'} holds "
                                                       f"checkpoints of an earlier run (steps 2)")
    assert f"to resume it, the same command with {how}" in message and "another train.out_dir" in message
  # The same run resumed with more steps and another learning rate: said, and continued.
  lines = []
  more = loop.run(_quick(f"train.out_dir={out}", "train.steps=3", "optim.lr=0.02"),
                  devices=jax.devices()[:2], log=lines.append)
  assert more.start_step == 2 and more.steps == 1
  assert any("differs from its config.json in optim.lr 0.01 -> 0.02" in l for l in lines), lines
  # Complete: nothing to do, and it says so.
  lines = []
  done = loop.run(_quick(f"train.out_dir={out}", "train.steps=3"), devices=jax.devices()[:2],
                  log=lines.append)
  assert done.steps == 0 and any("complete at step 3" in l for l in lines), lines


def test_full_disk_is_a_config_error_before_the_first_step(tmp_path, monkeypatch):
  free = shutil.disk_usage(tmp_path)
  monkeypatch.setattr(checkpoint_lib.shutil, "disk_usage", lambda path: free._replace(free=1 << 20))
  with pytest.raises(ConfigError, match=r"^checkpoint.dir: 1.0 MiB free on the disk of .*, a "
                                        r"checkpoint needs"):
    loop.run(_quick(f"train.out_dir={tmp_path}"), devices=jax.devices()[:2], log=lambda *a: None)
  assert not (tmp_path / "summary.json").exists()


def test_a_failed_save_stops_the_run_at_the_next_step(tmp_path, monkeypatch):
  """The disk fills up while step 1's checkpoint is committed (in the background): the run stops
  at a following step boundary with one CheckpointSaveError line, not steps later."""
  from orbax.checkpoint._src.path import atomicity

  async def full(self, *args, **kwargs):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", full)
  lines = []
  with pytest.raises(CheckpointSaveError) as err:
    loop.run(_quick(f"train.out_dir={tmp_path}", "train.steps=40", "checkpoint.every=1"),
             devices=jax.devices()[:2], log=lines.append)
  assert "\n" not in str(err.value) and "No space left on device" in str(err.value)
  steps_run = [l for l in lines if l.startswith("step ")]
  assert len(steps_run) < 40, "the failure surfaced only at the end"


def test_sigterm_in_process_stops_at_the_step_boundary_with_a_checkpoint(tmp_path):
  """A SIGTERM while step 2 runs (sent from the log line of step 1): the run finishes step 2,
  saves it, writes its summary and returns, naming the signal; the handler is then removed."""
  before = signal.getsignal(signal.SIGTERM)

  def log(line):
    if line.startswith("step 1:"):
      os.kill(os.getpid(), signal.SIGTERM)

  summary = loop.run(_quick(f"train.out_dir={tmp_path}", "train.steps=40"),
                     devices=jax.devices()[:2], log=log)
  assert summary.interrupted == "SIGTERM" and summary.steps in (1, 2)
  assert summary.saved_step == summary.steps
  assert sorted(os.listdir(tmp_path / "checkpoints")) == [str(summary.steps)]
  assert json.loads((tmp_path / "summary.json").read_text())["interrupted"] == "SIGTERM"
  assert signal.getsignal(signal.SIGTERM) == before


def test_ctrl_c_on_the_command_line_saves_and_exits_130(tmp_path):
  """SIGINT to launch/train.py: no traceback; the step it was in is saved, the summary printed
  with how to resume, and the exit status is 128 + 2."""
  env = child_env(PYTHONUNBUFFERED="1")
  out = open(tmp_path / "out.txt", "w")
  proc = subprocess.Popen([sys.executable, str(ROOT / "launch" / "train.py"), *QUICK,
                           "train.steps=400", "train.cpu_devices=2", f"train.out_dir={tmp_path / 'r'}"],
                          cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
  t0 = time.monotonic()
  while "step 1:" not in (tmp_path / "out.txt").read_text():
    assert proc.poll() is None and time.monotonic() - t0 < 300, (tmp_path / "out.txt").read_text()
    time.sleep(0.2)
  proc.send_signal(signal.SIGINT)
  assert proc.wait(timeout=120) == 130
  text = (tmp_path / "out.txt").read_text()
  assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
  summary = json.loads((tmp_path / "r" / "summary.json").read_text())
  step = summary["steps"]
  assert summary["interrupted"] == "SIGINT" and summary["saved_step"] == step
  assert f"stopped by SIGINT after step {step}; checkpoint at step {step}; resume: the same " \
         f"command with train.out_dir={tmp_path / 'r'}" in text
