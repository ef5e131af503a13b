"""The checks that every process of a job runs the same config and planned the same step.

In a job of several processes each one plans the whole step on its own host, from the step
number: the batch's layout (which document lies where), the scheduler's placement of the CA-tasks,
the gate's choice and the step's capacities, which fix the shapes the step compiles to. Nothing
else makes them agree. Were one process to plan differently (another config, package version or
data file on one node, or floating-point arithmetic that breaks a tie otherwise on another CPU),
the processes would compile different programs and wait in a collective forever, or run one
program on plans that disagree and train on the wrong rows without a sign.

So at the start the processes compare their configs, a digest per section (`check_config`:
ConfigError naming the sections and the processes that differ), and before each step a digest of
what they planned (`check_agreement`, one all-gather of 16 bytes a process:
`PlanDisagreementError`), and all stop where they would otherwise hang or go wrong.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from distca_jax.config import Config, ConfigError, to_dict
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


def _unlike_process_0(mine: np.ndarray) -> np.ndarray | None:
  """[processes, len(mine)] whether each process's row of `mine` (an int32 [rows, 4] array of
  digests) differs from process 0's; None with one process. A collective otherwise."""
  import jax

  if jax.process_count() == 1:
    return None
  from jax.experimental import multihost_utils

  every = np.asarray(multihost_utils.process_allgather(np.asarray(mine, np.int32)))
  every = every.reshape(jax.process_count(), *mine.shape)
  return (every != every[0]).any(axis=-1)


def check_agreement(step: int, digest: np.ndarray) -> None:
  """Raises PlanDisagreementError on every process if any process's `digest` of `step` differs
  from process 0's. A collective when there are several processes: every process calls it before
  every step."""
  differ = _unlike_process_0(np.asarray(digest)[None])
  if differ is not None and differ.any():
    procs = np.nonzero(differ[:, 0])[0]
    raise PlanDisagreementError(
        f"step {step + 1}: process(es) {', '.join(map(str, procs))} planned a different step "
        f"than process 0 (its batch layout, the attention plan or the step's capacities); every "
        f"process must run the same config, package versions and data (compare their "
        f"`--print-config` and `pip freeze`)")


# Fields a process may set for itself: what it prints and how it waits for the others, not what it
# computes or when it stops (a process that stopped at another step would leave the others
# waiting in a collective).
PER_PROCESS = {"train": ("progress", "tensorboard", "log_every", "cpu_devices", "compile_cache_dir",
                         "init_timeout_s", "heartbeat_timeout_s")}


def config_digests(config: Config) -> tuple[tuple[str, ...], np.ndarray]:
  """(section names, [sections, 4] int32 digests) of `config`, less the `PER_PROCESS` fields."""
  sections = to_dict(config)
  for section, fields in PER_PROCESS.items():
    sections[section] = {k: v for k, v in sections[section].items() if k not in fields}
  names = tuple(sorted(sections))
  rows = [np.frombuffer(hashlib.blake2b(json.dumps(sections[n], sort_keys=True, default=str)
                                        .encode(), digest_size=16).digest(), np.int32)
          for n in names]
  return names, np.stack(rows)


def check_config(config: Config) -> None:
  """Raises ConfigError on every process if any process's config differs from process 0's in a
  section (per-process fields aside). A collective when there are several processes."""
  names, mine = config_digests(config)
  differ = _unlike_process_0(mine)  # [processes, sections]
  if differ is not None and differ.any():
    procs = np.nonzero(differ.any(axis=1))[0]
    sections = [n for n, d in zip(names, differ.any(axis=0)) if d]
    raise ConfigError(
        f"process(es) {', '.join(map(str, procs))} run another config than process 0 in "
        f"{', '.join(sections)}: every process must be given the same config (compare their "
        f"`--print-config`)")
