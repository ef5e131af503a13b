"""One device: the local work of the packed tiled exchange (gathers into the send buffer and its
blocks, the scatter into the receive buffer, and their way back) against the block layout it
replaced (rows gathered straight into [N, C] blocks and read where they land), for a planned step.

  python launch/tools/exchange_local.py [--dist prolong] [--devices 2] [--tokens 65536] [--iters 20]

The collective itself is left out (an identity stands in for the all_to_all: same shapes), so
the difference is what the packed format adds on every device. Rows: Llama-3-8B's 32 query heads
and 8 K/V heads of 128, bf16. Prints one table row per (plan, side).
"""

from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--dist", default="prolong")
  ap.add_argument("--devices", type=int, default=2)
  ap.add_argument("--tokens", type=int, default=65536)
  ap.add_argument("--steps", type=int, nargs="+", default=[0, 1, 2])
  ap.add_argument("--iters", type=int, default=20)
  args = ap.parse_args(argv)

  import jax
  import jax.numpy as jnp

  from distca_jax import dispatch
  from distca_jax.benchtools import median_ms
  from distca_jax.config import load_config
  from distca_jax.data.sources import synthetic_from_config
  from distca_jax.models.presets import resolve

  n, t = args.devices, args.tokens
  cfg = load_config(None, ["model.preset=llama3_8b", f"data.tokens_per_device={t}",
                           "attention.impl=distca", "attention.gate=false",
                           "attention.min_imbalance=1", f"mesh.data={n}",
                           f"data.distribution={args.dist}"])
  shape = resolve(cfg.model)
  src = synthetic_from_config(cfg.data, shape.vocab_size, n)

  def packed(x, idx, valid, off, count, recv_off, recv_count, block, out_rows):
    send = jnp.where(valid[:, None, None], jnp.take(x, idx, axis=0), 0)
    j = jnp.arange(block)[None, :]
    blocks = jnp.where((j < count[:, None])[..., None, None],
                       jnp.take(send, off[:, None] + j, axis=0, mode="clip"), 0)
    dst = jnp.where(j < recv_count[:, None], recv_off[:, None] + j, out_rows)
    out = jnp.zeros((out_rows,) + x.shape[1:], x.dtype)
    return out.at[dst.reshape(-1)].set(blocks.reshape((-1,) + x.shape[1:]), mode="drop")

  def blocked(x, idx_NxC, valid_NxC):
    return jnp.where(valid_NxC[..., None, None], jnp.take(x, idx_NxC, axis=0), 0).reshape(
        (-1,) + x.shape[1:])

  packed_j = jax.jit(packed, static_argnums=(7, 8))
  blocked_j = jax.jit(blocked)
  print(f"{args.dist}, {n} devices, {t} tokens, {jax.devices()[0].device_kind}, median of {args.iters}")
  print("| step | plan | side | rows moved (busiest device) | block rows | blocked ms | packed ms | packed / blocked |")
  print("|---|---|---|---|---|---|---|---|")
  for step in args.steps:
    ctx = dispatch.plan_step(cfg.attention, src.batch(step), shape)
    if not ctx.cad:
      continue
    for i, p in enumerate(ctx.dispatch):
      for side, heads, name in (("Q", shape.heads, "q"), ("K/V", shape.kv_heads, "kv")):
        r = getattr(p, name)
        count = np.asarray(r.send_count)
        if not count.any():  # nothing moves: no exchange runs
          continue
        d = int(np.argmax(count.sum(1)))  # the busiest sender
        block = max(int(count.max()), 1)
        idx, valid, off, cnt = r.send_idx[d], r.send_valid[d], r.send_off[d], count[d]
        rows = (p.kv_rows if name == "kv" else t)
        x = jax.random.normal(jax.random.PRNGKey(step), (rows, heads, 128), jnp.bfloat16)
        j = np.arange(block)[None, :]
        idx_nc = np.where(j < cnt[:, None], idx[np.minimum(off[:, None] + j, idx.size - 1)], 0)
        ok_nc = j < cnt[:, None]
        out_rows = max(int(count[d].sum()), 1)
        a = (x, jnp.asarray(idx), jnp.asarray(valid), jnp.asarray(off), jnp.asarray(cnt),
             jnp.asarray(off), jnp.asarray(cnt), block, out_rows)  # itself as the receiver
        ms_p = median_ms(packed_j, *a, warmup=2, iters=args.iters)
        ms_b = median_ms(blocked_j, x, jnp.asarray(idx_nc), jnp.asarray(ok_nc), warmup=2,
                         iters=args.iters)
        print(f"| {step} | {i} | {side} | {int(count[d].sum())} | {n * block} | {ms_b:.3f} | "
              f"{ms_p:.3f} | {ms_p / ms_b:.2f} |", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
