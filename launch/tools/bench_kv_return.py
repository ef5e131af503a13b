"""Time the K/V gradients' return scatter-add of a real CAD step, with the empty slots dropped
(as it runs) and added as zeros onto row 0 (as an earlier index did), on one device.

    python3 launch/tools/bench_kv_return.py [--dist prolong] [--step 14] [--devices 4]
        [--ckv 65536]

The step is planned on the host as the trainer plans it, in the gate fit's setup
(`gate.FIT_SETUP`: Llama-3-8B shape with 2 layers, 64K tokens per device). Each nano-batch plan's return on the device that gets the most
rows home (`_kv_grads_to_home`'s last line: rows [T, KV heads, head dim] += returned
[N * Ckv, ...] at `kv_return_index`) is timed alone, its blocks padded to `--ckv` rows when given
(the capacity a run had grown to). A scatter-add with repeated indices is done with atomics on a
GPU: the old index sent every empty slot onto row 0. Prints a table; both indices must give the
same rows (checked, up to the order of a row's sums)."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np


def padded(idx_NxC, valid_NxC, ckv: int):
  """A plan's send arrays with each block padded to `ckv` slots (empty, index 0)."""
  n, c = idx_NxC.shape
  if ckv <= c:
    return idx_NxC, valid_NxC
  pad = ((0, 0), (0, ckv - c))
  return np.pad(idx_NxC, pad), np.pad(valid_NxC, pad)


def main(argv=None) -> int:
  import jax
  import jax.numpy as jnp
  from distca_jax import dispatch, gate
  from distca_jax.benchtools import median_ms
  from distca_jax.config import load_config
  from distca_jax.data.sources import synthetic_from_config
  from distca_jax.models.presets import resolve

  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--dist", default="prolong")
  ap.add_argument("--step", type=int, default=14, help="the sampler's step whose batch to plan")
  ap.add_argument("--devices", type=int, default=gate.FIT_DEVICES)
  ap.add_argument("--ckv", type=int, default=0, help="pad each K/V block to this many slots")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--set", nargs="*", default=[], help="config overrides on the gate fit's setup")
  args = ap.parse_args(argv)
  cfg = load_config(None, list(gate.FIT_SETUP) + ["attention.impl=distca", "attention.gate=false"]
                    + args.set)
  shape = resolve(cfg.model)
  src = synthetic_from_config(dataclasses.replace(cfg.data, distribution=args.dist),
                              shape.vocab_size, args.devices)
  ctx = dispatch.plan_step(cfg.attention, src.batch(args.step), shape)
  if not ctx.cad:
    print(f"{args.dist}@{args.step}: the step runs colocated; nothing returns")
    return 1
  kh, e = shape.kv_heads, shape.head_dim
  dtype = jnp.dtype(cfg.model.dtype)
  scatter = jax.jit(lambda rows, back, idx: rows.at[idx].add(back, mode="drop"))
  print(f"{args.dist}@{args.step}, {args.devices} devices, {jax.devices()[0].device_kind}, "
        f"[rows, {kh}, {e}] {dtype.name}, median of {args.iters}")
  print("| plan | device | T | Ckv | slots | real | empty | dropped (now) ms | onto row 0 (before) ms | "
        "before / now |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for i, p in enumerate(ctx.dispatch):
    n, c = p.send_kv_idx.shape[1:]
    t = p.server_kv_inv.shape[-1] - n * c  # the device's local K/V rows
    dev = int(np.argmax(np.asarray(p.send_kv_valid).sum(axis=(1, 2))))  # the most rows home
    idx, valid = padded(np.asarray(p.send_kv_idx[dev]), np.asarray(p.send_kv_valid[dev]), args.ckv)
    c = idx.shape[1]
    key = jax.random.split(jax.random.PRNGKey(i))
    rows = jax.random.normal(key[0], (t, kh, e), dtype)
    back = jax.random.normal(key[1], (n * c, kh, e), dtype) * jnp.asarray(
        valid.reshape(-1, 1, 1), dtype)  # empty slots return zeros, as in a step
    now = dispatch.kv_return_index(jnp.asarray(idx), jnp.asarray(valid), t)
    old = jnp.where(jnp.asarray(valid).reshape(-1), jnp.asarray(idx).reshape(-1), 0)
    a, b = scatter(rows, back, now), scatter(rows, back, old)
    # Equal up to the order in which a row's returns from several servers are summed.
    if not np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2):
      print(f"plan {i}: the two indices gave different rows")
      return 1
    ms_now, ms_old = (median_ms(scatter, rows, back, x, warmup=1, iters=args.iters)
                      for x in (now, old))
    real = int(valid.sum())
    print(f"| {i} | {dev} | {t} | {c} | {n * c} | {real} | {n * c - real} | {ms_now:.3f} | "
          f"{ms_old:.3f} | {ms_old / ms_now:.2f} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
