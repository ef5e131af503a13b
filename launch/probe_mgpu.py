"""Would a Mosaic GPU (Pallas, Hopper wgmma + warp specialisation) backward beat our Triton one?

    python3 launch/probe_mgpu.py [--seq 16384] [--heads 32,8] [--head-dim 128] [--no-check]

A probe before building one (issue 4: our packed backward runs at ~375 TF/s on an H100, cuDNN's
dense backward at ~550). JAX ships an FA3-style Mosaic GPU attention
(`jax.experimental.pallas.ops.gpu.attention_mgpu`) whose backward is non-causal only, so the probe
compares non-causal work: one dense sequence of T tokens for JAX's Mosaic GPU kernel, for our
one-kernel backward with dQ by TMA reduce-add (`mgpu_fused_bwd.py`, after JAX's kernel; its
gradients are checked first) and for cuDNN (`jax.nn.dot_product_attention(implementation=
"cudnn")`), and for our backends a fused batch of T / q tasks of q queries over one shared T-row
prefix (bottom-right causal, so (1 - q/2T) of the rectangle; TF/s are counted on each one's real
area). float16 (the Mosaic GPU backward's scratch type), GQA. Prints one table; every row's ratio
is to cuDNN dense in the same run.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also under `python -P`
from bench_kernels import fwd_fwdbwd_ms  # noqa: E402


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seq", type=int, default=16384)
  ap.add_argument("--heads", default="32,8", help="query heads, KV heads")
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--task-q", type=int, default=1024, help="queries per task of our kernels")
  ap.add_argument("--backends", default="triton,pallas",
                  help="our backends on the task batch; mosaic:KEY=VALUE[+KEY=VALUE] sets those "
                       "fields of kernels.mosaic.Options (e.g. mosaic:forward=mosaic)")
  ap.add_argument("--rows", default="dense,jax,fused,ours",
                  help="which kernels to run (fewer for a profiler: ncu -k regex:NAME)")
  ap.add_argument("--fused-stages", default="2,3")
  ap.add_argument("--no-check", dest="check", action="store_false",
                  help="skip the fused backward's gradient check")
  args = ap.parse_args()
  T, D, q_task = args.seq, args.head_dim, args.task_q
  H, K = (int(x) for x in args.heads.split(","))
  dt = jnp.float16
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(ks[0], (T, H, D), dt)
  k = jax.random.normal(ks[1], (T, K, D), dt)
  v = jax.random.normal(ks[2], (T, K, D), dt)
  do = jax.random.normal(ks[3], (T, H, D), dt)
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, T={T} H={H} K={K} d={D} "
        f"float16, non-causal", flush=True)
  rect = 4.0 * D * H * T * T  # forward FLOPs of the full rectangle
  rows = []

  def record(name, area_flops, fn, *extra):
    try:
      fms, fbms = fwd_fwdbwd_ms(fn, q, k, v, do, *extra)
    except Exception as e:  # noqa: BLE001 (a probe reports and goes on)
      print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
      return
    rows.append((name, area_flops / fms / 1e9, 2.5 * area_flops / max(fbms - fms, 1e-6) / 1e9,
                 3.5 * area_flops / fbms / 1e9))
    print(f"{name}: fwd {fms:.2f} ms, f+b {fbms:.2f} ms", flush=True)

  which = set(args.rows.split(","))
  dense = lambda q, k, v: jax.nn.dot_product_attention(q[None], k[None], v[None],
                                                       implementation="cudnn")[0]
  if "dense" in which:
    record("cuDNN dense", rect, dense)

  from jax.experimental.pallas.ops.gpu import attention_mgpu as mg
  for bq, bkv, wgs in ((64, 128, 1), (64, 64, 1), (64, 128, 2)) if "jax" in which else ():
    try:
      cfg = mg.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                            block_q_dkv=bq, block_kv_dkv=bkv, block_q_dq=bq, block_kv_dq=bkv,
                            compute_wgs_bwd=wgs)
    except (TypeError, ValueError) as e:
      print(f"mgpu config {bq}x{bkv} wgs{wgs}: {e}", flush=True)
      continue
    fn = lambda q, k, v, cfg=cfg: mg.attention(q[None], k[None], v[None], cfg)[0]
    record(f"Mosaic GPU (JAX's FA3) bwd {bq}x{bkv} wgs{wgs}", rect, fn)

  import mgpu_fused_bwd as fused
  fwd_cfg = mg.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2)
  if args.check and "fused" in which:
    check_fused(fused, fwd_cfg, H, K, D)
  for steps in (int(s) for s in args.fused_stages.split(",") if s and "fused" in which):
    fn = lambda q, k, v, s=steps: fused.attention(q, k, v, fwd_cfg, max_concurrent_steps=s)
    record(f"Mosaic GPU fwd + fused backward, dQ by TMA reduce-add ({steps} stages)", rect, fn)

  from distca_jax import kernels
  n = T // q_task
  tasks = kernels.make_task_table([i * q_task for i in range(n)], [q_task] * n, [0] * n, [T] * n,
                                  num_q_rows=T, num_kv_rows=T)
  tasks = kernels.TaskTable(*(jnp.asarray(a) for a in tasks))
  area = float(kernels.causal_area(tasks).sum())
  for b in (b for b in args.backends.split(",") if b and "ours" in which):
    name, _, flag = b.partition(":")
    if flag:  # a variant of the mosaic kernels
      from distca_jax.kernels import mosaic
      attn = functools.partial(mosaic.attention, config=mosaic.parse_options(flag))
    else:
      attn = functools.partial(kernels.attention, backend=name)
    record(f"ours: {b} ({n} tasks of {q_task} over {T})", 4.0 * D * H * area,
           lambda q, k, v, t, attn=attn: attn(q, k, v, t)[0], tasks)

  if not rows:
    return
  base = rows[0][3] if rows[0][0] == "cuDNN dense" else float("nan")
  print("\n| kernel | fwd TF/s | bwd TF/s | f+b TF/s | f+b vs cuDNN dense |\n|---|---|---|---|---|")
  for name, f, b, fb in rows:
    print(f"| {name} | {f:.1f} | {b:.1f} | {fb:.1f} | {fb / base:.2f} |")


def check_fused(fused, fwd_cfg, H, K, D, T=1024):
  """Gradients of the fused backward against float32 attention on a small sequence (prints the
  relative error of each, and says so loudly if one is above 2e-2)."""
  ks = jax.random.split(jax.random.PRNGKey(1), 4)
  q, do = (jax.random.normal(x, (T, H, D), jnp.float16) for x in ks[:2])
  k, v = (jax.random.normal(x, (T, K, D), jnp.float16) for x in ks[2:])
  q = (q * D ** -0.5).astype(jnp.float16)  # the kernels have no softmax scale

  def ref(q, k, v):
    g = H // K
    s = jnp.einsum("thd,shd->hts", q, jnp.repeat(k, g, 1), preferred_element_type=jnp.float32)
    return jnp.einsum("hts,shd->thd", jax.nn.softmax(s, -1), jnp.repeat(v, g, 1).astype(s.dtype))

  f32 = lambda *a: tuple(x.astype(jnp.float32) for x in a)
  want = jax.jit(lambda *a: jax.vjp(ref, *a)[1](do.astype(jnp.float32)))(*f32(q, k, v))
  got = jax.jit(lambda *a: jax.vjp(lambda *b: fused.attention(*b, fwd_cfg), *a)[1](do))(q, k, v)
  errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / jnp.max(jnp.abs(w)))
          for g, w in zip(got, want)]
  print("fused backward vs float32 reference, max |err| / max |ref|: dQ %.2e dK %.2e dV %.2e"
        % tuple(errs), flush=True)
  if max(errs) > 2e-2:
    print("fused backward: GRADIENTS WRONG (above 2e-2); its timings mean nothing", flush=True)


if __name__ == "__main__":
  main()
