"""Helpers the benchmarks share: wall time per call, timers of an attention function's forward
and forward+backward, rounds in rotating order, GPU time from a profiler trace, TF/s, and the
kernel benchmarks' batches (documents of a length distribution laid out as a task table).

FLOPs of attention follow one convention: forward 4·D·H·area, backward 2.5x the forward, where
the area is the causal (query, key) pairs, Σ per task q·kv − q(q−1)/2 (docs/METHOD.md).
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from distca_jax import kernels
from distca_jax.data.doclens import LengthSampler, load_lengths
from distca_jax.perfetto import gpu_events, intervals_union


def median_ms(fn, *args, warmup=2, iters=7) -> float:
  """Median wall time in ms of `fn(*args)` over `iters` calls after `warmup` (each call ended by
  block_until_ready)."""
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


def time_in_rounds(runs: dict, rounds: int, times: dict | None = None, stop=lambda: False):
  """Runs every timer of `runs` (name -> `timer`) `rounds` times in rotating order, appending
  (fwd ms, fwd+bwd ms) to `times[name]` (rounds already in `times` count: their first call
  compiled and warmed up); returns `times`. Clocks drift over a run: the first of several
  timers run once each can be a few percent faster than the last."""
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
  so waiting for it waits for all): keeping all `calls` outputs can run out of device memory at
  long shapes."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) * 1e3 / calls)
  return float(np.median(times))


def tflops(f, fms, fbms):
  """(forward, backward, forward+backward) TF/s of a call with forward FLOPs `f` taking `fms` ms
  forward and `fbms` ms forward+backward: backward 2.5x the forward's FLOPs in fbms - fms, f+b
  3.5x."""
  return f / fms / 1e9, 2.5 * f / max(fbms - fms, 1e-6) / 1e9, 3.5 * f / fbms / 1e9


def attention_flops(area: float, heads: int, head_dim: int) -> float:
  """Forward FLOPs of causal attention over `area` (query, key) pairs."""
  return 4.0 * head_dim * heads * area


def attention_inputs(T: int, S: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
  """Random bf16 q [T, H, D], k, v [S, K, D] and dO [T, H, D]."""
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(k1, (T, heads, head_dim), jnp.bfloat16)
  k = jax.random.normal(k2, (S, kv_heads, head_dim), jnp.bfloat16)
  v = jax.random.normal(k3, (S, kv_heads, head_dim), jnp.bfloat16)
  do = jax.random.normal(k4, (T, heads, head_dim), jnp.bfloat16)
  return q, k, v, do


def sampled_batch(dataset: str, context: int, max_shard: int = 8192):
  """The benchmark's batch of a length distribution: (document lengths, task table, T, S) of
  step 0 of the sampler (seed 1) filling `context` tokens, laid out by `doc_layout`."""
  lens = LengthSampler(load_lengths(dataset), full_context_replacement=(dataset == "prolong"),
                       seed=1).sample(context, step=0)
  return (lens, *doc_layout(lens, max_shard))


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
