"""The check that every process planned the same step.

In a job of several processes each one plans the whole step on its own host, from the step
number: the batch's layout (which document lies where), the scheduler's placement of the CA-tasks,
the gate's choice and the step's capacities, which fix the shapes the step compiles to. Nothing
else makes them agree. Were one process to plan differently (another config, package version or
data file on one node, or floating-point arithmetic that breaks a tie otherwise on another CPU),
the processes would compile different programs and wait in a collective forever, or run one
program on plans that disagree and train on the wrong rows without a sign.

So before a step runs on the devices the processes compare a digest of what they planned (one
all-gather of 16 bytes a process) and all stop with `PlanDisagreementError`, naming the processes
that differ from process 0, where they would otherwise hang or go wrong.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from distca_jax.data.packing import Layout


class PlanDisagreementError(RuntimeError):
  """The processes of a job planned different steps; the message names the step and the
  processes that differ from process 0."""


def _layout_parts(layout: Layout | None):
  while layout is not None:  # ping-pong's second stream has the first's shards as its prior
    yield np.asarray([layout.num_buffers, layout.buffer_len], np.int64)
    for field in ("doc_lens", "buffer", "buffer_offset", "doc", "doc_offset", "length"):
      yield np.asarray(getattr(layout, field), np.int64)
    layout = layout.prior


def step_digest(step: int, sizes: dict, batch, ctx) -> np.ndarray:
  """[4] int32: a digest of what a step's host work decided that must be the same on every
  process: the step, the run's capacities after it (`StepShapes.sizes`), the batch's layout, the
  context's kind (the gate's choice) and whatever global plan it holds (CAD's and the pipeline's
  task placements, the WLB baseline's packing). What a process builds for its own rows only
  (its dispatch arrays, its tokens) is not in it."""
  h = hashlib.blake2b(digest_size=16)
  # The context's kind: a distca step the gate stopped runs colocated attention.
  h.update(json.dumps([step, sorted(sizes.items()), type(ctx).__name__], default=int).encode())
  parts = list(_layout_parts(batch.layout))
  for plan in getattr(ctx, "plans", ()):
    t = plan.tasks
    parts += [np.asarray(a, np.int64) for a in (t.home, t.doc, t.q_lo, t.q_hi, t.server)]
  packing = getattr(ctx, "packing", None)  # the WLB baseline's re-packing
  if packing is not None:
    parts += [np.asarray([packing.cp], np.int64), *_layout_parts(packing.layout)]
  for a in parts:
    h.update(np.asarray(a.shape, np.int64).tobytes())
    h.update(np.ascontiguousarray(a).tobytes())
  return np.frombuffer(h.digest(), np.int32).copy()


def check_agreement(step: int, digest: np.ndarray) -> None:
  """Raises PlanDisagreementError on every process if any process's `digest` of `step` differs
  from process 0's. A collective when there are several processes: every process calls it before
  every step."""
  import jax

  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils

  every = np.asarray(multihost_utils.process_allgather(np.asarray(digest, np.int32)))
  every = every.reshape(jax.process_count(), -1)
  differ = np.nonzero((every != every[0]).any(axis=1))[0]
  if differ.size:
    raise PlanDisagreementError(
        f"step {step + 1}: process(es) {', '.join(map(str, differ))} planned a different step "
        f"than process 0 (its batch layout, the attention plan or the step's capacities); every "
        f"process must run the same config, package versions and data (compare their "
        f"`--print-config` and `pip freeze`)")
