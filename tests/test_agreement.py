"""The processes' checks (`train/agreement.py`): the step digest is what every process computes
alike for one step and changes with anything that decides the step (batch layout, task
placement, the gate's choice, capacities); two processes that plan differently stop at the first
step with the error, instead of hanging or training on mismatched rows (the two-process runs
are in tests/test_multihost.py); the config digests name the section that differs."""

import dataclasses

import numpy as np

from distca_jax import attention as attention_lib
from distca_jax.data.sources import synthetic_from_config
from distca_jax.models.presets import resolve
from distca_jax.schedule.capacities import StepShapes
from distca_jax.train.agreement import config_digests, step_digest
from helpers import small_config

N = 4


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
