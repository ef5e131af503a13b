"""What a run fixes before its first step (`Job`), and setting it up.

`set_up` builds the mesh, the trainer and the data source, resumes from the run directory's
newest good checkpoint (read only), checks the resumed data layout, and only then, once nothing
can refuse the run any more, claims the run's directory (config.json, runs/latest), opens the
checkpointer (moving aside the checkpoints the run will save again) and sizes the step shapes.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax

from distca_jax import gate as gate_lib
from distca_jax import mesh as mesh_lib
from distca_jax.config import Config, ConfigError, to_dict
from distca_jax.data.mixture import data_layout, layout_change
from distca_jax.models.presets import resolve
from distca_jax.schedule.capacities import StepShapes
from distca_jax.train import agreement, evaluate, prefetch, rundir
from distca_jax.train.checkpoint import Checkpointer, move_aside, space_problem, state_bytes
from distca_jax.train.resume import resume
from distca_jax.train.step import Trainer


def make_source(config: Config, num_buffers: int):
  shape = resolve(config.model)
  if config.data.mixture:
    from distca_jax.data.mixture import mixture_from_config

    return mixture_from_config(config.data, shape.vocab_size, num_buffers)
  if config.data.source == "corpus":
    from distca_jax.data.corpus import corpus_from_config

    return corpus_from_config(config.data, num_buffers, vocab_size=shape.vocab_size)
  from distca_jax.data.sources import synthetic_from_config

  return synthetic_from_config(config.data, shape.vocab_size, num_buffers)


@dataclasses.dataclass
class Job:
  """What a run fixes before its first step."""

  config: Config            # with the gate's attention cost and nodes the trainer resolved
  mesh: Any
  trainer: Trainer
  source: Any
  out_dir: Path
  main: bool                # process 0: the one that writes files
  last_step: int            # train.steps, or train.stop_at_step if sooner
  checkpointer: Checkpointer | None
  start_step: int           # 0, or the step the run resumed from
  shapes: StepShapes        # step capacities: only grow; a resumed run starts from its checkpoint's
  init_s: float             # model init and restore time (counted in Summary.compile_s)
  moved_aside: list[str] = dataclasses.field(default_factory=list)  # "step s (why) -> path"
  evaluator: Any = None     # evaluate.Evaluator: the held-out batches (None: eval.batches=0)
  # Tokens per source the run read beyond what this layout's counts from step 0 give: nonzero
  # once a resume took a new data layout (data.resume_new_layout).
  tokens_base: dict[str, int] = dataclasses.field(default_factory=dict)

  def tokens_by_source(self, steps: int) -> dict[str, int]:
    """Tokens each source gave the run's first `steps` steps."""
    now = self.source.tokens_by_source(steps * self.config.train.microbatches)
    return {k: v + self.tokens_base.get(k, 0) for k, v in now.items()}


def set_up(config: Config, devices, log, name: str) -> tuple[Job, Any]:
  """Mesh, trainer, data source, the run's directory and the state: fresh or restored."""
  agreement.check_config(config)  # several processes: all run this config
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  trainer = Trainer(config, mesh)
  main = jax.process_index() == 0
  if config.attention.impl == "distca" and config.attention.gate and main:
    log("CAD gate: attention cost " + gate_lib.describe_gate_cost(config.attention, trainer.kernel)
        + gate_lib.describe_nodes(trainer.config.attention))
  if config.attention.impl == "distca" and main:
    log(f"CAD exchange: {trainer.exchange_reason}")
  config = trainer.config  # with the gate's attention cost of the kernel the run takes
  source = make_source(config, mesh.shape["data"])
  if config.train.profile and (config.train.profile_start < 1 or config.train.profile_steps < 1):
    raise ConfigError("train.profile_start and train.profile_steps: must be >= 1")
  out_dir, ck_dir, named, has_steps = _run_dir(config, name)
  last_step = config.train.steps
  if config.train.stop_at_step is not None:
    last_step = min(last_step, config.train.stop_at_step)
  t0 = time.perf_counter()
  # With model.init_from, a run that resumes its own checkpoint never reads the source's
  # parameters: the checkpoint restores into the state's shapes and shardings alone.
  from_source = config.model.init_from is not None
  state = trainer.abstract_state() if from_source else trainer.init_state(config.train.seed)
  shapes = StepShapes()
  checkpointer, start_step, newer, extra = None, 0, [], None
  if config.checkpoint.every > 0:
    state, start_step, newer, extra = _resume(config.checkpoint, ck_dir, trainer, state, shapes,
                                              main and not named, log)
  if from_source and start_step == 0:
    state = trainer.init_state(config.train.seed)
  job = Job(config=config, mesh=mesh, trainer=trainer, source=source, out_dir=out_dir, main=main,
            last_step=last_step, checkpointer=checkpointer, start_step=start_step, shapes=shapes,
            init_s=0.0)
  if extra is not None:
    job.tokens_base = _resumed_data(job, extra.get("data"), log)
  job.evaluator = evaluate.make_evaluator(config, trainer, make_source, mesh_lib.local_rows(mesh))
  # Every check that can refuse the run is behind: only from here is its directory written.
  _claim_run_dir(config, out_dir, named, has_steps, main, log)
  if config.checkpoint.every > 0:
    job.checkpointer, job.moved_aside = _open_checkpoints(config.checkpoint, ck_dir, newer, main,
                                                          log)
  prefetch.size_shapes(job, log)
  job.init_s = time.perf_counter() - t0
  return job, state


def _resumed_data(job: Job, saved: dict | None, log) -> dict[str, int]:
  """Checks that the resumed checkpoint's data layout is this run's (else a ConfigError, unless
  data.resume_new_layout) and returns `Job.tokens_base`."""
  if not saved:  # a checkpoint that keeps no data layout
    return {}
  c = job.config
  now = data_layout(c.data, job.mesh.shape["data"], c.train.microbatches)
  change = layout_change(saved["layout"], now)
  if change and not c.data.resume_new_layout:
    raise ConfigError(f"data layout: the checkpoint at step {job.start_step} was trained on "
                      f"another ({change}), so its batches would not continue; set "
                      f"data.resume_new_layout=true to continue with this layout")
  if change and job.main:
    log(f"data layout changed at step {job.start_step} ({change}): continuing with the new one")
  # Zero unless some resume took a new layout: the counts carry what the old one read.
  at = job.source.tokens_by_source(job.start_step * c.train.microbatches)
  base = {k: v - at.get(k, 0) for k, v in saved.get("tokens_by_source", {}).items()}
  return {k: v for k, v in base.items() if v}


def _run_dir(config: Config, name: str) -> tuple[Path, Path, bool, bool]:
  """(the run's directory, its checkpoint directory, whether the directory was named here (a new,
  empty one), whether it holds checkpoints), refusing one whose checkpoints the run would
  ignore. Writes nothing into an existing directory."""
  out_dir, named = rundir.choose(config.train.out_dir, name)
  ck_dir = Path(config.checkpoint.dir) if config.checkpoint.dir else out_dir / "checkpoints"
  has_steps = rundir.check_reuse(ck_dir, config.checkpoint.every, config.checkpoint.resume)
  return out_dir, ck_dir, named, bool(has_steps)


def _claim_run_dir(config: Config, out_dir: Path, named: bool, has_steps: bool, main: bool,
                   log) -> None:
  """Process 0 writes config.json (after saying how it differs from the one a resumed run had)
  and links runs/latest: only once nothing can refuse the run any more."""
  if main:
    changes = rundir.config_changes(out_dir / "config.json", config) if has_steps else []
    if changes:
      log(f"{out_dir}: resuming with a config that differs from its config.json in "
          + "; ".join(changes))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(to_dict(config), indent=2))
    if named:
      rundir.link_latest(out_dir)
    log(f"run directory {out_dir}" + (f" ({rundir.RUNS / rundir.LATEST} links it)" if named else ""))


def _resume(ck, ck_dir: Path, trainer: Trainer, state, shapes: StepShapes, say: bool,
            log) -> tuple[Any, int, list[tuple[int, str]], dict | None]:
  """(state, first step, the checkpoints newer than it, each with why it was passed over, the
  checkpoint's `extra` or None): the
  disk's room for a checkpoint checked before the first step, and with `checkpoint.resume` the
  newest good checkpoint restored (its step capacities into `shapes`), read only: a refusal
  leaves the directory as it was. `say`: report a start from step 0."""
  problem = space_problem(ck_dir, state_bytes(state))
  if problem:
    raise ConfigError(f"checkpoint.dir: {problem}")
  if not ck.resume:
    return state, 0, [], None
  with Checkpointer(ck_dir, save_every=ck.every, keep=ck.keep, read_only=True,
                    verify=ck.verify) as reader:
    state, extra, newer = resume(reader, trainer, state, ck.step, say, log)
  if extra is None:
    return state, 0, [], None
  shapes.sizes.update(extra.get("step_shapes", {}))
  return state, int(extra["step"]), newer, extra


def _open_checkpoints(ck, ck_dir: Path, newer: list[tuple[int, str]], main: bool,
                      log) -> tuple[Checkpointer, list[str]]:
  """(the run's checkpointer, "step s (why) -> where" per checkpoint moved aside): the
  checkpoints newer than the one the run resumed from are renamed, not deleted, so the run saves
  those steps again (`checkpoint.move_aside`)."""
  moved = []
  if newer:
    if main:
      for step, why in newer:
        target = move_aside(ck_dir, step)
        moved.append(f"step {step} ({why}) -> {target}")
        log(f"moved checkpoint step {step} to {target} (kept; this run saves step {step} again)")
    if jax.process_count() > 1:  # the others open the directory once process 0 renamed
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices("distca: checkpoints moved aside")
  return Checkpointer(ck_dir, save_every=ck.every, keep=ck.keep, verify=ck.verify), moved
