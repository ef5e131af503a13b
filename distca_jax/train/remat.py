"""`model.remat`: how much of each decoder block the backward pass recomputes, fixed by the config
or (`auto`) chosen for the device's memory.

`auto` is settled without compiling where nothing is to be gained by it (a pipeline recomputes
each block once anyway; CPU and devices without memory statistics have nothing to fit): `full`.
Otherwise `choose` compiles the step under each policy of `models/llama.py`'s `AUTO_ORDER`, least
recomputation first, and takes the first whose compiled step fits the device's free memory; the
trainer (`train/step.py`) runs the executable that choice compiled.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh

from distca_jax.config import Config
from distca_jax.models.llama import AUTO_ORDER

# `model.remat=auto` takes a policy whose compiled step needs at most this share of the device
# memory still free (the allocator's limit less what is in use: state and batch); the rest is
# headroom for fragmentation and for buffers outside the step.
MEMORY_MARGIN = 0.08


def fixed_policy(config: Config, mesh: Mesh) -> tuple[str | None, str]:
  """The remat policy and why, where it is known before compiling: set in the config, or
  `auto` resolved without compiling (None: choose at the first compile)."""
  remat = config.model.remat
  if remat != "auto":
    return remat, "model.remat set in the config"
  if mesh.shape["pipe"] > 1:
    return "full", ("auto: full, the pipeline keeps only block inputs between a micro-batch's "
                    "forward and backward ticks and recomputes each block once")
  if mesh.devices.flat[0].platform == "cpu":
    # Nothing to fit on the host, and compiling candidates would cost the CPU job its time.
    return "full", "auto: full on CPU (no device memory to fit; candidates not compiled)"
  if not free_device_bytes(mesh):
    return "full", "auto: full, the device reports no memory statistics"
  return None, ""


def free_device_bytes(mesh: Mesh) -> int:
  """Bytes the allocator can still hand out on the fullest addressable device of `mesh` (its
  limit less what is in use), 0 where the backend keeps no statistics."""
  free = []
  for d in mesh.devices.flat:
    if d.process_index != jax.process_index():
      continue
    stats = d.memory_stats() or {}
    if "bytes_limit" not in stats:
      return 0
    free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
  return min(free) if free else 0


def free_bytes_everywhere(mesh: Mesh, reserved: int = 0) -> int:
  """`free_device_bytes` less `reserved` (bytes the step will allocate outside the compiled
  call), the least over processes: every process must compile the same program."""
  free = free_device_bytes(mesh) - reserved
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    free = int(np.min(multihost_utils.process_allgather(np.int64(free))))
  return free


def choose(candidate: Callable[[str], Any], args: tuple, free: int
           ) -> tuple[str, Any, Any, list[dict[str, Any]], str]:
  """Compiles `candidate(policy)` (a jitted step) on `args` for each policy of `AUTO_ORDER` and
  stops at the first whose memory analysis fits `free` bytes with `MEMORY_MARGIN`; the last
  (full) is taken without checking. Returns (policy, its jitted step, its compiled executable,
  every candidate tried with its need and compile time, why)."""
  tried = []
  for i, name in enumerate(AUTO_ORDER):
    fn = candidate(name)
    t0 = time.perf_counter()
    compiled = fn.trace(*args).lower().compile()
    need = step_bytes(compiled.memory_analysis())
    fits = need is not None and need <= free * (1 - MEMORY_MARGIN)
    tried.append({"policy": name, "need_bytes": need, "free_bytes": free,
                  "compile_s": round(time.perf_counter() - t0, 2), "fits": fits})
    if fits or i == len(AUTO_ORDER) - 1:
      break
  needs = "; ".join(f"{c['policy']} needs {_gib(c['need_bytes'])}" for c in tried)
  reason = (f"auto: the first of {'/'.join(AUTO_ORDER)} whose step fits "
            f"{1 - MEMORY_MARGIN:.0%} of the {_gib(free)} free per device ({needs})")
  return name, fn, compiled, tried, reason


def step_bytes(analysis) -> int | None:
  """Device bytes the compiled step needs beyond its inputs (already allocated): temporaries,
  outputs not aliased to donated inputs, and its code. None without an analysis."""
  if analysis is None:
    return None
  return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes
             - analysis.alias_size_in_bytes + analysis.generated_code_size_in_bytes)


def signature(arrays, ctx) -> tuple:
  """What decides whether a compiled step takes these inputs: their tree, shapes and dtypes."""
  leaves, tree = jax.tree.flatten((arrays, ctx))
  return tree, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x)))) for x in leaves)


def _gib(n: int | None) -> str:
  return "?" if n is None else f"{n / 2**30:.1f} GiB"
