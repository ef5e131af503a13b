"""Benchmark the CA-task attention backends on a GPU, beside cuDNN dense causal attention.

    python3 launch/bench_kernels.py --out $OUT --backends pallas,triton

(needs the package importable as `distca_jax.kernels`: `pip install -e .`, or on a machine without
network a PYTHONPATH folder holding distca_jax/ with kernels/ copied in as distca_jax/kernels.)

Two parts:
1. Scheduler-shaped batches: documents drawn from the Pretrain / ProLong length distributions
   (`distca_jax.data.doclens`) filling a context, each document cut into 128-token-multiple shards,
   every shard a task with its full causal prefix, K/V of a document stored once (shared by its
   shards). Per backend: forward, backward (= fwd+bwd minus fwd) and forward+backward TFLOP/s on
   the real causal area, next to cuDNN dense causal attention
   (`jax.nn.dot_product_attention(..., implementation="cudnn", is_causal=True)`) of equal area,
   measured in the same run.
2. A (q, kv) sweep from 128 to 64K: tasks of q queries, each over kv key rows of its own
   (`--sweep-layout own`; `shared`: all over the same kv rows, which leaves a backward parallel
   over key blocks a handful of CTAs when kv is short: 8 CTAs on 132 SMs at kv = 128), as many
   as give a measurable time; writes the table
   the scheduler's cost model loads:
   {"device", "dtype", "heads", "kv_heads", "head_dim", "q", "kv", "fwd_ms", "fwdbwd_ms"}, with
   times per task (ms), null where q > kv or not measured.

`--geometry` (any machine, runs no kernel): per batch, what sets the ceiling of the comparison,
whatever the kernels: the rows against the equal-area dense length (the row-linear passes scale
with rows, the FLOPs with area) and the tile area the block schedule visits over the causal area
at the forward's and the backward's tiles, beside the dense sequence's own.

FLOPs: forward 4·D·H·area, backward 2.5× forward, area = Σ per task q·kv − q(q−1)/2
(`distca_jax.benchtools`). Times are medians over 7 calls after warm-up, each ended by
block_until_ready, and over `--rounds` rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

from distca_jax import kernels
from distca_jax.benchtools import (attention_flops, attention_inputs, doc_layout, sampled_batch,
                                   time_in_rounds, tflops, timer)

import jax
import jax.numpy as jnp

H, K, D = 32, 8, 128


def print_views(batch, gpu, flops, wall):
  """The `--gpu-time` table of one batch: per timer (backends and "dense"), forward and
  forward+backward TF/s by wall time per call (`wall`: name -> (fwd ms, f+b ms)), by queued wall
  time, by GPU span and by summed GPU kernel time (`gpu`: name -> `timer().gpu()`), and f+b as a
  ratio of the dense baseline's by the same view. `flops`: name -> forward FLOPs."""
  views = {n: {"wall": wall[n], **gpu[n]} for n in gpu}
  cols = ("wall", "queued", "span", "busy")
  print(f"{batch}: TF/s fwd / f+b by view" + ("; f+b vs dense by the same view"
                                              if "dense" in views else ""), flush=True)
  print(f"  {'timer':10s}" + "".join(f" {c:>22s}" for c in cols), flush=True)
  for n, v in views.items():
    cells = []
    for c in cols:
      fms, fbms = v[c]
      cell = f"{flops[n] / fms / 1e9:6.1f} / {3.5 * flops[n] / fbms / 1e9:6.1f}"
      if "dense" in views and n != "dense":
        dfb = views["dense"][c][1]
        cell += f" {(flops[n] / fbms) / (flops['dense'] / dfb):4.2f}x"
      cells.append(cell)
    print(f"  {n:10s}" + "".join(f" {c:>22s}" for c in cells), flush=True)


def tile_waste(tasks, T, block_q, block_k):
  """Area of the (query tile, key block) pairs the kernels' block schedule visits over the real
  causal area (1.0: no tile reaches past a row's keys)."""
  from distca_jax.kernels.blocks import cdiv, query_schedule
  sch = query_schedule(kernels.TaskTable(*(jnp.asarray(a) for a in tasks)),
                       cdiv(T, block_q) * block_q, block_q, block_k)
  visited = float(np.clip(np.asarray(sch.kb_hi) - np.asarray(sch.kb_lo), 0, None).sum())
  return visited * block_q * block_k / float(kernels.causal_area(tasks).sum())


def sweep_layout(q, kv, target_area=1.5e8, max_rows=65536, own_kv=True, max_kv_rows=1 << 21):
  """n tasks of q queries each, each over kv key rows of its own (own_kv) or all over the same
  kv rows [0, kv)."""
  area = q * kv - q * (q - 1) / 2
  n = int(max(1, min(math.ceil(target_area / area), max_rows // q,
                     max_kv_rows // kv if own_kv else max_rows)))
  starts = [i * kv if own_kv else 0 for i in range(n)]
  tasks = kernels.make_task_table([i * q for i in range(n)], [q] * n, starts, [kv] * n,
                                  num_q_rows=n * q, num_kv_rows=n * kv if own_kv else kv)
  return tasks, n * q, (n * kv if own_kv else kv), n


def fwd_flops(area):
  """Forward FLOPs over a causal `area` at this run's heads and head dim."""
  return attention_flops(area, H, D)


def inputs(T, S, seed=0):
  """Random bf16 q, k, v, dO at this run's heads and head dim."""
  return attention_inputs(T, S, H, K, D, seed)


def time_backend(backend, tasks, T, S, attn=None, fwd_only=False):
  """(fwd ms, fwd+bwd ms) of one fused batch; `attn(q, k, v, tasks) -> (O, LSE)` overrides the
  backend (config tuning)."""
  return backend_timer(backend, tasks, T, S, attn, fwd_only)()


def backend_timer(backend, tasks, T, S, attn=None, fwd_only=False):
  """`time_backend` as a `timer`: compiled once, run as often as asked."""
  if attn is None:
    attn = lambda q, k, v, t: kernels.attention(q, k, v, t, backend=backend)
  q, k, v, do = inputs(T, S)
  tasks = kernels.TaskTable(*(jnp.asarray(a) for a in tasks))
  return timer(lambda q, k, v, t: attn(q, k, v, t)[0], q, k, v, do, tasks, fwd_only=fwd_only)


def tune_configs(backend, head_dim):
  """Tile/launch variants tried by --tune (name -> `common.Config`) at `head_dim`; Triton gets
  short lists because its dK/dV kernel takes ~30 s to compile. At D = 128 the variants around the
  measured default; at 64 larger tiles (smaller accumulators); at 256 smaller ones (128 x 128
  forward tiles and 64-row dK/dV accumulators at 4 warps do not fit)."""
  from distca_jax.kernels.common import gpu_config
  base = gpu_config(head_dim)
  bwd64 = dict(block_q_dq=64, block_k_dq=64, block_q_dkv=64, block_k_dkv=64, num_warps_bwd=4,
               num_stages_bwd=2)
  configs = {"default": base}
  if backend == "triton" and head_dim <= 64:
    configs.update({
        "fwd128x64w4s3": base._replace(block_k=64, num_warps=4),
        "dkv128x64w8s2": base._replace(block_k_dkv=128, num_warps_bwd=8),
        "dkv128x128w8s2": base._replace(block_q_dkv=128, block_k_dkv=128, num_warps_bwd=8),
        "dq128x64w8s2": base._replace(block_q_dq=128, num_warps_dq=8, num_stages_dq=2),
        "bwd64x64w4s3": base._replace(num_stages_bwd=3),
    })
  elif backend == "triton" and head_dim >= 256:
    small = base._replace(block_q=64, block_k=64, num_warps=4, num_stages=2)
    configs = {
        "fwd64x64w4s2": small,
        "fwd128x64w8s2": small._replace(block_q=128, num_warps=8),
        "fwd64x64w4s1": small._replace(num_stages=1),
        "bwd64x64w8s2": small._replace(num_warps_bwd=8),
        "dkv64x32w4s2": small._replace(block_k_dkv=32, block_q_dq=32),
        "bwd32x32w4s2": small._replace(block_q_dkv=32, block_k_dkv=32, block_q_dq=32,
                                       block_k_dq=32),
    }
  elif backend == "triton":
    configs.update({
        "untransposed_dkv": base._replace(bwd_transposed=False),
        "dkv64x64w4s3": base._replace(num_stages_bwd=3),
        "dkv32x128w4s3": base._replace(block_q_dkv=32, block_k_dkv=128, num_stages_bwd=3),
        "dkv64x128w8s2": base._replace(block_q_dkv=64, block_k_dkv=128, num_warps_bwd=8),
        "dq128x32w4s3": base._replace(block_q_dq=128, block_k_dq=32, num_warps_dq=4,
                                      num_stages_dq=3),
    })
  if backend == "pallas":
    configs.update({
        "fused64x64w4s2": base._replace(fused_bwd=True, **bwd64),
        "fwd128x128w8s3": base._replace(block_k=128),
        "bwd64x64w4s3": base._replace(**{**bwd64, "num_stages_bwd": 3}),
        "bwd_dq128x64w8": base._replace(**{**bwd64, "block_q_dq": 128}, num_warps_dq=8),
        "fused64x128w8s2": base._replace(fused_bwd=True, block_q_dkv=64, block_k_dkv=128,
                                         num_warps_bwd=8, num_stages_bwd=2),
        "fused128x64w8s2": base._replace(fused_bwd=True, block_q_dkv=128, block_k_dkv=64,
                                         num_warps_bwd=8, num_stages_bwd=2),
    })
  return configs


def best_config(tried):
  """Forward fields from the fastest forward, backward fields from the fastest backward."""
  fwd = min(tried, key=lambda r: r[1])[0]
  bwd = min(tried, key=lambda r: r[2] - r[1])[0]
  return bwd._replace(block_q=fwd.block_q, block_k=fwd.block_k, num_warps=fwd.num_warps,
                      num_stages=fwd.num_stages)


def dense_timer(T):
  """A `timer` of cuDNN dense causal attention over one sequence of T tokens."""
  q, k, v, do = inputs(T, T, seed=1)
  attn = lambda q, k, v: jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                      implementation="cudnn")[0]
  return timer(attn, q, k, v, do)


def geometry(datasets, contexts, max_shard):
  """Per batch: (name, documents, rows, equal-area dense length, rows / dense length, tile area
  over causal area at the forward's 128 x 128 and the backward's 64 x 128 tiles, and the dense
  sequence's at 64 x 128)."""
  out = []
  for ds in datasets:
    for ctx in contexts:
      lens, tasks, T, _ = sampled_batch(ds, ctx, max_shard)
      Td = dense_equivalent(float(kernels.causal_area(tasks).sum()))
      dense = kernels.make_task_table([0], [Td], [0], [Td], num_q_rows=Td, num_kv_rows=Td)
      out.append((f"{ds} {ctx // 1024}K", len(lens), T, Td, T / Td, tile_waste(tasks, T, 128, 128),
                  tile_waste(tasks, T, 64, 128), tile_waste(dense, Td, 64, 128)))
  return out


def dense_equivalent(area):
  """Sequence length (multiple of 128) whose causal area is closest to `area`."""
  return max(128, int(round(math.sqrt(2 * area) / 128)) * 128)


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--backends", default="pallas,triton",
                  help="comma list (also mosaic, reference)")
  ap.add_argument("--contexts", default="65536,131072,262144,524288",
                  help="tokens a batch fills (64K-512K; at 512K the mosaic backward's float32 dQ "
                       "buffer alone is 8 GiB)")
  ap.add_argument("--datasets", default="pretrain,prolong")
  ap.add_argument("--max-shard", type=int, default=8192,
                  help="longest shard (tokens) a document is cut into")
  ap.add_argument("--sweep", default="128,512,2048,8192,32768,65536")
  ap.add_argument("--sweep-area", type=float, default=1.5e8,
                  help="causal area a sweep cell's tasks add up to (as many tasks as reach it)")
  ap.add_argument("--sweep-layout", choices=("own", "shared"), default="own",
                  help="each sweep task over key rows of its own, or all over the same ones")
  ap.add_argument("--table-backend", default="auto",
                  help="backend of the (q, kv) table; auto: best mean f+b TF/s on the batches")
  ap.add_argument("--budget-s", type=float, default=400.0,
                  help="stop starting new measurements after this many seconds")
  ap.add_argument("--tune", default="",
                  help="comma list of backends (pallas, triton) whose tune_configs() to time on "
                       "the first batch")
  ap.add_argument("--rounds", type=int, default=1,
                  help="time each batch's backends and its dense baseline this many times, in "
                       "rotating order, and report medians over rounds")
  ap.add_argument("--gpu-time", action="store_true",
                  help="also time each batch's backends and dense baseline by the GPU time in a "
                       "profiler trace (no host dispatch or sync), and report ratios by it")
  ap.add_argument("--head-dim", type=int, default=D)
  ap.add_argument("--heads", default=f"{H},{K}", help="query heads, KV heads")
  ap.add_argument("--geometry", action="store_true",
                  help="print each batch's rows and tile area against its dense equivalent (no "
                       "kernels run; any machine) and stop")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  return ap.parse_args(argv)


def print_geometry(datasets, contexts, max_shard):
  """The --geometry table."""
  print("| batch | documents | rows | dense length | rows / dense | tile area 128x128 | "
        "64x128 | dense's 64x128 |\n|---|---|---|---|---|---|---|---|")
  for name, n, T, Td, r, wf, wb, wd in geometry(datasets, contexts, max_shard):
    print(f"| {name} | {n} | {T:,} | {Td:,} | {r:.1f} | {wf:.3f} | {wb:.3f} | {wd:.3f} |")


def tune(backend, batch, results, over):
  """Times `tune_configs(backend)` on one batch; the rest of the run (batches, sweep) uses the
  fastest tiles: GPU_CONFIGS is shared by the pallas and triton backends."""
  from distca_jax.kernels import common
  name, tasks, T, S, f = batch["name"], batch["tasks"], batch["T"], batch["S"], batch["flops"]
  mod = __import__(f"distca_jax.kernels.{backend}", fromlist=["attention"])
  tried = []
  for cname, cfg in tune_configs(backend, D).items():
    if over():
      break
    try:
      fms, fbms = time_backend(backend, tasks, T, S, attn=lambda q, k, v, t, cfg=cfg:
                               mod.attention(q, k, v, t, config=cfg))
    except Exception as e:  # noqa: BLE001
      print(f"tune {backend} {cname}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    tf = tflops(f, fms, fbms)
    print(f"tune {backend:7s} {cname:22s} fwd {tf[0]:6.1f} TF/s  bwd {tf[1]:6.1f}  "
          f"f+b {tf[2]:6.1f}", flush=True)
    results.setdefault("tune", []).append(dict(backend=backend, config=cname, batch=name,
                                               fwd_ms=fms, fwdbwd_ms=fbms))
    tried.append((cfg, fms, fbms))
  if tried:
    common.GPU_CONFIGS[D] = best = best_config(tried)
    print(f"tune {backend} d={D}: using {best}", flush=True)
    results.setdefault("tuned", {})[backend] = dict(best._asdict(), head_dim=D)


def time_batch(batch, backends, dense, rounds, over):
  """Every backend and the batch's dense baseline compiled once, then timed `rounds` times in
  rotating order (`time_in_rounds`): (timers, name -> [(fwd ms, f+b ms) per round]). A backend
  that fails is reported and left out."""
  runs, times = {}, {}
  for b in backends:
    if over():
      break
    try:
      runs[b] = backend_timer(b, batch["tasks"], batch["T"], batch["S"])
      times[b] = [runs[b]()]
    except Exception as e:  # noqa: BLE001
      print(f"{batch['name']:24s} {b:8s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      runs.pop(b, None)
  try:
    runs["dense"] = dense(batch["dense_T"])
    times["dense"] = [runs["dense"]()]
  except Exception as e:  # noqa: BLE001 (report and go on)
    print(f"dense cudnn T={batch['dense_T']}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    runs.pop("dense", None)
  return runs, time_in_rounds(runs, rounds, times, stop=over)


def report_batch(batch, backends, runs, times, gpu_time):
  """Prints a batch's rows (and with `gpu_time` its table of views) and returns them as JSON rows,
  with the dense baseline's (fwd ms, f+b ms) or None."""
  name, f, Teq = batch["name"], batch["flops"], batch["dense_T"]
  f_eq = fwd_flops(Teq * (Teq + 1) / 2)
  med = lambda n, i: float(np.median([t[i] for t in times[n]]))
  d_tf, d_ms = (float("nan"), float("nan")), None
  if "dense" in times:
    d_ms = med("dense", 0), med("dense", 1)
    d_tf = (f_eq / d_ms[0] / 1e9, 3.5 * f_eq / d_ms[1] / 1e9)
  gpu = {n: runs[n].gpu() for n in runs} if gpu_time else {}
  if gpu and not all(g["busy"][0] > 0 for g in gpu.values()):
    print(f"{name:24s} no GPU kernels in the profiler trace: no GPU times", flush=True)
    gpu = {}
  if gpu:
    print_views(name, gpu, {n: (f_eq if n == "dense" else f) for n in gpu},
                {n: (med(n, 0), med(n, 1)) for n in gpu})
  rows = []
  for b in (b for b in backends if b in times):
    fms, fbms = med(b, 0), med(b, 1)
    tf = tflops(f, fms, fbms)
    spread = [tflops(f, *t)[2] for t in times[b]]
    print(f"{name:24s} {b:8s} {tf[0]:9.1f} {tf[1]:9.1f} {tf[2]:9.1f} {d_tf[0]:8.1f} "
          f"{d_tf[1]:9.1f} {tf[2] / d_tf[1]:9.2f}"
          + (f"  (f+b over {len(spread)} rounds {min(spread):.1f}-{max(spread):.1f})"
             if len(spread) > 1 else ""), flush=True)
    row = dict(
        dataset=batch["dataset"], context=batch["context"], docs=batch["docs"],
        tasks=int((np.asarray(batch["tasks"].q_len) > 0).sum()), area=batch["area"], backend=b,
        fwd_ms=fms, fwdbwd_ms=fbms, fwd_tflops=tf[0], bwd_tflops=tf[1], fwdbwd_tflops=tf[2],
        dense_T=Teq, dense_fwd_tflops=d_tf[0], dense_fwdbwd_tflops=d_tf[1], rounds=len(times[b]))
    if b in gpu:
      row.update(gpu_columns(gpu[b]))
      if "dense" in gpu:
        row.update(gpu_columns(gpu["dense"], "dense_"))
    rows.append(row)
  return rows, d_ms


def gpu_columns(views, prefix=""):
  """A timer's `gpu()` views as JSON columns: {prefix}{view}_{fwd|fwdbwd}_ms."""
  return {f"{prefix}{view}_{part}_ms": views[view][i] for view in views
          for i, part in enumerate(("fwd", "fwdbwd"))}


def sweep_table(backend, sweep, layout, area, device, out, over):
  """The (q, kv) time table of `backend` (per task, ms), written to OUT/<card>.json after each
  cell."""
  table = {"device": device, "dtype": "bfloat16", "heads": H, "kv_heads": K, "head_dim": D,
           "backend": backend, "layout": layout, "q": sweep, "kv": sweep,
           "fwd_ms": [[None] * len(sweep) for _ in sweep],
           "fwdbwd_ms": [[None] * len(sweep) for _ in sweep]}
  if sweep:
    print(f"\nsweep ({backend}); per-task ms and TF/s f / f+b", flush=True)
  for i, q in enumerate(sweep):
    for j, kv in enumerate(sweep):
      if q > kv or over():
        continue
      tasks, T, S, n = sweep_layout(q, kv, target_area=area, own_kv=layout == "own")
      try:
        fms, fbms = time_backend(backend, tasks, T, S)
      except Exception as e:  # noqa: BLE001
        print(f"q={q} kv={kv}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        continue
      f = fwd_flops(float(kernels.causal_area(tasks).sum()))
      table["fwd_ms"][i][j], table["fwdbwd_ms"][i][j] = fms / n, fbms / n
      print(f"q={q:6d} kv={kv:6d} n={n:4d}  fwd {fms / n:9.4f} ms {f / fms / 1e9:6.1f}  "
            f"f+b {fbms / n:9.4f} ms {3.5 * f / fbms / 1e9:6.1f}", flush=True)
      with open(os.path.join(out, f"{device.replace(' ', '_')}.json"), "w") as fh:
        json.dump(table, fh, indent=1)


def make_batch(dataset, context, max_shard):
  """One sampled batch and what its rows report: name, task table, rows, causal area, forward
  FLOPs and the equal-area dense length."""
  lens, tasks, T, S = sampled_batch(dataset, context, max_shard)
  area = float(kernels.causal_area(tasks).sum())
  return dict(name=f"{dataset}-{context // 1024}K({len(lens)}docs)", dataset=dataset,
              context=context, docs=len(lens), tasks=tasks, T=T, S=S, area=area,
              flops=fwd_flops(area), dense_T=dense_equivalent(area))


def main(argv=None):
  global H, K, D
  args = parse_args(argv)
  datasets = [d for d in args.datasets.split(",") if d]
  contexts = [int(c) for c in args.contexts.split(",") if c]
  if args.geometry:
    print_geometry(datasets, contexts, args.max_shard)
    return
  H, K = (int(x) for x in args.heads.split(","))
  D = args.head_dim
  t_start = time.time()
  over = lambda: time.time() - t_start > args.budget_s
  device = jax.devices()[0].device_kind
  print(f"device {device}, jax {jax.__version__}, H={H} K={K} d={D} bf16", flush=True)
  backends = [b for b in args.backends.split(",") if b]
  results = {"device": device, "jax": jax.__version__, "batches": [], "dense": {}}
  dense_cache, dense_ms = {}, {}  # T -> timer; T -> (fwd ms, fwd+bwd ms) last measured

  def dense(T):
    if T not in dense_cache:
      dense_cache[T] = dense_timer(T)
    return dense_cache[T]

  def save():
    with open(os.path.join(args.out, "bench_kernels.json"), "w") as fh:
      json.dump(results, fh, indent=1)

  print(f"{'batch':24s} {'backend':8s} {'fwd TF/s':>9s} {'bwd TF/s':>9s} {'f+b TF/s':>9s} "
        f"{'dense f':>8s} {'dense f+b':>9s} {'ratio f+b':>9s}", flush=True)
  tunes = [t for t in args.tune.split(",") if t]
  for batch in (make_batch(ds, ctx, args.max_shard) for ds in datasets for ctx in contexts):
    Teq = batch["dense_T"]
    dense_tasks = kernels.make_task_table([0], [Teq], [0], [Teq])
    waste = tile_waste(batch["tasks"], batch["T"], 128, 128)
    print(f"{batch['name']:24s} tiles visit {waste:.3f}x the causal area (128 x 128 tiles; the "
          f"dense baseline of T={Teq}: {tile_waste(dense_tasks, Teq, 128, 128):.3f}x)", flush=True)
    for tb in tunes:
      tune(tb, batch, results, over)
    tunes = []  # first batch only
    runs, times = time_batch(batch, backends, dense, args.rounds, over)
    rows, d_ms = report_batch(batch, backends, runs, times, args.gpu_time)
    if d_ms:
      dense_ms[Teq] = d_ms
    results["batches"] += rows
    save()

  try:
    dfwd, dfb = dense_ms[16384] = dense(16384)()
    f16 = fwd_flops(16384 * 16385 / 2)
    print(f"cuDNN dense causal T=16384: fwd {f16 / dfwd / 1e9:.1f} TF/s, "
          f"f+b {3.5 * f16 / dfb / 1e9:.1f} TF/s", flush=True)
  except Exception as e:  # noqa: BLE001
    print(f"dense cudnn T=16384: {type(e).__name__}: {str(e)[:200]}", flush=True)
  table_backend = args.table_backend
  if table_backend == "auto":
    score = {}
    for r in results["batches"]:
      score.setdefault(r["backend"], []).append(r["fwdbwd_tflops"])
    table_backend = (max(score, key=lambda b: np.mean(score[b])) if score else
                     backends[0] if backends else None)
  # No backend (`--backends ""`: the dense baseline alone, e.g. under a profiler): no table.
  if table_backend:
    sweep_table(table_backend, [int(x) for x in args.sweep.split(",") if x], args.sweep_layout,
                args.sweep_area, device, args.out, over)
  results["dense"] = {str(t): dict(fwd_ms=a, fwdbwd_ms=b) for t, (a, b) in dense_ms.items()}
  save()
  print(f"done in {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
  main()
