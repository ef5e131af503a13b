"""Multi-process training on one host: `launch/tools/multihost_local.sh 2 4` (2 jax.distributed
processes x 4 CPU devices, collectives over gloo) trains exactly like 1 process x 8 devices;
processes given different configs, or planning different steps, stop naming the one that differs; a
SIGTERM to the launcher stops both processes after the same step with a checkpoint that resumes
bit for bit; a dead process ends the job within seconds; an unreachable coordinator ends the run
with a clear message within the configured timeout; the launcher's environment (XLA flags,
NCCL_NVLS_ENABLE) respects what the user set.
"""

import fcntl
import json
import os
import shutil
import signal
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
from helpers import child_env, small_config

ROOT = Path(__file__).resolve().parents[1]
# The schema's attention and no evaluation (launch/train.py starts from the default job's
# configs/tiny.yaml); a case's own arguments come after.
ARGS = ["attention.impl=colocated", "eval.batches=0",
        "model.dtype=float32", "model.remat=none", "model.layers=1", "model.hidden=64", "model.ffn=128",
        "model.vocab_size=256", "data.tokens_per_device=256", "data.length_scale=64",
        "train.progress=false", "train.tensorboard=false", "train.imbalance_after=false",
        "train.steps=2",
        # The learning-rate schedule a fixed length, not the run's: a run of more steps compiles the
        # same program (the dead-process run loads the step the others compiled).
        "optim.decay_steps=100",
        "attention.gate=false"]  # distca: the exchange runs on every step, however balanced


def _cache_dir() -> str:
  return os.environ.setdefault("DISTCA_TEST_COMPILE_CACHE", tempfile.mkdtemp(prefix="distca_compile_cache_"))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env():
  env = child_env(PYTHONUNBUFFERED="1")
  return env


def _launcher(out: Path, logs: Path, *args: str) -> list[str]:
  return ["bash", str(ROOT / "launch" / "tools" / "multihost_local.sh"), "2", "4", *ARGS, *args,
          f"train.out_dir={out}", f"train.compile_cache_dir={_cache_dir()}"]


def _two_processes(tmp_path: Path, name: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(_launcher(tmp_path / name, tmp_path / f"{name}_logs", *args), cwd=ROOT,
                        env=dict(_env(), DISTCA_LOG_DIR=str(tmp_path / f"{name}_logs")),
                        capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="module")
def distca_two():
  """The uninterrupted 2-process CAD run (its directory, with its final checkpoint), run once for
  the whole test run: by the first pytest-xdist worker that needs it, while a second waits on the
  lock and then reads the same directory (next to the shared compilation cache)."""
  enable_compile_cache(_cache_dir())
  tmp = Path(_cache_dir() + "_distca_two")
  tmp.mkdir(exist_ok=True)
  with open(tmp / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (tmp / "done").exists():
      shutil.rmtree(tmp / "two", ignore_errors=True)  # a failed attempt's: never resumed
      proc = _two_processes(tmp, "two", "attention.impl=distca")
      assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
      (tmp / "done").touch()
  return tmp


@pytest.mark.parametrize("impl", ["distca", "wlb", "pipeline"])
def test_two_processes_match_one_process(tmp_path, impl, request):
  """distca: the exchange crosses processes, and each process checks only its own rows' plans
  (colocated attention's path is the same one without the exchange: no case of its own).
  wlb: each process re-packs only the buffers it feeds, its tokens read from the stream.
  pipeline (CAD in a 2-stage pipeline): each process builds only its data ranks' micro-batches."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 CPU devices (tests/conftest.py sets them)")
  enable_compile_cache(_cache_dir())
  extra = {"wlb": ["attention.impl=colocated", "data.packing=wlb"],
           "pipeline": ["attention.impl=distca", "attention.pingpong=false", "mesh.pipe=2",
                        "mesh.data=4", "model.layers=2", "train.microbatches=1", "model.remat=full",
                        # one step: its second compiles again (grown capacities), and the other
                        # cases already check that each process's stream goes on alike
                        "train.steps=1"]}.get(
                            impl, [f"attention.impl={impl}"])
  data = 4 if impl == "pipeline" else 8
  args = [*ARGS, *extra]
  one = loop.run(small_config(*args, f"train.out_dir={tmp_path / 'one'}"), devices=jax.devices()[:8],
                 log=lambda *a: None)
  if impl == "distca":
    base = request.getfixturevalue("distca_two")
  else:
    base = tmp_path
    proc = _two_processes(base, "two", *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Gloo's connection messages stay out of the job's output (process 0's log has them).
    assert "[Gloo]" not in proc.stdout and "[Gloo]" in (base / "two_logs" / "process_0.log").read_text()
  out = base / "two"
  two = json.loads((out / "summary.json").read_text())
  assert two["devices"] == 8 and two["mesh_shape"]["data"] == data
  # Same global batch, same parameters; only the reduction order of the collectives differs.
  np.testing.assert_allclose(two["losses"], one.losses, rtol=1e-5)
  # Every process grows the same step capacities at the same step (same global plans).
  assert two["step_shapes"] == one.step_shapes and two["compile_count"] == one.compile_count
  # Both processes run on this host: the gate's node map (host names gathered from every
  # process) is one node.
  config = json.loads((out / "config.json").read_text())
  assert config["attention"]["data_rank_nodes"] == [0] * data
  # Process 1 ran the same steps but wrote no files and printed no per-step lines.
  log1 = (base / "two_logs" / "process_1.log").read_text()
  assert "step 1:" not in log1 and "loss " in log1


def _start(tmp_path: Path, name: str, *args: str) -> subprocess.Popen:
  """The 2-process launcher in the background, its stdout (process 0's) in a file."""
  out = open(tmp_path / f"{name}.out", "w")
  return subprocess.Popen(_launcher(tmp_path / name, tmp_path / f"{name}_logs", *args), cwd=ROOT,
                          env=dict(_env(), DISTCA_LOG_DIR=str(tmp_path / f"{name}_logs"),
                                   DISTCA_KILL_GRACE_S="3"),
                          stdout=out, stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 300) -> None:
  t0 = time.monotonic()
  while text not in path.read_text():
    assert proc.poll() is None, f"ended before {text!r}: " + path.read_text()[-3000:]
    assert time.monotonic() - t0 < timeout, f"no {text!r} after {timeout} s"
    time.sleep(0.2)


def _checkpoint_state(directory: Path, step: int):
  from distca_jax.train.checkpoint import Checkpointer

  with Checkpointer(directory, save_every=1, keep=5, read_only=True) as ck:
    # Saved by 2 processes: read every array whole onto this process's first device.
    stored = ck._manager.item_metadata(step).state
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), stored)
    return ck.restore(step, abstract_state=target)[0]


def test_sigterm_stops_every_process_with_a_checkpoint_that_resumes_exactly(tmp_path, distca_two):
  """SIGTERM to the launcher, once both trainers run their loop: both stop after step 1 (the step
  they are in), save it, write the summary and exit 143; the launcher exits 143. The same command
  resumes from step 1: its step 2 loss and its final state equal the uninterrupted run's bit for
  bit."""
  proc = _start(tmp_path, "a", "attention.impl=distca")
  _wait_for(tmp_path / "a.out", "run directory", proc)  # the stop handlers are installed
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=300) == 143, (tmp_path / "a.out").read_text()[-3000:]
  stopped = json.loads((tmp_path / "a" / "summary.json").read_text())
  assert stopped["interrupted"] == "SIGTERM" and stopped["steps"] == 1 and stopped["saved_step"] == 1
  assert "received SIGTERM" in (tmp_path / "a_logs" / "process_1.log").read_text()
  assert "stopped by SIGTERM after step 1; checkpoint at step 1" in (tmp_path / "a.out").read_text()

  proc = _two_processes(tmp_path, "a", "attention.impl=distca")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "resumed from checkpoint at step 1" in proc.stdout
  resumed = json.loads((tmp_path / "a" / "summary.json").read_text())
  straight = json.loads((distca_two / "two" / "summary.json").read_text())
  assert resumed["start_step"] == 1 and resumed["losses"] == straight["losses"][1:]
  a = _checkpoint_state(tmp_path / "a" / "checkpoints", 2)
  b = _checkpoint_state(distca_two / "two" / "checkpoints", 2)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_dead_process_ends_the_job_within_seconds(tmp_path):
  """kill -9 of process 1 mid-run: the launcher stops process 0 (SIGTERM, then SIGKILL after
  DISTCA_KILL_GRACE_S=3 s: it waits in a collective for the dead peer) and exits non-zero."""
  proc = _start(tmp_path, "d", "attention.impl=distca", "train.steps=400")
  _wait_for(tmp_path / "d.out", "step 2:", proc)
  trainers = {i: _child(proc.pid, f"--process-id {i} ") for i in (0, 1)}
  t0 = time.monotonic()
  os.kill(trainers[1], signal.SIGKILL)
  rc = proc.wait(timeout=120)
  assert rc != 0 and time.monotonic() - t0 < 30, (rc, time.monotonic() - t0)
  assert "failed (exit 137); stopping the others" in (tmp_path / "d.out").read_text()
  assert not Path(f"/proc/{trainers[0]}").exists() or "zombie" in _state(trainers[0])


def _child(parent: int, text: str) -> int:
  """The pid of `parent`'s child process whose command line contains `text`."""
  for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
      ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
      cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, IndexError, ValueError):
      continue
    if ppid == parent and text in cmdline:
      return int(stat.parent.name)
  raise AssertionError(f"no child of {parent} runs {text!r}")


def _state(pid: int) -> str:
  try:
    return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
  except (OSError, IndexError):
    return "gone"


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


def test_distributed_start_passes_the_heartbeat_timeout(monkeypatch):
  """`train.heartbeat_timeout_s` reaches jax.distributed: a peer silent that long is declared dead
  and the survivors end (JAX's own default would leave them waiting 100 s)."""
  from distca_jax import mesh as mesh_lib

  seen = {}
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
  monkeypatch.setattr(mesh_lib, "_wait_for_port", lambda *a: None)
  mesh_lib.initialize_distributed("localhost:1", 2, 0, timeout_s=7, heartbeat_s=11)
  assert seen["heartbeat_timeout_seconds"] == 11 and seen["initialization_timeout"] == 7


def test_a_coordinator_without_a_port_is_one_clear_line(monkeypatch):
  """Process 0 too (it never waits for the port): jax.distributed would index the address as
  host:port and end in an IndexError."""
  from distca_jax import mesh as mesh_lib

  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("reached jax"))
  with pytest.raises(mesh_lib.DistributedInitError, match=r"^--coordinator 'notahost': expected "
                                                          r"host:port \(e.g. notahost:12345\)$"):
    mesh_lib.initialize_distributed("notahost", 2, 0)


def _differing_pair(tmp_path, args_of, cwd_of=lambda i: ROOT):
  """Two jax.distributed processes of 4 CPU devices running launch/train.py with CAD, process i
  with `args_of(i)` in `cwd_of(i)` (not the launcher, which gives both the same arguments):
  [(exit code, the end of its output)] once both ended."""
  port = _free_port()
  procs = []
  for i in range(2):
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--coordinator", f"127.0.0.1:{port}",
           "--num-processes", "2", "--process-id", str(i), *ARGS, "attention.impl=distca",
           "train.cpu_devices=4", f"train.out_dir={tmp_path / 'run'}",
           f"train.compile_cache_dir={_cache_dir()}", *args_of(i)]
    procs.append(subprocess.Popen(cmd, cwd=cwd_of(i), env=_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
  try:
    outs = [p.communicate(timeout=300) for p in procs]
  finally:
    for p in procs:
      p.kill()
  return [(p.returncode, out[-2000:] + err[-2000:]) for p, (out, err) in zip(procs, outs)]


def test_processes_that_plan_differently_stop_at_the_first_step(tmp_path):
  """The same config, but each process reads its own file of document lengths (another data
  file on one node): both exit 1 before the first step runs, naming process 1
  (`train/agreement.py`; without the check one process aborts in the step)."""
  for i in range(2):
    (tmp_path / f"p{i}").mkdir()
    lengths = [40, 300, 90, 700, 25, 128] if i == 0 else [500, 60, 200, 33, 900]
    (tmp_path / f"p{i}" / "lens.json").write_text(json.dumps(lengths))
  got = _differing_pair(tmp_path, lambda i: ["data.distribution=lens.json", "data.length_scale=1"],
                       cwd_of=lambda i: tmp_path / f"p{i}")
  for rc, out in got:
    assert rc == 1, out
    assert "training stopped: step 1: process(es) 1 planned a different step" in out, out


def test_processes_with_different_configs_stop_before_training(tmp_path):
  """Configs that differ in a section: both processes exit 2 naming it and process 1."""
  got = _differing_pair(tmp_path, lambda i: [f"optim.lr={1e-3 * (i + 1)}"])
  for rc, out in got:
    assert rc == 2, out
    assert "config error: process(es) 1 run another config than process 0 in optim" in out, out


def test_two_processes_start_from_the_same_checkpoint(tmp_path):
  """`model.init_from` with 2 processes, each reading only the slices its devices hold: the
  step-0 loss is transformers' equations' on the run's first batch (`helpers.hf_batch_loss`)."""
  from helpers import HF_TINY, hf_batch_loss, hf_tensors, write_hf_checkpoint

  cfg = dict(HF_TINY, num_hidden_layers=1, intermediate_size=128, vocab_size=256)
  tensors = hf_tensors(cfg)
  write_hf_checkpoint(tmp_path / "hf", cfg, tensors, shards=2)
  extra = [f"model.init_from={tmp_path / 'hf'}", "train.steps=1", "attention.impl=colocated",
           "mesh.tensor=2", "checkpoint.every=0"]
  proc = _two_processes(tmp_path, "two", *extra)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  two = json.loads((tmp_path / "two" / "summary.json").read_text())
  batch = loop.make_source(small_config(*ARGS, *extra), 4).batch(0)
  np.testing.assert_allclose(two["losses"][0], hf_batch_loss(tensors, cfg, batch), rtol=1e-5)
