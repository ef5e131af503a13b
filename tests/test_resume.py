"""Exact resume through the training loop: an interrupted and resumed run trains on the same
batches with the same learning rates from the same state, so its losses equal the uninterrupted
run's bit for bit. Also: resuming onto another mesh shape, a checkpoint of another model
refused naming the field, missing and incomplete checkpoint directories, unreadable and
non-finite checkpoints passed over for the newest good one (in one line, also on the command
line), and `checkpoint.step` choosing the step.

Every run here compiles the same few programs; a persistent compilation cache shared by the
runs (and the other operability tests) keeps the module to one compilation per program.
"""

import concurrent.futures
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from pathlib import Path

import jax
import numpy as np
import pytest

from distca_jax import mesh as mesh_lib
from distca_jax.config import ConfigError, load_config
from distca_jax.launch_env import enable_compile_cache
from distca_jax.train import loop, rundir
from distca_jax.train.checkpoint import (CheckpointCorruptError, Checkpointer, CheckpointMismatchError,
                                         COMMIT_MARKER, NoCheckpointError)
from distca_jax.train.step import Trainer
from helpers import child_env, small_config

# A one-layer model on 4 data ranks: its step programs compile in seconds on CPU.
TINY = ("model.layers=1", "model.hidden=64", "model.ffn=128", "model.vocab_size=256",
        "data.length_scale=64", "data.seed=4", "train.imbalance_after=false")
N = 2  # checkpoint every N steps; runs are 2N steps
# small_config's base overrides, for the command line (which starts from configs/tiny.yaml).
SMALL = ("attention.impl=colocated", "eval.batches=0", "model.dtype=float32", "model.remat=none", "data.tokens_per_device=256",
         "data.length_scale=16", "train.progress=false", "train.tensorboard=false",
         "attention.gate=false", "attention.min_imbalance=1.0")


def config(out, *overrides):
  return small_config(*TINY, f"train.steps={2 * N}", f"checkpoint.every={N}", "checkpoint.keep=5",
                      f"train.out_dir={out}", *overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The uninterrupted run, and a run stopped after N steps (its checkpoint dir copied aside)."""
  enable_compile_cache(os.environ.setdefault("DISTCA_TEST_COMPILE_CACHE",
                                             tempfile.mkdtemp(prefix="distca_compile_cache_")))
  if jax.device_count() < 8:
    pytest.skip("needs 8 CPU devices (tests/conftest.py sets them)")
  base = tmp_path_factory.mktemp("resume")
  devices = jax.devices()[:4]
  straight = loop.run(config(base / "straight"), devices=devices, log=lambda *a: None)
  half = loop.run(config(base / "half", f"train.stop_at_step={N}"), devices=devices, log=lambda *a: None)
  shutil.copytree(base / "half" / "checkpoints", base / "at_n")
  return base, devices, straight, half


def test_resumed_losses_equal_uninterrupted(runs):
  base, devices, straight, half = runs
  assert straight.steps == 2 * N and half.steps == N
  assert half.losses == straight.losses[:N]
  with Checkpointer(base / "half" / "checkpoints", save_every=N, keep=5, read_only=True) as ck:
    assert ck.all_steps() == [N]  # every N steps only
  messages = []
  resumed = loop.run(config(base / "half"), devices=devices, log=messages.append)
  assert resumed.start_step == N and resumed.steps == N
  assert any(f"resumed from checkpoint at step {N}" in m for m in messages)
  assert resumed.losses == straight.losses[N:]  # exact, not approximately


def test_distca_resumes_exactly_with_its_step_capacities(tmp_path):
  """A CAD run resumed from a checkpoint trains the same losses as the uninterrupted run, and
  starts from the step capacities its checkpoint's steps had reached (saved in the checkpoint):
  the step compiles once per shape it uses, and never for a smaller one."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 CPU devices (tests/conftest.py sets them)")
  devices = jax.devices()[:4]
  # Seed 3: the first N steps exchange 256-row blocks, the next N need only 128.
  cad = ("attention.impl=distca", "data.distribution=prolong", "attention.pingpong=false",
         "data.seed=3")
  straight = loop.run(config(tmp_path / "s", *cad), devices=devices, log=lambda *a: None)
  loop.run(config(tmp_path / "h", *cad, f"train.stop_at_step={N}"), devices=devices,
           log=lambda *a: None)
  with Checkpointer(tmp_path / "h" / "checkpoints", save_every=N, keep=5, read_only=True) as ck:
    _, extra = ck.read_extra()
  saved = extra["step_shapes"]
  assert any(k.startswith("cad@") for k in saved), saved
  lines = []
  resumed = loop.run(config(tmp_path / "h", *cad), devices=devices, log=lines.append)
  assert resumed.start_step == N and resumed.losses == straight.losses[N:]
  assert resumed.compile_count == resumed.step_shapes
  # Every CAD step after the resume exchanges blocks at least as large as the saved capacity.
  saved_c = next(v for k, v in saved.items() if k.startswith("cad@") and k.endswith(".c"))
  rows = [float(l.split("exchange_q_rows=")[1].split()[0]) for l in lines if "exchange_q_rows=" in l]
  assert rows and min(rows) >= saved_c


def test_resume_onto_another_mesh_shape(runs):
  """Saved on data=4 (4 devices), restored onto data=4 x tensor=2 (8 devices): the same batches
  (4 buffers), parameters resharded over heads. Reductions run in another order, so the losses
  agree to float32 rounding rather than bit for bit."""
  base, _, straight, _ = runs
  other = base / "other_mesh"
  shutil.copytree(base / "at_n", other)
  resumed = loop.run(config(base / "o", "mesh.tensor=2", f"checkpoint.dir={other}"),
                     devices=jax.devices()[:8], log=lambda *a: None)
  assert resumed.mesh_shape == {"data": 4, "pipe": 1, "tensor": 2}
  assert resumed.start_step == N
  np.testing.assert_allclose(resumed.losses, straight.losses[N:], rtol=1e-5)


def test_other_model_shape_is_refused_naming_the_field(runs):
  base, devices, _, _ = runs
  ck = base / "mismatch"
  shutil.copytree(base / "at_n", ck)
  with pytest.raises(CheckpointMismatchError, match=r"model\.ffn: checkpoint has 128, current run has 256"):
    loop.run(config(base / "m", "model.ffn=256", f"checkpoint.dir={ck}"), devices=devices,
             log=lambda *a: None)


def test_missing_directory_starts_from_scratch(runs):
  base, devices, straight, _ = runs
  messages = []
  fresh = loop.run(config(base / "fresh", "train.stop_at_step=1", f"checkpoint.dir={base / 'nothing_here'}"),
                   devices=devices, log=messages.append)
  assert fresh.start_step == 0 and fresh.losses == straight.losses[:1]
  assert any("no complete checkpoint" in m and "starting from step 0" in m for m in messages)


def test_incomplete_latest_checkpoint_falls_back_to_the_previous(runs):
  """A save killed midway (no commit marker) is never resumed from: the loop resumes from the
  last complete checkpoint and still reproduces the uninterrupted losses."""
  base, devices, straight, _ = runs
  ck = base / "incomplete"
  shutil.copytree(base / "straight" / "checkpoints", ck)
  (ck / str(2 * N) / COMMIT_MARKER).unlink()
  resumed = loop.run(config(base / "inc", f"checkpoint.dir={ck}"), devices=devices, log=lambda *a: None)
  assert resumed.start_step == N
  assert resumed.losses == straight.losses[N:]


def _truncate_arrays(step_dir, keep_bytes=None):
  """Truncates every OCDBT data file of a checkpoint step (to half, or to `keep_bytes`)."""
  data_files = glob.glob(str(step_dir / "state" / "**" / "d" / "*"), recursive=True)
  assert data_files, "expected OCDBT data files under the state item"
  for f in data_files:
    raw = open(f, "rb").read()
    open(f, "wb").write(raw[: len(raw) // 2 if keep_bytes is None else keep_bytes])


# orbax's pending chunk reads outlive their event loop after a failed read (see test_checkpoint).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_latest_checkpoint_falls_back_saying_so_in_one_line(runs):
  """Step 2N's array files truncated: the run resumes from step N, says which step it skipped
  and why in one line, and still reproduces the uninterrupted losses."""
  base, devices, straight, _ = runs
  ck = base / "corrupt_latest"
  shutil.copytree(base / "straight" / "checkpoints", ck)
  _truncate_arrays(ck / str(2 * N))
  lines = []
  resumed = loop.run(config(base / "cl", f"checkpoint.dir={ck}"), devices=devices, log=lines.append)
  assert resumed.start_step == N and resumed.losses == straight.losses[N:]
  skipped = [l for l in lines if "skipped" in l]
  assert len(skipped) == 1 and "\n" not in skipped[0], lines
  assert skipped[0].startswith(f"skipped checkpoint step {2 * N} (unreadable: ")
  assert skipped[0].endswith(f"resuming from step {N}")
  # It heals: the bad step was moved aside (kept), the run saved that step again, and the next
  # run resumes from the new one.
  aside = ck / f"{2 * N}.aside"
  assert [l for l in lines if l.startswith("moved checkpoint")] == [
      f"moved checkpoint step {2 * N} to {aside} (kept; this run saves step {2 * N} again)"]
  assert resumed.saved_step == 2 * N and (ck / str(2 * N) / COMMIT_MARKER).exists()
  assert len(resumed.moved_aside) == 1 and resumed.moved_aside[0].endswith(f") -> {aside}")
  summary = json.loads((base / "cl" / "summary.json").read_text())
  assert summary["moved_aside"] == resumed.moved_aside
  lines = []
  again = loop.run(config(base / "cl", f"checkpoint.dir={ck}"), devices=devices, log=lines.append)
  assert again.start_step == 2 * N and not any("skipped" in l or "moved" in l for l in lines), lines
  assert sorted(p.name for p in ck.iterdir()) == [str(N), str(2 * N), f"{2 * N}.aside"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_no_readable_checkpoint_is_an_error_naming_each_step(runs):
  base, devices, _, _ = runs
  ck = base / "corrupt"
  shutil.copytree(base / "at_n", ck)
  _truncate_arrays(ck / str(N))
  with pytest.raises(CheckpointCorruptError, match=rf"no good checkpoint in .*corrupt: step {N} \(unreadable: "):
    loop.run(config(base / "c", f"checkpoint.dir={ck}"), devices=devices, log=lambda *a: None)


def test_non_finite_checkpoint_is_skipped(runs):
  """A checkpoint whose parameters hold a NaN (saved by a run without the update check) is passed
  over, naming its first bad leaf; the run resumes from the one before."""
  base, devices, straight, _ = runs
  ck = base / "poisoned"
  shutil.copytree(base / "at_n", ck)
  cfg = config(base / "p", f"checkpoint.dir={ck}")
  trainer = Trainer(cfg, mesh_lib.make_mesh(cfg.mesh, devices))
  with Checkpointer(ck, save_every=1, keep=5) as writer:
    state, extra = loop.restore_any_layout(writer, trainer, trainer.init_state(0), expect={})
    state.params = jax.tree.map(lambda x: x * np.nan, state.params)
    writer.maybe_save(2 * N, state, dict(extra, step=2 * N), force=True)
  lines = []
  resumed = loop.run(cfg, devices=devices, log=lines.append)
  assert resumed.start_step == N and resumed.losses == straight.losses[N:]
  assert any(l.startswith(f"skipped checkpoint step {2 * N} (not finite: first bad leaf params/")
             for l in lines), lines


def test_checkpoint_step_restores_the_chosen_step(runs):
  base, devices, straight, _ = runs
  ck = base / "chosen"
  shutil.copytree(base / "straight" / "checkpoints", ck)  # steps N and 2N
  lines = []
  resumed = loop.run(config(base / "ch", f"checkpoint.dir={ck}", f"checkpoint.step={N}"),
                     devices=devices, log=lines.append)
  assert resumed.start_step == N and resumed.losses == straight.losses[N:]
  with pytest.raises(NoCheckpointError, match=rf"checkpoint step 3 in .*chosen: it does not exist; "
                                              rf"complete steps are \[{N}, {2 * N}\]"):
    loop.run(config(base / "ch2", f"checkpoint.dir={ck}", "checkpoint.step=3"), devices=devices,
             log=lambda *a: None)


def test_command_line_falls_back_in_one_line(runs, tmp_path):
  """launch/train.py into a run directory whose newest checkpoint is truncated: it resumes from
  the one before, and its output holds one line about it: no traceback, no orbax noise."""
  base, _, straight, _ = runs
  run_dir = tmp_path / "run"
  shutil.copytree(base / "straight" / "checkpoints", run_dir / "checkpoints")
  # Cut to a few bytes, the first array read fails while the others are in flight: orbax then
  # closes its event loop under them, whose tracebacks used to flood stderr.
  _truncate_arrays(run_dir / "checkpoints" / str(2 * N), keep_bytes=10)
  root = Path(__file__).resolve().parents[1]
  env = child_env(PYTHONUNBUFFERED="1")
  proc = subprocess.run(
      [sys.executable, str(root / "launch" / "train.py"), *SMALL, *TINY, f"train.steps={2 * N}",
       f"checkpoint.every={N}", "checkpoint.keep=5", f"train.out_dir={run_dir}", "mesh.data=4",
       "train.cpu_devices=4", f"train.compile_cache_dir={os.environ['DISTCA_TEST_COMPILE_CACHE']}"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  output = proc.stdout + proc.stderr
  about = [l for l in output.splitlines() if "skipped checkpoint" in l]
  assert len(about) == 1 and about[0].endswith(f"resuming from step {N}"), output[-3000:]
  assert "Traceback" not in output and "Event loop is closed" not in output, output[-3000:]
  assert len(proc.stderr.splitlines()) <= 5, proc.stderr
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["start_step"] == N and summary["losses"] == straight.losses[N:]


# ----------------------------------------------------------------------------- refused runs


def _snapshot(directory: Path) -> dict[str, bytes]:
  """Every file (and link) under `directory`, by relative path: its bytes (a link: its target)."""
  return {str(p.relative_to(directory)): (os.readlink(p).encode() if p.is_symlink() else
                                          p.read_bytes() if p.is_file() else b"<dir>")
          for p in sorted(directory.rglob("*"))}


@pytest.mark.parametrize("refused, error, advice", [
    ("model.ffn=256", CheckpointMismatchError, "run with its own config"),
    ("checkpoint.step=99", NoCheckpointError, f"complete steps are [{N}]"),
    ("checkpoint.every=0", ConfigError, "the same command with checkpoint.every=N"),
    ("checkpoint.resume=false", ConfigError, "the same command with checkpoint.resume=true"),
])
def test_a_refused_run_changes_nothing_and_its_advice_resumes(runs, tmp_path, refused, error,
                                                              advice):
  """A run refused into another run's directory leaves every file of it as it was (config.json,
  summary.json, checkpoints); the command its message suggests then resumes that run."""
  base, devices, _, _ = runs
  out = tmp_path / "run"
  shutil.copytree(base / "at_n", out / "checkpoints")  # the run stopped at step N
  shutil.copy(base / "half" / "summary.json", out / "summary.json")
  saved = json.loads((base / "half" / "config.json").read_text())
  saved["train"]["out_dir"] = str(out)  # the copy's own
  (out / "config.json").write_text(json.dumps(saved, indent=2))
  before = _snapshot(out)
  with pytest.raises(error) as err:
    loop.run(config(out, refused), devices=devices, log=lambda *a: None)
  assert advice in str(err.value)
  assert _snapshot(out) == before
  # The advice: the run's own config.json, or the same command without the refused setting
  # (stopping where the checkpoint is: restored and accepted, nothing to train).
  again = (load_config(str(out / "config.json"), [f"train.stop_at_step={N}"])
           if error is CheckpointMismatchError else config(out, f"train.stop_at_step={N}"))
  lines = []
  resumed = loop.run(again, devices=devices, log=lines.append)
  assert resumed.start_step == N and any(f"resumed from checkpoint at step {N}" in l for l in lines)


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
  """Eight runs choosing a directory at once, in the same second: eight new directories, each
  created by the run that named it."""
  monkeypatch.setattr(rundir, "RUNS", tmp_path / "runs")
  monkeypatch.setattr(rundir.time, "time", lambda: 1_800_000_000.0)
  barrier = threading.Barrier(8)

  def start(_):
    barrier.wait()
    return rundir.choose(None, "same")

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    chosen = list(pool.map(start, range(8)))
  paths = [p for p, named in chosen]
  assert all(named for _, named in chosen) and len(set(paths)) == 8
  assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(p.name for p in paths)
  assert all(p.is_dir() and not any(p.iterdir()) for p in paths)
