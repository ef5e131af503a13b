"""A/B of Mosaic GPU kernel versions on the sampled batches, in one process.

    python3 launch/ab_mosaic.py now= regs40=memory_registers=40 old=@/tmp/mosaic_old.py --trace

Each argument is NAME=SPEC: SPEC is a `kernels.mosaic.Options` spec ("key=value+key=value", empty
for the defaults), or @FILE[:SPEC], another version of the kernel module (e.g. `git show
REV:kernels/mosaic.py > FILE`), imported beside the package's so its relative imports resolve.
Every version is compiled once per batch, then timed `--rounds` times in rotating order (clocks
drift over a run: the spread is printed), medians reported, forward / backward / f+b TF/s as
bench_kernels.py counts them. Needs a Hopper GPU; same PYTHONPATH setup as bench_kernels.py.
With MOSAIC_GPU_DUMP_PTXAS=1 in the environment ptxas reports each kernel's registers and spills
(`bash launch/gpu_session.sh kdump` also keeps the PTX).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from distca_jax import kernels  # noqa: E402
from distca_jax.kernels import mosaic  # noqa: E402


def load_version(name: str, spec: str):
  """`attn(q, k, v, tasks) -> O` for one NAME=SPEC argument."""
  module, opts = mosaic, spec
  if spec.startswith("@"):
    path, _, opts = spec[1:].partition(":")
    mod_name = f"distca_jax.kernels._ab_{name}"
    loader = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[mod_name] = module
    loader.loader.exec_module(module)
  config = module.parse_options(opts)
  return lambda q, k, v, t: module.attention(q, k, v, t, config=config)[0]


def kernel_table(label: str, run, top: int = 12) -> str:
  """GPU time per forward+backward call of the kernels a `bench_kernels.timer` runs, from a
  profiler trace: the attention kernels, and the XLA work around them (layout, statistics, dQ's
  float32 buffer)."""
  per_name = run.fwdbwd_kernels()
  lines = [f"{label}: GPU kernels {sum(per_name.values()):.2f} ms per forward+backward call"]
  lines += [f"  {ms:8.3f} ms  {name}" for name, ms in per_name.most_common(top)]
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("versions", nargs="+", help="NAME=SPEC (see the module docstring)")
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
    name, sep, spec = arg.partition("=")
    if not sep or not name:
      ap.error(f"{arg!r}: give NAME=SPEC")
    versions[name] = load_version(name, spec)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, H={bk.H} K={bk.K} d={bk.D}",
        flush=True)
  for ds in (d for d in args.datasets.split(",") if d):
    _, tasks, T, S = bk.sampled_batch(ds, args.context)
    f = bk.fwd_flops(float(kernels.causal_area(tasks).sum()))
    q, k, v, do = bk.inputs(T, S)
    table = kernels.TaskTable(*(jnp.asarray(a) for a in tasks))
    runs = {n: bk.timer(a, q, k, v, do, table) for n, a in versions.items()}
    times = bk.time_in_rounds(runs, args.rounds)
    if args.trace:
      for n, run in runs.items():
        print(kernel_table(f"{ds}-{args.context // 1024}K {n}", run), flush=True)
    for n, ts in times.items():
      fms, fbms = (float(np.median([t[i] for t in ts])) for i in (0, 1))
      bwd = [bk.tflops(f, *t)[1] for t in ts]
      tf = bk.tflops(f, fms, fbms)
      print(f"{ds}-{args.context // 1024}K {n:10s} fwd {tf[0]:6.1f}  bwd {tf[1]:6.1f}  "
            f"f+b {tf[2]:6.1f} TF/s  "
            f"(bwd by round {' '.join(f'{b:.0f}' for b in bwd)})", flush=True)


if __name__ == "__main__":
  main()
