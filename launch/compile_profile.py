"""Where a training step's compile time goes: trace and lowering, XLA's compile, the first run.

    python launch/compile_profile.py model.preset=llama3_8b model.layers=4 attention.kernel=mosaic

One variant per process (compilation caches are process-wide, so a second variant in the same
process would compile less). Prints the three phases' seconds, the StableHLO module's size, its
custom calls and distinct Mosaic GPU kernels (each compiled once a process), and with `--trace
DIR` the host events of a profiler trace over the compile and first run, summed by name
(inclusive times; XLA's passes and Mosaic GPU's `Compile` appear under their own names, Python
frames are left out).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import os
import re
import sys
import time


def top_events(trace_dir: str, top: int) -> list[tuple[str, float, int]]:
  """(name, total seconds, count) of the host events in the perfetto trace under `trace_dir`,
  largest first."""
  paths = [os.path.join(d, f) for d, _, fs in os.walk(trace_dir) for f in fs
           if f == "perfetto_trace.json.gz"]
  if not paths:
    return []
  with gzip.open(paths[0]) as f:
    events = json.load(f)["traceEvents"]
  total: dict[str, float] = collections.defaultdict(float)
  count: dict[str, int] = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and "dur" in e and not e["name"].startswith("$"):  # "$": Python frames
      name = re.sub(r"\d+", "#", e["name"])[:80]
      total[name] += e["dur"] / 1e6
      count[name] += 1
  names = sorted(total, key=total.get, reverse=True)[:top]
  return [(n, total[n], count[n]) for n in names]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=None)
  parser.add_argument("--dist", default="prolong", help="the batch's document lengths")
  parser.add_argument("--trace", default=None, help="profile the compile and first run into DIR")
  parser.add_argument("--top", type=int, default=30)
  parser.add_argument("--dump-kernels", default=None,
                      help="write each distinct Mosaic GPU kernel module lowered in this "
                           "process (MLIR bytecode; jax.experimental.mosaic.gpu.core's "
                           "KNOWN_KERNELS) to DIR")
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args(argv)

  from distca_jax.launch_env import configure_xla

  configure_xla(cpu_devices=int(os.environ.get("DISTCA_CPU_DEVICES", "1")))
  import jax

  from distca_jax import attention as attention_lib
  from distca_jax import mesh as mesh_lib
  from distca_jax.config import load_config
  from distca_jax.data.sources import synthetic_from_config
  from distca_jax.kernels import mosaic
  from distca_jax.train.step import Trainer

  config = load_config(args.config, ["mesh.data=1"] + args.overrides)
  mesh = mesh_lib.make_mesh(config.mesh)
  trainer = Trainer(config, mesh)
  state = trainer.init_state(0)
  data = dataclasses.replace(config.data, distribution=args.dist)
  batch = synthetic_from_config(data, trainer.shape.vocab_size, 1).batch(0)
  ctx = attention_lib.host_context(trainer.config.attention, batch, trainer.shape)
  arrays, dctx = trainer.put_batch(batch, ctx)
  jax.block_until_ready((state, arrays))

  t0 = time.perf_counter()
  lowered = trainer.lower(state, arrays, dctx)
  lower_s = time.perf_counter() - t0
  text = lowered.as_text()
  custom_calls = len(re.findall(r"stablehlo\.custom_call", text))
  _, mosaic_kernels = mosaic.lowered_kernels(text)
  if args.dump_kernels:
    from jax.experimental.mosaic.gpu import core as mosaic_core

    os.makedirs(args.dump_kernels, exist_ok=True)
    for i, module in enumerate(mosaic_core.KNOWN_KERNELS.values()):
      with open(os.path.join(args.dump_kernels, f"kernel_{i}.mlirbc"), "wb") as f:
        f.write(module)
  if args.trace:
    jax.profiler.start_trace(args.trace, create_perfetto_trace=True)
  t0 = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  out = compiled(state, arrays, dctx)
  jax.block_until_ready(out)
  first_s = time.perf_counter() - t0
  if args.trace:
    jax.profiler.stop_trace()
  t0 = time.perf_counter()
  jax.block_until_ready(compiled(out[0], arrays, dctx))
  run_s = time.perf_counter() - t0
  overrides = " ".join(args.overrides)
  print(f"{overrides}: lower {lower_s:.1f}s  compile {compile_s:.1f}s  first run {first_s:.1f}s  "
        f"run {run_s:.2f}s  module {len(text) / 2**20:.1f} MiB  custom calls {custom_calls}  "
        f"distinct mosaic kernels {mosaic_kernels}", flush=True)
  if args.trace:
    for name, secs, n in top_events(args.trace, args.top):
      print(f"  {secs:8.2f}s  {n:6d}  {name}")
  sys.stdout.flush()


if __name__ == "__main__":
  main()
