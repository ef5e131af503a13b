"""Multi-process training on one host: `launch/multihost_local.sh 2 4` (2 jax.distributed
processes x 4 CPU devices, collectives over gloo) trains exactly like 1 process x 8 devices; an
unreachable coordinator ends the run with a clear message within the configured timeout; the
launcher's environment (XLA flags, NCCL_NVLS_ENABLE) respects what the user set.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from distca_jax import launch_env
from distca_jax.launch_env import enable_compile_cache
from distca_jax.train import loop
from helpers import small_config

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["model.dtype=float32", "model.remat=none", "model.layers=1", "model.hidden=64", "model.ffn=128",
        "model.vocab_size=256", "data.tokens_per_device=256", "data.length_scale=64",
        "train.progress=false", "train.tensorboard=false", "train.imbalance_after=false",
        "train.steps=2",
        "attention.gate=false"]  # distca: the exchange runs on every step, however balanced


def _cache_dir() -> str:
  return os.environ.setdefault("DISTCA_TEST_COMPILE_CACHE", tempfile.mkdtemp(prefix="distca_compile_cache_"))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  env.pop("XLA_FLAGS", None)  # the launcher sets the device count per process
  return env


@pytest.mark.parametrize("impl", ["colocated", "distca"])
def test_two_processes_match_one_process(tmp_path, impl):
  """distca: the exchange crosses processes, and each process checks only its own rows' plans."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 CPU devices (tests/conftest.py sets them)")
  enable_compile_cache(_cache_dir())
  args = [*ARGS, f"attention.impl={impl}"]
  one = loop.run(small_config(*args, f"train.out_dir={tmp_path / 'one'}"), devices=jax.devices()[:8],
                 log=lambda *a: None)
  out = tmp_path / "two"
  proc = subprocess.run(
      ["bash", str(ROOT / "launch" / "multihost_local.sh"), "2", "4", *args, f"train.out_dir={out}",
       f"train.compile_cache_dir={_cache_dir()}"],
      cwd=ROOT, env=dict(_env(), DISTCA_LOG_DIR=str(tmp_path / "logs")), capture_output=True,
      text=True, timeout=400)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  two = json.loads((out / "summary.json").read_text())
  assert two["devices"] == 8 and two["mesh_shape"]["data"] == 8
  # Same global batch, same parameters; only the reduction order of the collectives differs.
  np.testing.assert_allclose(two["losses"], one.losses, rtol=1e-5)
  # Every process grows the same step capacities at the same step (same global plans).
  assert two["step_shapes"] == one.step_shapes and two["compile_count"] == one.compile_count
  # Both processes run on this host: the gate's node map (host names gathered from every
  # process) is one node.
  config = json.loads((out / "config.json").read_text())
  assert config["attention"]["gate_nodes"] == [0] * 8
  # Process 1 ran the same steps but wrote no files and printed no per-step lines.
  log1 = (tmp_path / "logs" / "process_1.log").read_text()
  assert "step 1:" not in log1 and "loss " in log1


def test_unreachable_coordinator_fails_fast_and_clearly(tmp_path):
  port = _free_port()  # nothing listens there
  t0 = time.monotonic()
  proc = subprocess.run(
      [sys.executable, str(ROOT / "launch" / "train.py"), "--coordinator", f"127.0.0.1:{port}",
       "--num-processes", "2", "--process-id", "1", "train.init_timeout_s=2",
       f"train.out_dir={tmp_path}", "train.cpu_devices=2"],
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
  elapsed = time.monotonic() - t0
  assert proc.returncode == 3, proc.stderr[-2000:]
  assert f"coordinator 127.0.0.1:{port} unreachable after 2 s" in proc.stderr
  assert "train.init_timeout_s" in proc.stderr
  assert elapsed < 60


def test_launcher_environment_respects_user_settings(monkeypatch):
  monkeypatch.setattr(launch_env, "_backends_started", lambda: False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
  monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
  launch_env.configure_xla(cpu_devices=4)
  flags = os.environ["XLA_FLAGS"].split()
  assert flags[0] == "--xla_gpu_enable_latency_hiding_scheduler=false"  # the user's choice wins
  assert not any(f.endswith("latency_hiding_scheduler=true") for f in flags)
  assert "--xla_force_host_platform_device_count=4" in flags
  assert set(launch_env.GPU_XLA_FLAGS[1:]) <= set(flags)
  assert os.environ["NCCL_NVLS_ENABLE"] == "0"
  monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
  launch_env.configure_xla()
  assert os.environ["NCCL_NVLS_ENABLE"] == "1"
