"""A/B of Mosaic GPU kernel versions on the sampled batches, in one process.

    git archive REV kernels | tar -x -C /tmp/old
    python3 launch/tools/ab_mosaic.py now= old=@/tmp/old/kernels --trace

Each argument is NAME=VERSION: an empty VERSION is the package's kernels; @DIR is another
version's `kernels/` folder, imported as a package of its own (the kernels import nothing above
them, so a folder of them is whole), whose `mosaic.attention` is timed. Every version is
compiled once per batch, then timed `--rounds` times in rotating order (clocks drift over a run:
the spread is printed), medians reported, forward / backward / f+b TF/s as bench_kernels.py
counts them. Needs a Hopper GPU. With MOSAIC_GPU_DUMP_PTXAS=1 in the environment ptxas reports
each kernel's registers and spills; MOSAIC_GPU_DUMP_TO=DIR keeps each kernel's PTX and ptxas
report there.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from distca_jax import kernels
from distca_jax.benchtools import (attention_flops, attention_inputs, sampled_batch,
                                   time_in_rounds, tflops, timer)
from distca_jax.kernels import mosaic

H, K, D = 32, 8, 128  # the kernel benchmark's shape (bench_kernels.py)


def import_kernels(name: str, folder: str):
  """The kernels package in `folder` (a version's `kernels/`), imported as `name`."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                submodule_search_locations=[folder])
  package = importlib.util.module_from_spec(spec)
  sys.modules[name] = package  # its modules' relative imports resolve under `name`
  spec.loader.exec_module(package)
  return package


def load_version(name: str, version: str):
  """`attn(q, k, v, tasks) -> O` for one NAME=VERSION argument."""
  if not version:
    module = mosaic
  elif version.startswith("@") and os.path.isfile(os.path.join(version[1:], "__init__.py")):
    import_kernels(f"_ab_{name}", version[1:])
    module = importlib.import_module(f"_ab_{name}.mosaic")
  else:
    raise ValueError(f"{name}={version}: give nothing (the package's kernels) or @DIR (a "
                     "version's kernels folder)")
  return lambda q, k, v, t: module.attention(q, k, v, t)[0]


def kernel_table(label: str, run, top: int = 12) -> str:
  """GPU time per forward+backward call of the kernels a `benchtools.timer` runs, from a
  profiler trace: the attention kernels, and the XLA work around them (layout, statistics, dQ's
  float32 buffer)."""
  per_name = run.fwdbwd_kernels()
  lines = [f"{label}: GPU kernels {sum(per_name.values()):.2f} ms per forward+backward call"]
  lines += [f"  {ms:8.3f} ms  {name}" for name, ms in per_name.most_common(top)]
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("versions", nargs="+", help="NAME=VERSION (see the module docstring)")
  ap.add_argument("--datasets", default="pretrain,prolong")
  ap.add_argument("--context", type=int, default=65536)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--trace", action="store_true",
                  help="also profile 3 forward+backward calls of each version and print the GPU "
                       "time per call of its top kernels (what the backward spends outside the "
                       "attention kernels)")
  args = ap.parse_args()
  versions = {}
  for arg in args.versions:
    name, sep, version = arg.partition("=")
    if not sep or not name:
      ap.error(f"{arg!r}: give NAME=VERSION")
    versions[name] = load_version(name, version)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, H={H} K={K} d={D}", flush=True)
  for ds in (d for d in args.datasets.split(",") if d):
    _, tasks, T, S = sampled_batch(ds, args.context)
    f = attention_flops(float(kernels.causal_area(tasks).sum()), H, D)
    q, k, v, do = attention_inputs(T, S, H, K, D)
    table = kernels.TaskTable(*(jnp.asarray(a) for a in tasks))
    runs = {n: timer(a, q, k, v, do, table) for n, a in versions.items()}
    times = time_in_rounds(runs, args.rounds)
    if args.trace:
      for n, run in runs.items():
        print(kernel_table(f"{ds}-{args.context // 1024}K {n}", run), flush=True)
    for n, ts in times.items():
      fms, fbms = (float(np.median([t[i] for t in ts])) for i in (0, 1))
      bwd = [tflops(f, *t)[1] for t in ts]
      tf = tflops(f, fms, fbms)
      print(f"{ds}-{args.context // 1024}K {n:10s} fwd {tf[0]:6.1f}  bwd {tf[1]:6.1f}  "
            f"f+b {tf[2]:6.1f} TF/s  "
            f"(bwd by round {' '.join(f'{b:.0f}' for b in bwd)})", flush=True)


if __name__ == "__main__":
  main()
