"""The run's directory: one per run by default, the newest linked, and never reused silently.

`train.out_dir` unset: `runs/<name>-<YYYYmmdd-HHMMSS>` (the launcher's name is its config file's
stem, `default` without one), with `runs/latest` linked to it. A directory whose checkpoints
belong to an earlier run is either resumed (`checkpoint.resume`, the default: the loop restores
its newest good checkpoint) or refused with one line saying how to resume it or start afresh: a
run never restarts from step 0 over another run's checkpoints.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from distca_jax.config import ConfigError, to_dict
from distca_jax.train.checkpoint import COMMIT_MARKER

RUNS = Path("runs")
LATEST = "latest"

# Fields that change how a run is operated, not what it computes: a resumed run may change them
# without a note (`config_changes`).
OPERATIONAL = ("train.steps", "train.stop_at_step", "train.max_seconds", "train.log_every",
               "train.tensorboard", "train.progress", "train.profile", "train.profile_start",
               "train.profile_steps", "train.profile_warmup", "train.compile_cache_dir",
               "train.init_timeout_s", "train.peak_tflops", "train.out_dir", "train.cpu_devices",
               "train.imbalance_after", "checkpoint.", "mesh.", "attention.data_rank_nodes",
               "model.remat")


def choose(out_dir: str | None, name: str) -> tuple[Path, bool]:
  """(the run's directory, whether it was named here): `out_dir`, or a new
  `runs/<name>-<timestamp>[-k]` that every process agrees on (process 0's clock and listing)."""
  if out_dir is not None:
    path = Path(out_dir)
    return (path.resolve() if path.is_symlink() else path), False  # e.g. runs/latest
  import jax

  stamp = np.asarray([time.time() // 86400, time.time() % 86400, 0], np.int32)
  if jax.process_index() == 0:
    while _named(name, stamp).exists():
      stamp[2] += 1
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    stamp = np.asarray(multihost_utils.broadcast_one_to_all(stamp))
  return _named(name, stamp), True


def _named(name: str, stamp: np.ndarray) -> Path:
  days, seconds, k = (int(x) for x in stamp)
  text = time.strftime("%Y%m%d-%H%M%S", time.gmtime(days * 86400 + seconds))
  return RUNS / (f"{name}-{text}" + (f"-{k + 1}" if k else ""))


def link_latest(run_dir: Path) -> None:
  """Points `<parent>/latest` at `run_dir` (a relative link; skipped where links fail)."""
  link = run_dir.parent / LATEST
  try:
    if link.is_symlink() or link.exists():
      link.unlink()
    link.symlink_to(run_dir.name, target_is_directory=True)
  except OSError:
    pass


def complete_steps(checkpoint_dir: Path) -> list[int]:
  """Steps of the complete checkpoints in `checkpoint_dir` (no orbax: a directory listing)."""
  if not checkpoint_dir.is_dir():
    return []
  return sorted(int(p.name) for p in checkpoint_dir.iterdir()
                if p.name.isdigit() and (p / COMMIT_MARKER).exists())


def check_reuse(checkpoint_dir: Path, every: int, resume: bool) -> list[int]:
  """The complete steps in `checkpoint_dir`; ConfigError (one line) if they would be ignored: a
  run with checkpoints off, or with `checkpoint.resume=false`, would start from step 0 over them."""
  steps = complete_steps(checkpoint_dir)
  if not steps or (every > 0 and resume):
    return steps
  why = "checkpoint.every=0" if every == 0 else "checkpoint.resume=false"
  how = ("the same command with checkpoint.every=N" if every == 0 else
         "the same command with checkpoint.resume=true")
  raise ConfigError(f"train.out_dir: {checkpoint_dir} holds checkpoints of an earlier run (steps "
                    f"{_steps(steps)}) and {why} would start from step 0 over them: to resume it, "
                    f"{how}; to start afresh, another train.out_dir (or delete the directory)")


def _steps(steps: list[int]) -> str:
  return ", ".join(map(str, steps[-3:])) if len(steps) <= 3 else f"{steps[0]} ... {steps[-1]}"


def config_changes(saved_config: Path, config) -> list[str]:
  """The fields in which `config` differs from the run's `saved_config` (its config.json), those
  that change what the run computes (not `OPERATIONAL` ones): "optim.lr 0.003 -> 0.01"."""
  try:
    before = _flat(json.loads(saved_config.read_text()))
  except (OSError, ValueError):
    return []
  now = _flat(to_dict(config))
  return [f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(before) | set(now))
          if not k.startswith(OPERATIONAL) and _json(before.get(k)) != _json(now.get(k))]


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _json(value: Any) -> Any:
  return json.loads(json.dumps(value))
