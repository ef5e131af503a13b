"""Benchmark the CA-task attention backends on a GPU, beside cuDNN dense causal attention.

    python3 launch/bench_kernels.py --out $OUT --backends pallas,cudnn,triton

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
   (`--sweep-layout own`; `shared`: all over the same kv rows, as the tables before 2026-11-27
   were made, which leaves a backward parallel over key blocks a handful of CTAs when kv is
   short: 8 CTAs on 132 SMs at kv = 128), as many as give a measurable time; writes the table
   the scheduler's cost model loads:
   {"device", "dtype", "heads", "kv_heads", "head_dim", "q", "kv", "fwd_ms", "fwdbwd_ms"}, with
   times per task (ms), null where q > kv or not measured.

`--geometry` (any machine, runs no kernel): per batch, what sets the ceiling of the comparison,
whatever the kernels: the rows against the equal-area dense length (the row-linear passes scale
with rows, the FLOPs with area) and the tile area the block schedule visits over the causal area
at the forward's and the backward's tiles, beside the dense sequence's own.

FLOPs: forward 4·d·H·area, backward 2.5× forward (the DESIGN.md convention), area = Σ per task
q·kv − q(q−1)/2. Times are medians over `--iters` runs after warm-up, each ended by
block_until_ready.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import math
import os
import tempfile
import time

import numpy as np

from distca_jax import kernels
from distca_jax.perfetto import gpu_events, intervals_union

import jax
import jax.numpy as jnp

H, K, D = 32, 8, 128


def median_ms(fn, *args, warmup=2, iters=7):
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return float(np.median(times))


def timer(attn, q, k, v, do, *extra, fwd_only=False):
  """`run(warmup) -> (fwd ms, fwd+bwd ms)` of `attn(q, k, v, *extra) -> O`, each jitted once
  (a later run reuses the executables); `extra` (a task table) travels as an argument, not as a
  constant of the program."""
  fwd = jax.jit(attn)

  @jax.jit
  def fwdbwd(q, k, v, do, *e):
    _, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, *e), q, k, v)
    return vjp(do)

  def run(warmup=2):
    fms = median_ms(fwd, q, k, v, *extra, warmup=warmup)
    return fms, (float("nan") if fwd_only else
                 median_ms(fwdbwd, q, k, v, do, *extra, warmup=warmup))

  # Other views than wall time per call: GPU time per kernel of a forward+backward call
  # (`gpu_kernel_ms`), and `gpu()` below.
  run.fwdbwd_kernels = lambda: gpu_kernel_ms(fwdbwd, q, k, v, do, *extra)

  def gpu():
    """{"busy": (fwd, f+b), "span": (fwd, f+b), "queued": (fwd, f+b)} in ms per call: summed
    GPU kernel time, GPU span and queued wall time (`gpu_profile`, `queued_ms`)."""
    fk, fspan = gpu_profile(fwd, q, k, v, *extra)
    bk, bspan = (collections.Counter(), float("nan")) if fwd_only else gpu_profile(
        fwdbwd, q, k, v, do, *extra)
    return {"busy": (sum(fk.values()), sum(bk.values()) if bk else float("nan")),
            "span": (fspan, bspan),
            "queued": (queued_ms(fwd, q, k, v, *extra),
                       float("nan") if fwd_only else queued_ms(fwdbwd, q, k, v, do, *extra))}

  run.gpu = gpu
  return run


def sampled_batch(dataset: str, context: int, max_shard: int = 8192):
  """The benchmark's batch of a length distribution: (document lengths, task table, T, S) of
  step 0 of the sampler (seed 1) filling `context` tokens, laid out by `doc_layout`."""
  from distca_jax.data.doclens import LengthSampler, load_lengths
  lens = LengthSampler(load_lengths(dataset), full_context_replacement=(dataset == "prolong"),
                       seed=1).sample(context, step=0)
  return (lens, *doc_layout(lens, max_shard))


def time_in_rounds(runs: dict, rounds: int, times: dict | None = None, stop=lambda: False):
  """Runs every timer of `runs` (name -> `timer`) `rounds` times in rotating order, appending
  (fwd ms, fwd+bwd ms) to `times[name]` (rounds already in `times` count: their first call
  compiled and warmed up); returns `times`. Clocks drift over a run: the first of several
  backends timed once each was up to 5% faster in the same process (H100)."""
  times = {n: [] for n in runs} if times is None else times
  for r in range(min((len(t) for t in times.values()), default=0), rounds if runs else 0):
    if stop():
      break
    names = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]
    for n in names:
      times[n].append(runs[n](warmup=1 if times[n] else 2))
  return times


def gpu_kernel_ms(fn, *args, calls=3) -> collections.Counter:
  """GPU time per call of each kernel (and copy) `fn(*args)` runs (`gpu_profile`)."""
  return gpu_profile(fn, *args, calls=calls)[0]


def gpu_profile(fn, *args, calls=3) -> tuple[collections.Counter, float]:
  """(GPU time per call of each kernel and copy `fn(*args)` runs, GPU span per call in ms) from
  a profiler trace of `calls` calls after one untraced call, each call ended by
  block_until_ready: what the device spent, without the host's dispatch and synchronisation
  that wall time per call also holds. The span runs from a call's first kernel start to its last
  kernel end (median over calls, found as the `calls` groups the trace's widest gaps part): span
  minus the summed time is the GPU idling inside a call. Empty and nan where no GPU ran (CPU)."""
  jax.block_until_ready(fn(*args))
  per_name = collections.Counter()
  spans = []
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
    path, = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
    for _, ev in gpu_events(path):
      per_name[ev["name"][:60]] += float(ev["dur"]) / 1e3 / calls
      spans.append((float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])))
  per_call = call_spans(spans, calls)
  return per_name, float(np.median(per_call)) / 1e3 if per_call else float("nan")


def call_spans(intervals, calls):
  """Span (first start to last end) of each of `calls` sequential calls whose GPU intervals
  (start, end) are given in any order, the calls told apart by the `calls - 1` widest idle gaps;
  [] when the intervals do not part into that many."""
  busy = intervals_union(intervals)  # overlapping kernels: no gap inside
  if len(busy) < calls:
    return []
  gaps = sorted(((busy[i + 1][0] - busy[i][1], i) for i in range(len(busy) - 1)), reverse=True)
  cuts = sorted(i for _, i in gaps[:calls - 1])
  return [float(busy[b][1] - busy[a][0]) for a, b in zip([0] + [i + 1 for i in cuts],
                                                         cuts + [len(busy) - 1])]


def queued_ms(fn, *args, calls=8, repeats=3):
  """Wall time per call with `calls` calls queued before one block_until_ready (median of
  `repeats`): a training step's view of a kernel, which pays no host synchronisation between
  its calls. Only the last call's outputs are kept (calls run in order on the device's stream,
  so waiting for it waits for all): keeping all `calls` outputs ran out of memory at 512K rows
  (H100)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) * 1e3 / calls)
  return float(np.median(times))


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


def fwd_fwdbwd_ms(attn, q, k, v, do, *extra, fwd_only=False):
  """(fwd ms, fwd+bwd ms) of `attn(q, k, v, *extra) -> O` (`timer`, run once)."""
  return timer(attn, q, k, v, do, *extra, fwd_only=fwd_only)()


def tile_waste(tasks, T, block_q, block_k):
  """Area of the (query tile, key block) pairs the kernels' block schedule visits over the real
  causal area (1.0: no tile reaches past a row's keys)."""
  from distca_jax.kernels.blocks import cdiv, query_schedule
  sch = query_schedule(kernels.TaskTable(*(jnp.asarray(a) for a in tasks)),
                       cdiv(T, block_q) * block_q, block_q, block_k)
  visited = float(np.clip(np.asarray(sch.kb_hi) - np.asarray(sch.kb_lo), 0, None).sum())
  return visited * block_q * block_k / float(kernels.causal_area(tasks).sum())


def tflops(f, fms, fbms):
  """(forward, backward, forward+backward) TF/s of a call with forward FLOPs `f` taking `fms` ms
  forward and `fbms` ms forward+backward: backward 2.5x the forward's FLOPs in fbms - fms, f+b
  3.5x (the DESIGN.md convention)."""
  return f / fms / 1e9, 2.5 * f / max(fbms - fms, 1e-6) / 1e9, 3.5 * f / fbms / 1e9


def fwd_flops(area):
  return 4.0 * D * H * area


def doc_layout(doc_lens, max_shard):
  """Documents cut into shards of at most `max_shard` tokens (128-multiples, the last one ragged);
  each shard a task over its document's prefix. Q rows and K/V rows in document order."""
  qs, ql, ks, kl = [], [], [], []
  off = 0
  for L in doc_lens:
    L = int(L)
    for a in range(0, L, max_shard):
      b = min(a + max_shard, L)
      qs.append(off + a), ql.append(b - a), ks.append(off), kl.append(b)
    off += L
  return kernels.make_task_table(qs, ql, ks, kl, num_q_rows=off, num_kv_rows=off), off, off


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


def inputs(T, S, seed=0):
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(k1, (T, H, D), jnp.bfloat16)
  k = jax.random.normal(k2, (S, K, D), jnp.bfloat16)
  v = jax.random.normal(k3, (S, K, D), jnp.bfloat16)
  do = jax.random.normal(k4, (T, H, D), jnp.bfloat16)
  return q, k, v, do


def time_backend(backend, tasks, T, S, attn=None, fwd_only=False):
  """(fwd ms, fwd+bwd ms) of one fused batch; `attn(q, k, v, tasks) -> (O, LSE)` overrides the
  backend (config tuning)."""
  return backend_timer(backend, tasks, T, S, attn, fwd_only)()


def backend_timer(backend, tasks, T, S, attn=None, fwd_only=False):
  """`time_backend` as a `timer`: compiled once, run as often as asked."""
  if attn is None and backend.startswith("cudnn/"):  # cuDNN forward, backward after the slash
    from distca_jax.kernels import cudnn
    attn = lambda q, k, v, t: cudnn.attention(q, k, v, t, backward=backend.split("/")[1])
  if attn is None and backend.startswith("mosaic:"):  # a variant: mosaic:KEY=VALUE[+KEY=VALUE]
    from distca_jax.kernels import mosaic
    opts = mosaic.parse_options(backend.partition(":")[2])
    attn = lambda q, k, v, t: mosaic.attention(q, k, v, t, config=opts)
  if attn is None:
    attn = lambda q, k, v, t: kernels.attention(q, k, v, t, backend=backend)
  q, k, v, do = inputs(T, S)
  tasks = kernels.TaskTable(*(jnp.asarray(a) for a in tasks))
  return timer(lambda q, k, v, t: attn(q, k, v, t)[0], q, k, v, do, tasks, fwd_only=fwd_only)


def tune_configs(backend, head_dim):
  """Tile/launch variants tried by --tune (name -> Config, or mosaic.Options) at `head_dim`;
  Triton gets short lists because its dK/dV kernel takes ~30 s to compile. At d = 128 the
  variants around the measured default; at 64 larger tiles (smaller accumulators); at 256 smaller
  ones (128 x 128 forward tiles and 64-row dK/dV accumulators at 4 warps do not fit)."""
  if backend == "mosaic":  # its own options (kernels/mosaic.py), one kernel, fast to compile
    from distca_jax.kernels.mosaic import Options
    o = Options()
    out = {"default": o, "memory_regs40": o._replace(memory_registers=40),
           "forward_triton": o._replace(forward="triton")}
    if head_dim <= 64:  # smaller tiles leave room for a third stage
      out["stages3"] = o._replace(stages=3)
    return out
  from distca_jax.kernels.pallas import gpu_config
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


def time_dense_cudnn(T):
  """cuDNN dense causal attention, one sequence of T tokens: (fwd ms, fwd+bwd ms)."""
  return dense_timer(T)()


def dense_timer(T):
  """`time_dense_cudnn` as a `timer`."""
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


def main():
  global H, K, D
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--backends", default="pallas,cudnn,triton",
                  help="comma list (also mosaic; mosaic:KEY=VALUE[+KEY=VALUE] a variant of its "
                       "Options); cudnn/<triton|mosaic|pallas|cudnn>: cuDNN forward, that backward")
  ap.add_argument("--contexts", default="65536,131072,262144,524288",
                  help="tokens a batch fills (the issue's 64K-512K; at 512K the mosaic backward's "
                       "float32 dQ buffer alone is 8 GiB)")
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
  args = ap.parse_args()
  if args.geometry:
    print("| batch | documents | rows | dense length | rows / dense | tile area 128x128 | "
          "64x128 | dense's 64x128 |\n|---|---|---|---|---|---|---|---|")
    for name, n, T, Td, r, wf, wb, wd in geometry(
        [d for d in args.datasets.split(",") if d],
        [int(c) for c in args.contexts.split(",") if c], args.max_shard):
      print(f"| {name} | {n} | {T:,} | {Td:,} | {r:.1f} | {wf:.3f} | {wb:.3f} | {wd:.3f} |")
    return
  H, K = (int(x) for x in args.heads.split(","))
  D = args.head_dim
  t_start = time.time()
  over = lambda: time.time() - t_start > args.budget_s
  device = jax.devices()[0].device_kind
  card = device.replace(" ", "_")
  print(f"device {device}, jax {jax.__version__}, H={H} K={K} d={D} bf16", flush=True)
  backends = [b for b in args.backends.split(",") if b]
  results = {"device": device, "jax": jax.__version__, "batches": [], "dense": {}}

  dense_cache, dense_ms = {}, {}  # T -> timer; T -> (fwd ms, fwd+bwd ms) last measured

  def dense(T):
    if T not in dense_cache:
      dense_cache[T] = dense_timer(T)
    return dense_cache[T]

  print(f"{'batch':24s} {'backend':8s} {'fwd TF/s':>9s} {'bwd TF/s':>9s} {'f+b TF/s':>9s} "
        f"{'dense f':>8s} {'dense f+b':>9s} {'ratio f+b':>9s}", flush=True)
  for ds in (d for d in args.datasets.split(",") if d):
    for ctx in (int(c) for c in args.contexts.split(",")):
      lens, tasks, T, S = sampled_batch(ds, ctx, args.max_shard)
      area = float(kernels.causal_area(tasks).sum())
      f = fwd_flops(area)
      Teq = dense_equivalent(area)
      f_eq = fwd_flops(Teq * (Teq + 1) / 2)
      name = f"{ds}-{ctx // 1024}K({len(lens)}docs)"
      dense_tasks = kernels.make_task_table([0], [Teq], [0], [Teq])
      print(f"{name:24s} tiles visit {tile_waste(tasks, T, 128, 128):.3f}x the causal area "
            f"(128 x 128 tiles; the dense baseline of T={Teq}: "
            f"{tile_waste(dense_tasks, Teq, 128, 128):.3f}x)", flush=True)
      for tb in (t for t in args.tune.split(",") if t):
        mod = __import__(f"distca_jax.kernels.{tb}", fromlist=["attention"])
        tried = []
        for cname, cfg in tune_configs(tb, D).items():
          if over():
            break
          try:
            fms, fbms = time_backend(tb, tasks, T, S, attn=lambda q, k, v, t, cfg=cfg, mod=mod:
                                     mod.attention(q, k, v, t, config=cfg))
            tf = tflops(f, fms, fbms)
            print(f"tune {tb:7s} {cname:22s} fwd {tf[0]:6.1f} TF/s  bwd {tf[1]:6.1f}  "
                  f"f+b {tf[2]:6.1f}", flush=True)
            results.setdefault("tune", []).append(dict(backend=tb, config=cname, batch=name,
                                                       fwd_ms=fms, fwdbwd_ms=fbms))
            tried.append((cfg, fms, fbms))
          except Exception as e:  # noqa: BLE001
            print(f"tune {tb} {cname}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        if tried and tb == "mosaic":  # reported only: its options are not shared tiles
          best = min(tried, key=lambda t: t[2] - t[1])[0]
          print(f"tune mosaic d={D}: fastest backward {best}", flush=True)
        elif tried:
          # The rest of the run (batches, sweep) uses the tuned tiles: GPU_CONFIGS is shared by
          # the pallas and triton backends (and the cudnn backend's triton/pallas backward).
          from distca_jax.kernels import pallas
          pallas.GPU_CONFIGS[D] = best = best_config(tried)
          print(f"tune {tb} d={D}: using {best}", flush=True)
          results.setdefault("tuned", {})[tb] = dict(best._asdict(), head_dim=D)
      args.tune = ""  # first batch only
      # Every backend and the dense baseline compiled once, then timed `--rounds` times in
      # rotating order (`time_in_rounds`); medians over rounds.
      runs, times = {}, {}
      for b in backends:
        if over():
          break
        try:
          runs[b] = backend_timer(b, tasks, T, S)
          times[b] = [runs[b]()]
        except Exception as e:  # noqa: BLE001
          print(f"{name:24s} {b:8s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
          runs.pop(b, None)
      try:
        runs["dense"] = dense(Teq)
        times["dense"] = [runs["dense"]()]
      except Exception as e:  # noqa: BLE001 (report and go on)
        print(f"dense cudnn T={Teq}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        runs.pop("dense", None)
      time_in_rounds(runs, args.rounds, times, stop=over)
      med = lambda n, i: float(np.median([t[i] for t in times[n]]))
      d_tf = (float("nan"), float("nan"))
      if "dense" in times:
        dense_ms[Teq] = med("dense", 0), med("dense", 1)
        d_tf = (f_eq / dense_ms[Teq][0] / 1e9, 3.5 * f_eq / dense_ms[Teq][1] / 1e9)
      gpu = {n: runs[n].gpu() for n in runs} if args.gpu_time else {}
      if gpu and not all(g["busy"][0] > 0 for g in gpu.values()):
        print(f"{name:24s} no GPU kernels in the profiler trace: no GPU times", flush=True)
        gpu = {}
      if gpu:
        print_views(name, gpu, {n: (f_eq if n == "dense" else f) for n in gpu},
                    {n: (med(n, 0), med(n, 1)) for n in gpu})
      for b in (b for b in backends if b in times):
        fms, fbms = med(b, 0), med(b, 1)
        tf = tflops(f, fms, fbms)
        spread = [tflops(f, *t)[2] for t in times[b]]
        print(f"{name:24s} {b:8s} {tf[0]:9.1f} {tf[1]:9.1f} {tf[2]:9.1f} {d_tf[0]:8.1f} "
              f"{d_tf[1]:9.1f} {tf[2] / d_tf[1]:9.2f}"
              + (f"  (f+b over {len(spread)} rounds {min(spread):.1f}-{max(spread):.1f})"
                 if len(spread) > 1 else ""), flush=True)
        row = dict(
            dataset=ds, context=ctx, docs=len(lens), tasks=int((np.asarray(tasks.q_len) > 0).sum()),
            area=area, backend=b, fwd_ms=fms, fwdbwd_ms=fbms, fwd_tflops=tf[0], bwd_tflops=tf[1],
            fwdbwd_tflops=tf[2], dense_T=Teq, dense_fwd_tflops=d_tf[0],
            dense_fwdbwd_tflops=d_tf[1], rounds=len(times[b]))
        if b in gpu:
          row.update({f"{view}_{part}_ms": gpu[b][view][i] for view in gpu[b]
                      for i, part in enumerate(("fwd", "fwdbwd"))})
          if "dense" in gpu:
            row.update({f"dense_{view}_{part}_ms": gpu["dense"][view][i] for view in gpu["dense"]
                        for i, part in enumerate(("fwd", "fwdbwd"))})
        results["batches"].append(row)
      with open(os.path.join(args.out, "bench_kernels.json"), "w") as fh:
        json.dump(results, fh, indent=1)

  try:
    dfwd, dfb = dense_ms[16384] = dense(16384)()
    f16 = fwd_flops(16384 * 16385 / 2)
    print(f"cuDNN dense causal T=16384: fwd {f16 / dfwd / 1e9:.1f} TF/s, "
          f"f+b {3.5 * f16 / dfb / 1e9:.1f} TF/s", flush=True)
  except Exception as e:  # noqa: BLE001
    print(f"dense cudnn T=16384: {type(e).__name__}: {str(e)[:200]}", flush=True)
  if args.table_backend == "auto":
    score = {}
    for r in results["batches"]:
      score.setdefault(r["backend"], []).append(r["fwdbwd_tflops"])
    args.table_backend = (max(score, key=lambda b: np.mean(score[b])) if score else
                          backends[0] if backends else None)
  # No backend (`--backends ""`: the dense baseline alone, e.g. under a profiler): no table.
  sweep = [int(x) for x in args.sweep.split(",") if x] if args.table_backend else []
  table = {"device": device, "dtype": "bfloat16", "heads": H, "kv_heads": K, "head_dim": D,
           "backend": args.table_backend, "layout": args.sweep_layout, "q": sweep, "kv": sweep,
           "fwd_ms": [[None] * len(sweep) for _ in sweep],
           "fwdbwd_ms": [[None] * len(sweep) for _ in sweep]}
  if sweep:
    print(f"\nsweep ({args.table_backend}); per-task ms and TF/s f / f+b", flush=True)
  for i, q in enumerate(sweep):
    for j, kv in enumerate(sweep):
      if q > kv or over():
        continue
      tasks, T, S, n = sweep_layout(q, kv, target_area=args.sweep_area,
                                    own_kv=args.sweep_layout == "own")
      try:
        fms, fbms = time_backend(args.table_backend, tasks, T, S)
      except Exception as e:  # noqa: BLE001
        print(f"q={q} kv={kv}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        continue
      f = fwd_flops(float(kernels.causal_area(tasks).sum()))
      table["fwd_ms"][i][j], table["fwdbwd_ms"][i][j] = fms / n, fbms / n
      print(f"q={q:6d} kv={kv:6d} n={n:4d}  fwd {fms / n:9.4f} ms {f / fms / 1e9:6.1f}  "
            f"f+b {fbms / n:9.4f} ms {3.5 * f / fbms / 1e9:6.1f}", flush=True)
      with open(os.path.join(args.out, f"{card}.json"), "w") as fh:
        json.dump(table, fh, indent=1)
  results["dense"] = {str(t): dict(fwd_ms=a, fwdbwd_ms=b) for t, (a, b) in dense_ms.items()}
  with open(os.path.join(args.out, "bench_kernels.json"), "w") as fh:
    json.dump(results, fh, indent=1)
  print(f"done in {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
  main()
