"""How many bytes the tiled exchange sends beyond the rows that move (CPU, no GPU needed).

    python launch/tools/exchange_padding.py [--devices 4] [--set k=v ...]

For the gate's measured batches (`gate.measured_batches()`, or `--steps` sampled ones), plans
each as the trainer does and prints, per batch, the bytes one layer's exchange sends relative to
the bytes of the rows that move: as it runs (`attention.exchange: tiled`: every off-diagonal
(device, server) block padded to the step's capacity bucket), padded to the largest pair
without bucketing, and padded per shift (the blocks d -> d + k sized to that shift's largest:
an exchange as N - 1 `ppermute`s). It says where the padding comes from: the bucket, or one
block size for all pairs.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np


def main(argv=None) -> int:
  """Print the table of exchange bytes over moved bytes per batch; 0 on success."""
  from distca_jax import dispatch, gate
  from distca_jax.config import load_config
  from distca_jax.data.sources import synthetic_from_config
  from distca_jax.models.presets import resolve
  from distca_jax.schedule.traffic import pair_rows

  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--devices", type=int, default=gate.FIT_DEVICES)
  ap.add_argument("--steps", type=int, default=0,
                  help="sampled steps 0..N-1 of each distribution instead of the measured batches")
  ap.add_argument("--set", nargs="*", default=[], help="config overrides on the gate fit's setup")
  args = ap.parse_args(argv)
  cfg = load_config(None, list(gate.FIT_SETUP) + ["attention.impl=distca", "attention.gate=false"]
                    + args.set)
  shape = resolve(cfg.model)
  comm = gate.comm_model(shape, cfg.attention)
  batches = ([(d, s) for d in ("pretrain", "prolong") for s in range(args.steps)] if args.steps
             else list(gate.measured_batches()))
  print("| batch | tiled (as run) | largest pair, no bucket | per shift | moved MB per layer |")
  print("|---|---|---|---|---|")
  total = np.zeros(4)
  for dist, step in batches:
    src = synthetic_from_config(dataclasses.replace(cfg.data, distribution=dist), shape.vocab_size,
                                args.devices)
    ctx = dispatch.plan_step(cfg.attention, src.batch(step), shape)
    if not ctx.cad:
      continue
    # As it runs: what the gate charges (per device, sent plus received; summed, each byte twice).
    sums = np.array([0.0, gate.exchange_bytes(cfg.attention, shape, ctx.plans,
                                              ctx.capacities).sum() / 2, 0.0, 0.0])
    for plan, nano in zip(ctx.plans, ctx.batches):
      q, kv, _ = (np.asarray(x, np.float64) for x in pair_rows(plan.tasks, nano.layout))
      n = q.shape[0]
      off = ~np.eye(n, dtype=bool)
      row = lambda rq, rkv: rq * comm.q_row_bytes + rkv * comm.kv_row_bytes
      idx = np.arange(n)
      per_shift = sum(n * row(q[idx, (idx + k) % n].max(), kv[idx, (idx + k) % n].max())
                      for k in range(1, n))
      sums += [row(q[off], kv[off]).sum(), 0.0,
               off.sum() * row(q[off].max(initial=0), kv[off].max(initial=0)), per_shift]
    total += sums
    if sums[0] > 0:
      print(f"| {dist}@{step} | {sums[1] / sums[0]:.2f}x | {sums[2] / sums[0]:.2f}x | "
            f"{sums[3] / sums[0]:.2f}x | {sums[0] / 2**20:.0f} |")
  if total[0] > 0:
    print(f"| all | {total[1] / total[0]:.2f}x | {total[2] / total[0]:.2f}x | "
          f"{total[3] / total[0]:.2f}x | {total[0] / 2**20:.0f} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
