"""Checkpoints: a thin layer over `orbax.checkpoint.CheckpointManager` (orbax-checkpoint 0.12.x).

A checkpoint of step s is the directory `DIR/s/` with two items:

  state   the training state, a pytree of (possibly sharded) jax arrays, stored by orbax's
          StandardCheckpointHandler (tensorstore/OCDBT; every host writes its own shards).
  extra   a small JSON dict: the data iterator's step, the model shape the state belongs to, ...

What this layer adds to orbax:

  * Saves are asynchronous: `maybe_save` returns once the arrays are copied off the devices (so
    the caller may donate or overwrite them), and the files are written in a background thread.
  * Only *complete* checkpoints are visible. Orbax writes a step into `s.orbax-checkpoint-tmp-*`,
    writes `commit_success.txt` into it, then renames it to `s/` (commit-file mode on object
    stores writes `s/` in place and the marker last). A save killed midway therefore leaves either
    a tmp directory (orbax ignores it) or a step directory without the marker, which orbax 0.12
    would list as a step; `all_steps` drops those too, so `restore()` never picks one.
  * `restore` places arrays with the shardings of an abstract state (so a checkpoint taken on one
    mesh restores onto another), checks the stored tree and shapes against it first, checks the
    stored `extra` against what the caller expects (e.g. the model shape), and turns orbax's
    low-level failures into `NoCheckpointError`, `CheckpointMismatchError` or
    `CheckpointCorruptError` naming the step and the problem.
  * A save that fails (a full disk, a directory that went away) raises `CheckpointSaveError`, one
    line naming the directory and the cause, at the next `check_saves()` (the loop calls it at
    every step boundary) rather than at the next save; `maybe_save` refuses up front a save the
    disk has no room for (`space_problem`).
  * Every save records a checksum of each array and of `extra` in the same commit
    (`integrity.py`); `restore` (with `verify`, the default) checks them on the restored arrays
    and raises `CheckpointIntegrityError` on a difference: a flipped bit that the file formats
    would load as a silently different value.
  * `restore_newest_good` falls back from a checkpoint that cannot be read, does not match its
    checksums, or that the caller finds bad (e.g. not finite), to the newest one that is good;
    `move_aside` renames a step passed over (never deletes it), so the run saves that step again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Mapping

import jax
import orbax.checkpoint as ocp

from distca_jax.train import integrity, orbax_noise
from distca_jax.train.finite import leaf_name

log = logging.getLogger(__name__)

# Written by orbax into a step directory as the last act of a save (0.12.x, both atomicity modes).
COMMIT_MARKER = "commit_success.txt"


class CheckpointError(RuntimeError):
  """Base class of every checkpoint failure raised here."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
  """There is no (complete) checkpoint to restore."""


class CheckpointMismatchError(CheckpointError, ValueError):
  """The checkpoint does not belong to the current run: model shape, tree or array shapes differ."""


class CheckpointCorruptError(CheckpointError):
  """A checkpoint's files are unreadable: truncated, garbled, or partly deleted."""


class CheckpointIntegrityError(CheckpointCorruptError):
  """A checkpoint reads, but its arrays or `extra` differ from the checksums saved with them."""

  def __init__(self, message: str, why: str):
    super().__init__(message)
    self.why = why


class CheckpointSaveError(CheckpointError):
  """A save failed or would not fit: the message is one line naming the directory and the cause."""


# Free space a save needs beyond the checkpoint's own bytes (metadata, OCDBT manifests, slack).
SPACE_HEADROOM_BYTES = 16 << 20


def state_bytes(state: Any) -> int:
  """Bytes of every array of `state` (the global arrays, all processes' shards together: what a
  checkpoint of it writes to a shared directory)."""
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "dtype"))


def space_problem(directory: str | Path, needed_bytes: int) -> str | None:
  """Why `directory` (or its nearest existing parent) cannot take `needed_bytes` more (None: it
  can)."""
  path = Path(directory).absolute()
  while not path.exists() and path != path.parent:
    path = path.parent
  free = shutil.disk_usage(path).free
  needed = needed_bytes + SPACE_HEADROOM_BYTES
  if free >= needed:
    return None
  return (f"{_gib(free)} free on the disk of {directory}, a checkpoint needs {_gib(needed)}: free "
          f"space, set checkpoint.dir to another disk, or checkpoint.every=0 (no checkpoints)")


def move_aside(directory: str | Path, step: int) -> Path:
  """Renames checkpoint `step` of `directory` to `<step>.aside` (`<step>.aside-2`, ... if
  taken) and returns the new path: a name orbax does not list as a step, so the step can be saved
  again, and nothing of it is lost. Process 0's job; the caller makes the others wait."""
  source = Path(directory).absolute() / str(step)
  for k in range(1, 1000):
    target = source.with_name(f"{step}.aside" + (f"-{k}" if k > 1 else ""))
    if not target.exists():
      os.rename(source, target)
      return target
  raise CheckpointError(f"cannot move {source} aside: {step}.aside .. -999 all exist")


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


class Checkpointer:
  """Saves every `save_every` steps, keeps the last `keep`, restores with target shardings.

  Args:
    directory: where step directories live; created unless `read_only`.
    save_every: `maybe_save(step, ...)` saves when `step % save_every == 0`.
    keep: number of most recent checkpoints kept; older ones are deleted after each save.
    async_save: write files in a background thread (the default); False blocks in `maybe_save`.
    read_only: only list and restore (e.g. an evaluator beside a running trainer): nothing is
      created, and leftovers of interrupted saves are not removed (the writer does that).
    verify: check each restored checkpoint against the checksums saved with it (saves always
      record them).

  On opening (unless read_only), process 0 removes what interrupted saves of an earlier run left:
  step directories without a commit marker, and tmp directories (orbax, in the background,
  finished before the first save starts); so the next run can save those steps again. Use as a context manager, or call `close()`: it waits for the last save.
  """

  def __init__(self, directory: str | Path, save_every: int, keep: int, async_save: bool = True,
               read_only: bool = False, verify: bool = True):
    if save_every < 1:
      raise ValueError(f"Checkpointer: save_every must be >= 1, got {save_every}")
    if keep < 1:
      raise ValueError(f"Checkpointer: keep must be >= 1, got {keep}")
    self.directory = Path(directory).absolute()
    self.save_every = save_every
    self.keep = keep
    self.read_only = read_only
    self.verify = verify
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=0 if read_only else save_every,  # what orbax sets (and warns) itself
        max_to_keep=None if read_only else keep,
        enable_async_checkpointing=async_save,
        create=not read_only,
        read_only=read_only,
        cleanup_tmp_directories=not read_only,
    )
    # Handlers are registered up front: a manager that only knows item names learns them from
    # the first save, so a fresh one (a resumed run) could not read metadata before restoring.
    handlers = {"state": ocp.StandardCheckpointHandler(), "extra": ocp.JsonCheckpointHandler()}
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
    self._checksums: dict[int, dict[str, str] | None] = {}  # per step, read with its `extra`
    incomplete = self._incomplete_steps()
    if incomplete and not read_only and jax.process_index() == 0:
      log.warning("checkpoint directory %s: removing incomplete step directories %s (no %s: their "
                  "saves were interrupted)", self.directory, incomplete, COMMIT_MARKER)
      for step in incomplete:
        shutil.rmtree(self._step_dir(step), ignore_errors=True)
      self._manager.reload()
    elif incomplete:
      log.warning("checkpoint directory %s: ignoring incomplete step directories %s (no %s)",
                  self.directory, incomplete, COMMIT_MARKER)

  # --------------------------------------------------------------------------- saving

  def maybe_save(self, step: int, state: Any, extra: Mapping[str, Any] | None = None, *,
                 force: bool = False) -> bool:
    """Saves `state` and `extra` as step `step` if `step % save_every == 0` (or `force`).

    `state` is a pytree of jax arrays (any sharding); `extra` a JSON-serialisable dict.
    Returns whether a save was started. With async saves, the arrays have been copied to host
    memory when this returns; the files are complete only after `wait()`.
    """
    if self.read_only:
      raise CheckpointError(f"Checkpointer({self.directory}) is read-only; it cannot save step {step}")
    extra = dict(extra or {})
    try:
      json.dumps(extra)
    except (TypeError, ValueError) as e:
      raise TypeError(f"Checkpointer.maybe_save: `extra` must be JSON-serialisable ({e})") from e
    if not (force or self._manager.should_save(step)):
      return False
    if step in self._manager.all_steps():
      return False  # already saved (e.g. a forced save at the last step that was also periodic)
    self.check_saves()
    extra = integrity.sealed(extra, state)  # before the save: the checksums commit with it
    # Older steps beyond `keep` are deleted only after this save commits: it needs room of its own.
    problem = space_problem(self.directory, state_bytes(state))
    if problem:
      raise CheckpointSaveError(f"cannot save checkpoint step {step}: {problem}")
    with self._save_errors(f"saving checkpoint step {step}"):
      return bool(self._manager.save(
          step,
          args=ocp.args.Composite(state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra)),
          force=force))

  def check_saves(self) -> None:
    """Raises CheckpointSaveError if a background save has failed since the last call; cheap
    (no waiting): the loop calls it at every step boundary."""
    with self._save_errors("a background checkpoint save"):
      self._manager.check_for_errors()
      # A failed commit is kept by the manager's finalize thread and raised when it is waited
      # for; once no save is in flight, waiting returns at once.
      if not self._manager.is_saving_in_progress():
        self._manager.wait_until_finished()

  def wait(self) -> None:
    """Blocks until every started save is on disk (and raises a background save's error as
    CheckpointSaveError)."""
    with self._save_errors("a background checkpoint save"):
      self._manager.wait_until_finished()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._manager.close()

  @contextlib.contextmanager
  def _save_errors(self, what: str):
    """Any error inside becomes one CheckpointSaveError line naming `what`, the directory and the
    root cause (orbax's own tracebacks of a failed write run to hundreds of lines)."""
    try:
      yield
    except CheckpointError:
      raise
    except Exception as e:
      raise CheckpointSaveError(f"{what} to {self.directory} failed: {_brief(e)}") from e

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # --------------------------------------------------------------------------- listing

  def _step_dir(self, step: int) -> Path:
    return self.directory / str(step)

  def _incomplete_steps(self) -> list[int]:
    return sorted(s for s in self._manager.all_steps() if not (self._step_dir(s) / COMMIT_MARKER).exists())

  def all_steps(self) -> list[int]:
    """Steps of complete checkpoints, ascending. Saves still in flight are not listed (their
    directories have no commit marker yet)."""
    return sorted(s for s in self._manager.all_steps() if (self._step_dir(s) / COMMIT_MARKER).exists())

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None if there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  # --------------------------------------------------------------------------- restoring

  def restore(self, step: int | None = None, abstract_state: Any = None,
              expect: Mapping[str, Any] | None = None) -> tuple[Any, dict]:
    """Restores checkpoint `step` (default: the latest complete one) -> (state, extra).

    Args:
      step: which checkpoint; None takes the latest.
      abstract_state: pytree of `jax.ShapeDtypeStruct` with `.sharding` (e.g. from
        `jax.eval_shape` plus the current mesh's shardings). Arrays are read straight into those
        shardings, on any mesh shape, and cast to those dtypes. None restores as saved (same
        device set only).
      expect: entries that the stored `extra` must equal, compared recursively (e.g.
        `{"model": {"hidden": 4096, "layers": 32, ...}}`); a difference raises
        CheckpointMismatchError naming every differing field.
    """
    step, extra = self.read_extra(step)
    steps = self.all_steps()
    where = f"checkpoint step {step} in {self.directory}"
    if expect is not None:
      diffs = _diff(expect, extra, "")
      if diffs:
        raise CheckpointMismatchError(
            f"{where} does not match the current run: " + "; ".join(diffs))

    if abstract_state is not None:
      self._check_tree(step, where, abstract_state)
    restore_args = (ocp.args.StandardRestore(abstract_state) if abstract_state is not None
                    else ocp.args.StandardRestore())
    try:
      state = self._manager.restore(step, args=ocp.args.Composite(state=restore_args)).state
    except Exception as e:
      raise CheckpointCorruptError(
          f"{where}: cannot read its arrays ({_brief(e)}); the files are corrupt or "
          f"incomplete. Other complete steps: {[s for s in steps if s != step]}") from e
    recorded = self._checksums.get(step)
    if self.verify and recorded is not None:
      bad = integrity.mismatches(state, recorded)
      if bad:
        why = f"checksum mismatch in {_shorten(['state/' + b for b in bad], 3)}"
        raise CheckpointIntegrityError(f"{where}: {why}", why)
    elif self.verify:
      log.warning("%s has no checksums (saved without them): restored unverified", where)
    return state, extra

  def restore_newest_good(self, restore: Callable[[int], tuple[Any, dict]], step: int | None = None,
                          problem: Callable[[Any], str | None] = lambda state: None,
                          ) -> tuple[Any, dict, list[tuple[int, str]]]:
    """(state, extra, skipped) of the newest complete checkpoint that `restore(step)` reads and
    in whose state `problem` finds nothing (it returns None, else why the state is bad); with
    `step`, that checkpoint or an error. `skipped`: (step, why) per newer checkpoint passed
    over, for the caller to report (and move aside).

    Raises NoCheckpointError when there is no checkpoint (or no complete `step`), and
    CheckpointCorruptError when none is good (or `step` is not). CheckpointMismatchError from
    `restore` passes through: a checkpoint of another model is not a damaged step to skip.
    """
    if step is not None:
      self.read_extra(step)  # NoCheckpointError naming the complete steps if it has none
      candidates = [step]
    else:
      candidates = self.all_steps()[::-1]
      if not candidates:
        self.read_extra()  # NoCheckpointError saying why
    skipped = []
    with orbax_noise.ClosedLoopNoiseDropped():
      for s in candidates:
        try:
          state, extra = restore(s)
        except CheckpointIntegrityError as e:
          why = e.why
        except CheckpointCorruptError as e:
          why = f"unreadable: {_brief(e.__cause__ or e, 160)}"
          orbax_noise.drop_orphaned_read_errors()
        else:
          why = problem(state)
          if why is None:
            return state, extra, skipped
        if step is not None:
          raise CheckpointCorruptError(f"checkpoint step {s} in {self.directory}: {why}")
        skipped.append((s, why))
    raise CheckpointCorruptError(f"no good checkpoint in {self.directory}: "
                                 + "; ".join(f"step {s} ({why})" for s, why in skipped))

  def read_extra(self, step: int | None = None) -> tuple[int, dict]:
    """(step, its `extra` dict) of checkpoint `step` (default: the latest complete one), without
    reading the arrays."""
    steps = self.all_steps()
    if step is None:
      if not steps:
        if not self.directory.exists():
          raise NoCheckpointError(f"no checkpoint to restore: directory {self.directory} does not exist")
        raise NoCheckpointError(f"no checkpoint to restore: {self.directory} holds no complete checkpoint")
      step = steps[-1]
    elif step not in steps:
      why = ("it is incomplete (its save was interrupted)" if self._step_dir(step).exists()
             else "it does not exist")
      raise NoCheckpointError(
          f"checkpoint step {step} in {self.directory}: {why}; complete steps are {steps}")
    where = f"checkpoint step {step} in {self.directory}"
    try:
      extra = self._manager.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore())).extra
    except Exception as e:  # orbax/tensorstore raise many unrelated types for unreadable files
      raise CheckpointCorruptError(f"{where}: cannot read its `extra` item ({_brief(e)})") from e
    if not isinstance(extra, dict):
      raise CheckpointCorruptError(f"{where}: its `extra` item is {type(extra).__name__}, expected a dict")
    extra, self._checksums[step], damage = integrity.unseal(extra)
    if damage and self.verify:
      raise CheckpointIntegrityError(f"{where}: {damage}", damage)
    return step, extra

  def _check_tree(self, step: int, where: str, abstract_state: Any) -> None:
    """Raises CheckpointMismatchError if the stored tree's paths or array shapes differ from the
    target's (orbax's own errors for this are deep tensorstore messages)."""
    try:
      metadata = self._manager.item_metadata(step).state
    except Exception as e:
      raise CheckpointCorruptError(f"{where}: cannot read its array metadata ({_brief(e)})") from e
    if metadata is None:
      raise CheckpointCorruptError(f"{where}: its array metadata is missing")
    stored = {_path_name(p): tuple(m.shape)
              for p, m in jax.tree_util.tree_flatten_with_path(getattr(metadata, "tree", metadata))[0]}
    wanted = {_path_name(p): tuple(a.shape)
              for p, a in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
    problems = []
    missing = sorted(set(wanted) - set(stored))
    unexpected = sorted(set(stored) - set(wanted))
    if missing:
      problems.append(f"arrays not in the checkpoint: {_shorten(missing)}")
    if unexpected:
      problems.append(f"arrays in the checkpoint but not in the current state: {_shorten(unexpected)}")
    for key in sorted(set(stored) & set(wanted)):
      if stored[key] != wanted[key]:
        problems.append(f"{key}: checkpoint shape {stored[key]}, current {wanted[key]}")
    if problems:
      raise CheckpointMismatchError(f"{where} does not match the current state: " + "; ".join(problems))
    # A target sharding that cannot tile its array is the caller's bug, not a damaged checkpoint:
    # say so before orbax reports it from deep inside the read.
    for p, a in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
      sharding = getattr(a, "sharding", None)
      if sharding is not None:
        try:
          sharding.shard_shape(tuple(a.shape))
        except ValueError as e:
          raise ValueError(f"restore target {_path_name(p)}: {e}") from e


def _path_name(path) -> str:
  """`state/opt/0/mu/w` for a pytree key path. Orbax stores NamedTuples (optax states) as dicts,
  so attribute and dict keys must read the same."""
  return "/".join(["state", leaf_name(path)])


def _diff(expect: Any, stored: Any, path: str) -> list[str]:
  """Human-readable differences between `expect` and `stored`, for the keys of `expect`."""
  if isinstance(expect, Mapping):
    if not isinstance(stored, Mapping):
      return [f"{path or 'extra'}: checkpoint has {stored!r}, current run has a mapping"]
    out = []
    for key, value in expect.items():
      sub = f"{path}.{key}" if path else str(key)
      if key not in stored:
        out.append(f"{sub}: missing from the checkpoint (current run has {value!r})")
      else:
        out.extend(_diff(value, stored[key], sub))
    return out
  # JSON turns tuples into lists; compare through JSON so (1, 2) equals [1, 2].
  if json.loads(json.dumps(expect)) != stored:
    return [f"{path}: checkpoint has {stored!r}, current run has {expect!r}"]
  return []


def _brief(e: BaseException, limit: int = 400) -> str:
  """The first line of an exception's root cause: orbax wraps tensorstore errors whose own first
  line names the file and the problem, followed by a spec dump kept only in the chain."""
  root = e
  while root.__cause__ is not None and root.__cause__ is not root:
    root = root.__cause__
  text = str(root).strip()
  return f"{type(root).__name__}: {text.splitlines()[0] if text else ''}"[:limit]


def _shorten(keys: list[str], limit: int = 5) -> str:
  return ", ".join(keys[:limit]) + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")
