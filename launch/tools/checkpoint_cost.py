"""What the checkpoint checksums cost: save and restore of a state of a few GB, with and without.

    python launch/tools/checkpoint_cost.py --gib 2 --dir /tmp/ck_cost

Times, on this machine's JAX backend: the checksums alone (`integrity.array_checksums`, the one
jitted pass a save adds and a verified restore adds again), a save (`Checkpointer.maybe_save` and
its wait, checksums included), and a restore with `verify` on and off. Prints one line per
measurement and the checksums' share of save and of restore time. The state is float32 and
bfloat16 arrays of 64 MiB to 256 MiB, like a model's parameters and Adam moments.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gib", type=float, default=2.0, help="state size in GiB")
  parser.add_argument("--dir", help="checkpoint directory (default: a temporary one, removed)")
  parser.add_argument("--repeats", type=int, default=2, help="timed repeats (the best is kept)")
  args = parser.parse_args()

  import jax
  import jax.numpy as jnp

  from distca_jax.train import integrity
  from distca_jax.train.checkpoint import Checkpointer, state_bytes

  key = jax.random.key(0)
  state, size, i = {}, 0, 0
  sizes = [256 << 20, 64 << 20, 128 << 20]  # bytes per leaf, cycled
  while size < args.gib * 2**30:
    nbytes = sizes[i % len(sizes)]
    dtype = jnp.bfloat16 if i % 3 == 1 else jnp.float32
    rows = nbytes // (4096 * jnp.dtype(dtype).itemsize)
    state[f"w{i}"] = jax.random.normal(jax.random.fold_in(key, i), (rows, 4096), dtype)
    size += nbytes
    i += 1
  jax.block_until_ready(state)
  total = state_bytes(state)
  print(f"state: {len(state)} arrays, {total / 2**30:.2f} GiB on {jax.devices()[0].platform}")

  def best(fn) -> float:
    times = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      fn()
      times.append(time.perf_counter() - t0)
    return min(times)

  integrity.array_checksums(state)  # compile
  t_sum = best(lambda: integrity.array_checksums(state))
  root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ck_cost_"))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  saves, restores = [], {True: [], False: []}
  for r in range(args.repeats):
    directory = root / f"r{r}"
    shutil.rmtree(directory, ignore_errors=True)
    with Checkpointer(directory, save_every=1, keep=1) as ck:
      t0 = time.perf_counter()
      ck.maybe_save(1, state, {"step": 1})
      ck.wait()
      saves.append(time.perf_counter() - t0)
    for verify in (True, False):
      with Checkpointer(directory, 1, 1, read_only=True, verify=verify) as ck:
        t0 = time.perf_counter()
        restored, _ = ck.restore(1, abstract_state=abstract)
        jax.block_until_ready(restored)
        restores[verify].append(time.perf_counter() - t0)
      del restored
    shutil.rmtree(directory, ignore_errors=True)
  if not args.dir:
    shutil.rmtree(root, ignore_errors=True)
  t_save, t_on, t_off = min(saves), min(restores[True]), min(restores[False])
  gbs = total / 2**30
  print(f"checksums alone   {t_sum:7.3f} s  ({gbs / t_sum:.2f} GiB/s)")
  print(f"save (with them)  {t_save:7.3f} s  ({gbs / t_save:.2f} GiB/s); checksums {t_sum / t_save:.1%} of it")
  print(f"restore verified  {t_on:7.3f} s; unverified {t_off:7.3f} s; checksums "
        f"{t_sum / t_off:.1%} of an unverified restore (measured difference {(t_on - t_off) / t_off:+.1%})")


if __name__ == "__main__":
  main()
