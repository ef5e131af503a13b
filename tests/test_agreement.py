"""The processes' checks (`train/agreement.py`): the step digest is what every process computes
alike for one step and changes with anything that decides the step (batch layout, task
placement, the gate's choice, capacities); two processes that plan differently stop at the first
step with the error, instead of hanging or training on mismatched rows; two processes given
different configs stop before training, naming the section."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distca_jax import attention as attention_lib
from distca_jax.data.sources import synthetic_from_config
from distca_jax.models.presets import resolve
from distca_jax.schedule.capacities import StepShapes
from distca_jax.train.agreement import config_digests, step_digest
from helpers import small_config

N = 4
ROOT = Path(__file__).resolve().parents[1]


def _planned(step: int, *overrides: str):
  """(sizes, batch, context) of `step` as a fresh process plans it (its own source and shapes)."""
  cfg = small_config(f"mesh.data={N}", "attention.impl=distca", "attention.epsilon=0.05",
                     "data.distribution=prolong", *overrides)
  batch = synthetic_from_config(cfg.data, 512, N).batch(step)
  shapes = StepShapes()
  ctx = attention_lib.host_context(cfg.attention, batch, resolve(cfg.model), shapes=shapes)
  return dict(shapes.sizes), batch, ctx


def test_digest_is_the_same_for_the_same_step_and_changes_with_what_decides_it():
  sizes, batch, ctx = _planned(3)
  d = step_digest(3, sizes, batch, ctx)
  assert d.dtype == np.int32 and d.shape == (4,)
  np.testing.assert_array_equal(d, step_digest(3, *_planned(3)))  # another "process", same step
  assert ctx.cad and any(p.stats.moves for p in ctx.plans)

  differs = lambda *args: not np.array_equal(d, step_digest(*args))
  assert differs(4, sizes, batch, ctx)                                     # the step number
  assert differs(3, *_planned(3, "data.seed=1"))                           # another batch
  assert differs(3, {**sizes, next(iter(sizes)): -1}, batch, ctx)          # a capacity
  gated = attention_lib.host_context(small_config("attention.impl=colocated").attention, batch)
  assert differs(3, sizes, batch, gated)                                   # the gate's choice
  # One task placed on another server, everything else alike.
  plan = ctx.plans[0]
  moved = int(np.argmax(plan.tasks.server != plan.tasks.home))
  server = plan.tasks.server.copy()
  server[moved] = (server[moved] + 1) % N
  other = dataclasses.replace(plan, tasks=dataclasses.replace(plan.tasks, server=server))
  assert differs(3, sizes, batch, dataclasses.replace(ctx, plans=(other, *ctx.plans[1:])))


def test_digest_of_a_colocated_and_a_wlb_step():
  """Contexts without a CAD plan: the layout and capacities decide; the WLB baseline's packing
  too."""
  sizes, batch, ctx = _planned(2, "attention.impl=colocated")
  d = step_digest(2, sizes, batch, ctx)
  np.testing.assert_array_equal(d, step_digest(2, *_planned(2, "attention.impl=colocated")))
  assert not np.array_equal(d, step_digest(2, *_planned(2, "attention.impl=colocated",
                                                          "data.seed=1")))


def test_config_digests_name_the_section_and_leave_per_process_fields_out():
  names, d = config_digests(small_config())
  _, same = config_digests(small_config("train.progress=true", "train.log_every=5"))
  np.testing.assert_array_equal(d, same)
  _, other = config_digests(small_config("optim.lr=0.1", "train.steps=7"))
  assert [n for n, a, b in zip(names, d, other) if (a != b).any()] == ["optim", "train"]


def _two_processes(tmp_path, args_of, cwd_of=lambda i: ROOT):
  """Two jax.distributed processes of 4 CPU devices running launch/train.py, process i with
  `args_of(i)` in `cwd_of(i)`: [(exit code, stderr)] once both ended."""
  from test_multihost import ARGS, _cache_dir, _env, _free_port

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
  file on one node): both exit 1 before the first step runs, naming process 1. Without the
  check they trained to the end, CAD on plans that disagree."""
  for i in range(2):
    (tmp_path / f"p{i}").mkdir()
    lengths = [40, 300, 90, 700, 25, 128] if i == 0 else [500, 60, 200, 33, 900]
    (tmp_path / f"p{i}" / "lens.json").write_text(json.dumps(lengths))
  got = _two_processes(tmp_path, lambda i: ["data.distribution=lens.json", "data.length_scale=1"],
                       cwd_of=lambda i: tmp_path / f"p{i}")
  for rc, out in got:
    assert rc == 1, out
    assert "training stopped: step 1: process(es) 1 planned a different step" in out, out


def test_processes_with_different_configs_stop_before_training(tmp_path):
  got = _two_processes(tmp_path, lambda i: [f"optim.lr={1e-3 * (i + 1)}"])
  for rc, out in got:
    assert rc == 2, out
    assert "config error: process(es) 1 run another config than process 0 in optim" in out, out
