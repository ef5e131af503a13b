"""Where a run starts: the newest good checkpoint of its directory (or `checkpoint.step`),
restored into the current mesh and pipeline layout, or step 0.

A checkpoint that cannot be read (a truncated array file), that differs from its checksums or
that holds a NaN or Inf is passed over for the next older one, and the run says so in one line;
the caller moves the checkpoints newer than the one resumed aside, so the run saves those steps
again. A checkpoint of another model is refused with how to resume it or start afresh.
"""

from __future__ import annotations

from typing import Any

import jax

from distca_jax.train.checkpoint import Checkpointer, CheckpointMismatchError
from distca_jax.train.finite import first_nonfinite_leaf


def resume(checkpointer: Checkpointer, trainer, state, step: int | None, main: bool,
           log) -> tuple[Any, dict[str, Any] | None, list[tuple[int, str]]]:
  """(state, its checkpoint's `extra`, (step, why) per checkpoint newer than it) to start from:
  the newest good checkpoint (or `step`), or the fresh `state`, None and [] when the directory
  has none. Newer checkpoints are the ones passed over as bad, and with `step` the ones after
  it. `trainer`: the run's `Trainer` (shape, pipeline stages, relayout); `main`: whether this
  process reports skipped checkpoints and a start from step 0."""
  if step is None and checkpointer.latest_step() is None:
    if main:
      init_from = trainer.config.model.init_from
      log(f"no complete checkpoint in {checkpointer.directory}: starting from step 0"
          + (f" with the parameters of {init_from}" if init_from else ""))
    return state, None, []
  expect = {"model": trainer.shape.record()}

  def problem(tree) -> str | None:
    leaf = first_nonfinite_leaf(tree)
    return None if leaf is None else f"not finite: first bad leaf {leaf}"

  try:
    restored, extra, skipped = checkpointer.restore_newest_good(
        lambda s: restore_any_layout(checkpointer, trainer, state, expect, step=s), step=step,
        problem=problem)
  except CheckpointMismatchError as e:
    raise CheckpointMismatchError(
        f"{e}; to resume it, run with its own config ({checkpointer.directory.parent / 'config.json'}); "
        f"to start afresh, another train.out_dir") from None
  start = int(extra["step"])
  if skipped and main:
    log(f"skipped checkpoint {'; '.join(f'step {s} ({why})' for s, why in skipped)}: resuming "
        f"from step {start}")
  skipped += [(s, f"newer than checkpoint.step={step}") for s in checkpointer.all_steps()
              if step is not None and s > step]
  saved = extra.get("pipeline_stages", 1)
  log(f"resumed from checkpoint at step {start}" + (
      f" (saved with {saved} pipeline stages, now {trainer.stages})" if saved != trainer.stages else ""))
  return restored, extra, skipped


def restore_any_layout(checkpointer, trainer, state, expect: dict[str, Any],
                       step: int | None = None) -> tuple[Any, dict]:
  """Restores checkpoint `step` (default: the latest) into `state`'s shardings, whatever the
  pipeline stages it was saved with (`extra["pipeline_stages"]`, 1 when absent): a checkpoint of
  another layout is read in its own layout (shardings XLA derives from the current ones through
  the relayout) and converted (`Trainer.relayout`), so a run can resume with more, fewer or no
  pipeline stages."""
  step, stored = checkpointer.read_extra(step)  # restore that same step below
  saved, now = int(stored.get("pipeline_stages", 1)), trainer.stages
  abstract = lambda tree, shardings: jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
  current = jax.tree.map(lambda x: x.sharding, state)
  if saved == now:
    return checkpointer.restore(step, abstract_state=abstract(state, current), expect=expect)
  to_saved = jax.jit(lambda s: trainer.relayout(s, now, saved))
  saved_shardings = to_saved.lower(state).compile().output_shardings
  restored, extra = checkpointer.restore(
      step, abstract_state=abstract(jax.eval_shape(to_saved, state), saved_shardings), expect=expect)
  to_now = jax.jit(lambda s: trainer.relayout(s, saved, now), out_shardings=current)
  return to_now(restored), extra
