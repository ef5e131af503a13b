"""Step-time benchmark of whole training steps: colocated vs distca on chosen batches, one table.

    python launch/bench_train.py --suite mfu        # 1 device: model tokens/s and MFU, colocated,
                                                    # remat=full beside remat=auto (--remat)
    python launch/bench_train.py --suite cad        # all devices: colocated vs distca (ping-pong
                                                    # on/off) vs the WLB-LLM-style baseline
                                                    # (--wlb-cp) on sampled, skewed and uniform
                                                    # batches, with per-device loads
    python launch/bench_train.py --suite overhead --batches pretrain prolong uniform
                                                    # 1 device: colocated vs CAD with nothing
                                                    # to move (ping-pong and single-stream),
                                                    # each step part's GPU time side by side
    python launch/bench_train.py --suite pp --batches skewed pretrain
                                                    # every device a pipeline stage: colocated vs
                                                    # distca attention in the lock-step pipeline

Each variant: build the trainer, place a fixed batch, run `--warmup` steps (compilation), then
time `--steps` steps (each synchronised) and report the median. Every ratio in the table is
against the colocated run of the same batch in the same process. Overrides (`key=value`, the
train.py schema) apply to every variant, e.g. `model.layers=4 data.tokens_per_device=65536`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time


def _batches(kind: str, num_buffers: int, T: int, config, vocab: int):
  import numpy as np

  from distca_jax.data.sources import make_batch, synthetic_from_config

  rng = np.random.default_rng(0)
  kind, _, step = kind.partition("@")  # "prolong@2": the sampler's batch of step 2
  if kind in ("pretrain", "prolong"):
    import dataclasses

    data = dataclasses.replace(config.data, distribution=kind)
    return synthetic_from_config(data, vocab, num_buffers).batch(int(step or 0))
  if step:
    raise ValueError(f"{kind}@{step}: only sampled batches (pretrain, prolong) take a step")
  if kind == "skewed":  # device 0: one long document; the others: many short ones
    short = min(2048, T // 4)  # below 8K tokens (CPU tests): four short documents per device
    lens = np.concatenate([[T], np.full((num_buffers - 1) * T // short, short)])
  elif kind == "uniform":  # nothing to balance: equal documents everywhere
    lens = np.full(num_buffers * T // 8192, 8192)
  else:
    raise ValueError(kind)
  return make_batch(lens, rng.integers(0, vocab, int(lens.sum())).astype(np.int32), num_buffers, T)


def _microbatches(kind: str, M: int, T: int, config, vocab: int):
  """M micro-batches of one buffer each (one data rank) for the pipeline suite. `skewed`: even
  micro-batches hold one document of T tokens, odd ones documents of 2048 (in every steady tick
  one stage has the long document, the other the short ones)."""
  import dataclasses

  import numpy as np

  from distca_jax.data.sources import make_batch, synthetic_from_config

  if kind in ("pretrain", "prolong"):
    source = synthetic_from_config(dataclasses.replace(config.data, distribution=kind), vocab, 1)
    return [source.batch(i) for i in range(M)]
  if kind != "skewed":
    raise ValueError(f"pipeline suite: unknown batch {kind!r}")
  rng = np.random.default_rng(0)
  out = []
  for i in range(M):
    lens = np.array([T]) if i % 2 == 0 else np.full(T // 2048, 2048)
    out.append(make_batch(lens, rng.integers(0, vocab, int(lens.sum())).astype(np.int32), 1, T))
  return out


def _time_variant(config, batch, warmup: int, steps: int, trace_dir: str | None = None,
                  compile_only: bool = False, top_ops: int = 15):
  """`batch`: a Batch, or (pipeline) a list of micro-batches."""
  import jax
  import numpy as np

  from distca_jax import attention as attention_lib
  from distca_jax import mesh as mesh_lib
  from distca_jax.train import pipeline_host
  from distca_jax.train.step import Trainer

  mesh = mesh_lib.make_mesh(config.mesh)
  trainer = Trainer(config, mesh)
  # Compile-only works on shapes: its devices may be a mocked cluster that cannot run anything.
  state = trainer.abstract_state() if compile_only else trainer.init_state(0)
  t0 = time.perf_counter()
  if isinstance(batch, list):
    ctx = pipeline_host.host_context(trainer.config.attention, batch, mesh.shape["pipe"], trainer.shape)
    batch = ctx.as_batch()
  elif config.data.packing == "wlb":  # the WLB-LLM baseline: the batch's documents re-packed
    from distca_jax import wlb_attention

    batch, ctx, _ = wlb_attention.host_item(trainer.config, batch, trainer.shape,
                                            mesh.shape["tensor"])
  else:
    ctx = attention_lib.host_context(trainer.config.attention, batch, trainer.shape)
  host_ms = (time.perf_counter() - t0) * 1e3
  if compile_only:
    arrays, dctx = trainer.abstract_batch(batch, ctx)
    t0 = time.perf_counter()
    mem = trainer.lower(state, arrays, dctx).compile().memory_analysis()
    return {"median_s": float("nan"), "host_ms": host_ms, "compile_s": time.perf_counter() - t0,
            "peak_gib": [0.0], "imbalance": (float("nan"), float("nan")), "loss": float("nan"),
            "compiles": 1, "temp_gib": mem.temp_size_in_bytes / 2**30,
            "args_gib": mem.argument_size_in_bytes / 2**30}
  arrays, dctx = trainer.put_batch(batch, ctx)
  t0 = time.perf_counter()
  for _ in range(warmup):
    state, m = trainer.step(state, arrays, dctx)
    jax.block_until_ready(m)
  compile_s = time.perf_counter() - t0
  times = []
  for i in range(steps):
    if trace_dir and i == steps - 1:
      jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    t0 = time.perf_counter()
    state, m = trainer.step(state, arrays, dctx)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
    if trace_dir and i == steps - 1:
      jax.profiler.stop_trace()
  peak = []
  for d in mesh.devices.flat:
    stats = d.memory_stats() or {}
    peak.append(stats.get("peak_bytes_in_use", 0) / 2**30)
  # XLA's own accounting of the compiled step (per device): its temporaries, and the
  # arguments (parameters, optimizer state, batch) — the memory each variant needs, independent
  # of the allocator's running peak across variants of one process.
  compiled = trainer.compile(state, arrays, dctx)
  analysis = compiled.memory_analysis()
  temp_gib = getattr(analysis, "temp_size_in_bytes", 0) / 2**30
  args_gib = getattr(analysis, "argument_size_in_bytes", 0) / 2**30
  mem = {}
  if trace_dir:
    from distca_jax.train import profile as profile_lib

    xplane = profile_lib.find_xplane(trace_dir)
    if xplane is not None:
      phases = profile_lib.phase_breakdown(xplane, compiled.as_text(), top_ops=top_ops)
      if mesh.size == 1:  # one device: the step's parts (LM head, norms, optimizer, ...)
        mem["parts_ms"] = profile_lib.step_parts(xplane, compiled.as_text())["ms_per_step"]
      mem["phases_ms"] = phases["ms_per_step"]
      mem["per_device_ms"] = phases["per_device_ms"]
      mem["top_ops_ms"] = phases["top_ops_ms"]
  imb = ctx.imbalance() if hasattr(ctx, "imbalance") else None
  if hasattr(ctx, "loads"):  # the WLB baseline: attention area and tokens per device
    mem["loads"] = [x.tolist() for x in ctx.loads()]
  if ctx.cad and hasattr(ctx, "batches"):
    # The streams the step ran (one where two unequal halves were predicted slower).
    mem.update(streams=len(ctx.batches))
  mem["remat_info"] = {"policy": trainer.remat, "reason": trainer.remat_reason,
                       "candidates": trainer.remat_candidates}
  loss = float(m["loss"])
  del state
  return {"median_s": float(np.median(times)), "host_ms": host_ms, "compile_s": compile_s,
          "peak_gib": peak, "imbalance": imb, "loss": loss, "compiles": trainer.compile_count(),
          "temp_gib": temp_gib, "args_gib": args_gib, **mem}


def _predicted_saving(config, batch, shape, cache: dict) -> float:
  """What the gate predicts CAD saves on this batch (`gate.predicted_cad_saving`), planned as
  the distca variants plan it, gate off. `cache` (one per batch) keeps one prediction per
  planning configuration: variants that differ only in what planning ignores share it."""
  import dataclasses

  from distca_jax import dispatch
  from distca_jax.schedule.transport import TILED

  a = dataclasses.replace(config.attention, impl="distca", gate=False, min_imbalance=1.0,
                          kernel="auto", exchange=TILED.name)
  if a not in cache:
    cache[a] = dispatch.plan_step(a, batch, shape).predicted_saving
  return cache[a]


def _mfu_suite(args) -> list[dict]:
  """One device, colocated: each model row (the overrides' model at every `--tokens`, and with
  `--mfu-8b-layers N` the Llama-3-8B shape with N layers at the largest) timed under every
  policy of `--remat`; ratios are against the first policy's step of the same row."""
  import jax

  from distca_jax.config import load_config
  from distca_jax.models.presets import resolve
  from distca_jax.train import metrics as metrics_lib

  tokens = args.tokens or [32768, 65536]
  models = [("", T) for T in tokens]
  if args.mfu_8b_layers:
    models.append((f"model.preset=llama3_8b model.layers={args.mfu_8b_layers}", max(tokens)))
  rows = []
  for model, T in models:
    if args.loss_ablation:
      base = load_config(args.config, ["mesh.data=1"] + args.overrides + model.split())
      rows.extend(_loss_ablation(resolve(base.model), T))
    base_time = None
    for remat in args.remat:
      config = load_config(args.config, ["mesh.data=1", f"data.tokens_per_device={T}"]
                           + args.overrides + model.split() + [f"model.remat={remat}"])
      shape = resolve(config.model)
      label = f"{config.model.preset}" + (f" L{shape.layers}" if model else "")
      batch = _batches("pretrain", 1, T, config, shape.vocab_size)
      trace = f"{args.trace_dir}/{label.replace(' ', '_')}-{T}-{remat}" if args.trace_dir else None
      try:
        r = _time_variant(config, batch, args.warmup, args.steps, trace)
      except Exception as e:  # noqa: BLE001 (a policy that does not fit is reported; the run goes on)
        print(f"{label} T={T} remat={remat}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        jax.clear_caches()
        gc.collect()
        continue
      flops = metrics_lib.step_flops(shape, batch.layout)
      peak = metrics_lib.peak_flops_per_device(jax.devices()[0].device_kind, config.train.peak_tflops)
      base_time = base_time or r["median_s"]
      info = r.pop("remat_info")
      r.update(model=label, tokens=T, remat=remat, policy=info["policy"],
               tokens_per_s=T / r["median_s"], speedup=base_time / r["median_s"],
               mfu=flops / r["median_s"] / peak if peak else None, kernel=config.attention.kernel)
      r["remat_reason"] = {"why": info["reason"], "candidates": info["candidates"]}
      rows.append(r)
      print(f"{label} T={T} remat={remat} ({info['policy']}): {r['median_s']*1e3:.1f} ms/step, "
            f"{r['tokens_per_s']:,.0f} tok/s, MFU {r['mfu'] * 100 if r['mfu'] else float('nan'):.1f}%, "
            f"x{r['speedup']:.3f}, temp {r['temp_gib']:.1f} + args {r['args_gib']:.1f} GiB, "
            f"compile {r['compile_s']:.1f}s", flush=True)
      if remat == "auto":
        print(f"  {info['reason']}", flush=True)
      if "parts_ms" in r:
        busy = sum(r["parts_ms"].values())
        print(f"  busy {busy:.0f} ms of {r['median_s'] * 1e3:.0f} ms (gaps "
              f"{r['median_s'] * 1e3 - busy:.0f}): "
              + "  ".join(f"{k} {v:.0f}" for k, v in r["parts_ms"].items() if v >= 0.5), flush=True)
        for op, ms in r.pop("top_ops_ms", {}).items():
          print(f"    {ms:8.1f} ms  {op}")
      jax.clear_caches()
      gc.collect()
  print("\n| model | tokens | remat | policy | step ms | tokens/s | MFU | vs first | XLA temp + args GiB | compile s |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    if "remat" not in r:
      continue
    print(f"| {r['model']} | {r['tokens']} | {r['remat']} | {r['policy']} | {r['median_s'] * 1e3:.1f} | "
          f"{r['tokens_per_s']:,.0f} | {r['mfu'] * 100 if r['mfu'] else float('nan'):.1f}% | "
          f"{r['speedup']:.3f} | {r['temp_gib']:.1f} + {r['args_gib']:.1f} | {r['compile_s']:.0f} |")
  return rows


# The overhead suite's variants: colocated, and CAD run on every step (gate off) with ping-pong and
# single-stream. On one device CAD moves nothing, so what it costs over colocated is its machinery.
OVERHEAD_VARIANTS = (
    ("colocated", ["attention.impl=colocated"]),
    ("cad", ["attention.impl=distca", "attention.gate=false", "attention.pingpong=true"]),
    ("cad-single", ["attention.impl=distca", "attention.gate=false", "attention.pingpong=false"]),
)


def _overhead_suite(args) -> list[dict]:
  """One device: each batch at each `--tokens`, colocated against CAD (gate off, ping-pong and
  single-stream), every variant traced; prints the step ratio and each step part's GPU time side
  by side (`profile.step_parts`), the idle gap (step time less busy time), and the op groups
  whose time differs most from colocated's."""
  import jax

  from distca_jax.config import load_config
  from distca_jax.models.presets import resolve
  from distca_jax.train import profile as profile_lib

  if len(jax.devices()) != 1:
    raise SystemExit("--suite overhead runs on one device (CUDA_VISIBLE_DEVICES=0)")
  trace_root = args.trace_dir or "/tmp/distca_overhead_trace"
  rows = []
  for T in args.tokens or [65536]:
    for kind in args.batches:
      base = load_config(args.config, ["mesh.data=1", f"data.tokens_per_device={T}"] + args.overrides)
      batch = _batches(kind, 1, T, base, resolve(base.model).vocab_size)
      got = {}
      for name, ov in OVERHEAD_VARIANTS:
        config = load_config(args.config, ["mesh.data=1", f"data.tokens_per_device={T}"]
                             + args.overrides + ov)
        r = _time_variant(config, batch, args.warmup, args.steps, f"{trace_root}/{kind}-{T}-{name}",
                          top_ops=40)
        r.update(batch=kind, tokens=T, variant=name)
        got[name] = r
        rows.append(r)
        jax.clear_caches()
        gc.collect()
      base_s = got["colocated"]["median_s"]
      for r in got.values():
        r["speedup"] = base_s / r["median_s"]
      _print_overhead(kind, T, got)
  print("\n| batch | tokens | variant | step ms | vs colocated | busy ms | idle ms | loss |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    busy = sum(r.get("parts_ms", {}).values())
    print(f"| {r['batch']} | {r['tokens']} | {r['variant']} | {r['median_s'] * 1e3:.1f} | "
          f"{r['speedup']:.4f} | {busy:.1f} | {r['median_s'] * 1e3 - busy:.1f} | {r['loss']:.4f} |")
  return rows


def _print_overhead(kind: str, T: int, got: dict) -> None:
  """One batch's step parts (ms) side by side, then the op groups that differ most."""
  names = list(got)
  print(f"\n{kind} T={T}: step ms " + "  ".join(
      f"{n} {got[n]['median_s'] * 1e3:.1f} (x{got['colocated']['median_s'] / got[n]['median_s']:.4f})"
      for n in names), flush=True)
  parts = {n: dict(got[n].get("parts_ms", {})) for n in names}
  for n in names:
    parts[n]["idle"] = got[n]["median_s"] * 1e3 - sum(got[n].get("parts_ms", {}).values())
  keys = list(dict.fromkeys(k for n in names for k in parts[n]))
  print("| part | " + " | ".join(names) + " | " + " | ".join(f"{n} - colocated" for n in names[1:]) + " |")
  print("|---" * (2 * len(names)) + "|")
  for k in keys:
    v = [parts[n].get(k, 0.0) for n in names]
    print(f"| {k} | " + " | ".join(f"{x:.2f}" for x in v) + " | "
          + " | ".join(f"{x - v[0]:+.2f}" for x in v[1:]) + " |")
  ops = {n: got[n].get("top_ops_ms", {}) for n in names}
  groups = set().union(*ops.values())
  diff = sorted(groups, key=lambda g: -abs(ops[names[1]].get(g, 0.0) - ops["colocated"].get(g, 0.0)))
  print("op groups that differ most, ms: " + " / ".join(names))
  for g in diff[:12]:
    print(f"  {g}: " + " / ".join(f"{ops[n].get(g, 0.0):.2f}" for n in names))
  sys.stdout.flush()


def _loss_ablation(shape, T: int, reps: int = 5) -> list[dict]:
  """The LM head and loss alone (value and gradients of `chunked_cross_entropy` at the model's
  width and vocabulary, bf16 hidden states, fp32 head): gradient fused into the forward vs
  recomputed logits in the backward, median of `reps` synchronised calls each."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from distca_jax.train.loss import chunked_cross_entropy

  k = jax.random.split(jax.random.key(0), 3)
  h = jax.random.normal(k[0], (1, T, shape.hidden), jnp.bfloat16)
  w = jax.random.normal(k[1], (shape.hidden, shape.vocab_size), jnp.float32) * shape.hidden ** -0.5
  t = jax.random.randint(k[2], (1, T), 0, shape.vocab_size)
  m = jnp.ones((1, T), jnp.float32)
  out = []
  for fused in (False, True):
    f = jax.jit(jax.value_and_grad(
        lambda h, w: chunked_cross_entropy(h, w, t, m, scale=1.0 / T, fuse_grad=fused), argnums=(0, 1)))
    jax.block_until_ready(f(h, w))
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      jax.block_until_ready(f(h, w))
      times.append(time.perf_counter() - t0)
    out.append({"loss_fused": fused, "tokens": T, "median_s": float(np.median(times))})
  print(f"LM head + loss alone, D={shape.hidden} V={shape.vocab_size} T={T}: recompute "
        f"{out[0]['median_s'] * 1e3:.1f} ms, fused {out[1]['median_s'] * 1e3:.1f} ms "
        f"(x{out[0]['median_s'] / out[1]['median_s']:.3f})", flush=True)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--suite", choices=["mfu", "cad", "pp", "overhead"], required=True)
  parser.add_argument("--microbatches", type=int, default=4, help="pp: micro-batches per step")
  parser.add_argument("--compile-only", action="store_true",
                      help="compile each variant and report XLA's memory analysis, no steps")
  parser.add_argument("--gpu-mock", type=int, default=0, metavar="N",
                      help="with --compile-only: compile for a mocked cluster of N GPUs (one host "
                           "each) on this machine's one GPU, XLA's GPU memory analysis per device")
  parser.add_argument("--config", default=None)
  parser.add_argument("--batches", nargs="+", default=["pretrain", "prolong", "skewed", "uniform"])
  parser.add_argument("--tokens", nargs="+", type=int, default=None,
                      help="mfu, overhead: tokens per device")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--pingpong-ablation", default="pretrain",
                      help="batch on which distca also runs with ping-pong off ('' for none); this "
                           "and the other ablations run CAD on every batch (attention.gate=false)")
  parser.add_argument("--resend-ablation", default="",
                      help="batch on which distca also runs with attention.memory_mode=resend")
  parser.add_argument("--ragged-ablation", default="",
                      help="batch on which distca also runs with attention.exchange=ragged (GPU)")
  parser.add_argument("--ungated-ablation", default="",
                      help="batches (space-separated) on which distca also runs with "
                           "attention.gate=false (moving work however balanced the batch)")
  parser.add_argument("--wlb-cp", default="auto",
                      help="cad: also run the WLB-LLM-style baseline (data.packing=wlb) with this "
                           "CP group size (an integer or auto; '' for none)")
  parser.add_argument("--trace-dir", default=None,
                      help="xprof trace of the last step, with its busy time per phase and device "
                           "(DIR/<batch>-<variant>); cad: the first batch's colocated and distca "
                           "variants, pp: every variant")
  parser.add_argument("--remat", nargs="+", default=["full", "auto"],
                      help="mfu: model.remat policies timed on every row (the first is the baseline)")
  parser.add_argument("--mfu-8b-layers", type=int, default=0,
                      help="mfu: also the Llama-3-8B shape with this many layers at the largest --tokens")
  parser.add_argument("--loss-ablation", action="store_true",
                      help="mfu: time the LM head and loss alone per row, fused vs recomputed gradient")
  parser.add_argument("--json", default=None, help="write all results here")
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args(argv)

  from distca_jax.launch_env import configure_xla

  traced = args.trace_dir or args.suite == "overhead"
  if traced and "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    # Kernels inside CUDA graphs are not attributed to their ops (see launch/profile_steps.py).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

  if args.gpu_mock:
    if not args.compile_only:
      parser.error("--gpu-mock needs --compile-only: a mocked cluster compiles but cannot run")
    # Each mocked host would otherwise wait for the others' autotuning results forever.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_shard_autotuning=false").strip()
  configure_xla(cpu_devices=int(os.environ.get("DISTCA_CPU_DEVICES", "8")))
  import jax

  if args.gpu_mock:
    jax.config.update("jax_mock_gpu_topology", f"1x{args.gpu_mock}x1")

  # A persistent compilation cache of this run only: the memory analysis of each variant compiles
  # its step again ahead of time, and reads the executable its first step wrote instead of paying
  # a second full compile. Fresh per run, so every reported compile time is a real compile.
  if not jax.config.jax_compilation_cache_dir:
    import atexit
    import shutil
    import tempfile

    cache = tempfile.mkdtemp(prefix="distca_bench_jcc_")
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

  from distca_jax import gate
  from distca_jax.config import load_config
  from distca_jax.models.presets import resolve
  from distca_jax.train import metrics as metrics_lib

  rows = []
  if args.suite == "mfu":
    rows = _mfu_suite(args)
  elif args.suite == "overhead":
    rows = _overhead_suite(args)
  elif args.suite == "pp":
    from distca_jax.train import pipeline_host

    # Every device is a pipeline stage (data = 1); colocated vs CAD attention in the pipeline,
    # CAD with ping-pong per tick (Ping's exchange beside Pong's compute) and as one stream.
    n = len(jax.devices())
    pp = [f"mesh.pipe={n}", "mesh.data=1", f"train.microbatches={args.microbatches}"]
    variants = [("colocated", ["attention.impl=colocated"]),
                ("distca", ["attention.impl=distca", "attention.pingpong=true"]),
                ("distca-single", ["attention.impl=distca", "attention.pingpong=false"])]
    for kind in args.batches:
      base = load_config(args.config, args.overrides + pp)
      shape = resolve(base.model)
      mbs = _microbatches(kind, args.microbatches, base.data.tokens_per_device, base, shape.vocab_size)
      base_time = None
      for name, variant in variants:
        config = load_config(args.config, args.overrides + pp + variant)
        trace = f"{args.trace_dir}/{kind}-{name}" if args.trace_dir else None
        r = _time_variant(config, mbs, args.warmup, args.steps, trace, compile_only=args.compile_only)
        if name == "colocated":
          base_time = r["median_s"]
        bubble = pipeline_host.Schedule(n, args.microbatches).bubble_fraction
        r.update(batch=kind, variant=f"pp{n}-{name}", speedup=base_time / r["median_s"], bubble=bubble)
        rows.append(r)
        print(f"{kind:9s} pp{n}-{name:13s} {r['median_s']*1e3:9.1f} ms  x{r['speedup']:.3f}  "
              f"imbalance {r['imbalance'][0]:.2f}->{r['imbalance'][1]:.2f}  bubble {bubble:.2f}  "
              f"peak {max(r['peak_gib']):.1f} GiB  temp {r['temp_gib']:.1f} GiB  compile {r['compile_s']:.0f}s",
              flush=True)
        if "phases_ms" in r:
          print("          busy ms (mean over devices): " + "  ".join(f"{k} {v:.0f}" for k, v in r["phases_ms"].items()))
          for op, ms in r.pop("top_ops_ms").items():
            print(f"            {ms:8.1f} ms  {op}")
          sys.stdout.flush()
  else:
    n = len(jax.devices())
    for kind in args.batches:
      base = load_config(args.config, args.overrides)
      T = base.data.tokens_per_device
      shape = resolve(base.model)
      batch = _batches(kind, n, T, base, shape.vocab_size)
      variants = [("colocated", ["attention.impl=colocated"]),
                  ("distca", ["attention.impl=distca", "attention.pingpong=true"])]
      if args.wlb_cp:  # the WLB-LLM-style baseline (schedule/wlb.py), colocated attention
        variants.append(("wlb", ["attention.impl=colocated", "data.packing=wlb",
                                 f"data.wlb_cp={args.wlb_cp}"]))
      # The ablations vary CAD's own mechanisms, so they run CAD on the batch however balanced it
      # is (gate off); `distca-ungated` is the ping-pong, keep, tiled CAD they compare with.
      cad = ["attention.impl=distca", "attention.gate=false", "attention.min_imbalance=1.0"]
      if kind in args.ungated_ablation.split():
        variants.append(("distca-ungated", cad + ["attention.pingpong=true"]))
      if kind == args.pingpong_ablation:
        variants.append(("distca-single", cad + ["attention.pingpong=false"]))
      if kind == args.resend_ablation:  # the other memory mode: servers keep only O and LSE
        variants.append(("distca-resend", cad + ["attention.pingpong=true",
                                                 "attention.memory_mode=resend"]))
      if kind == args.ragged_ablation:  # only the rows that move travel
        variants.append(("distca-ragged", cad + ["attention.pingpong=true",
                                                 "attention.exchange=ragged"]))
      base_time, saving_cache = None, {}
      for name, ov in variants:
        config = load_config(args.config, args.overrides + ov)
        # The gate's attention cost of the kernel the variant runs, as the trainer resolves it.
        config, _ = metrics_lib.with_kernel_gate_cost(config, shape)
        traced = args.trace_dir and name in ("colocated", "distca") and kind == args.batches[0]
        trace = f"{args.trace_dir}/{kind}-{name}" if traced else None
        try:
          r = _time_variant(config, batch, args.warmup, args.steps, trace,
                            compile_only=args.compile_only)
        except Exception as e:  # noqa: BLE001 (an ablation that fails is reported; the run goes on)
          if name == "colocated":
            raise
          print(f"{kind:9s} {name:14s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
          # Let go of what the failed variant held (its executable and buffers) before the next.
          jax.clear_caches()
          gc.collect()
          continue
        if name == "colocated":
          base_time = r["median_s"]
        # Whether the variant's step ran CAD (the gate may run a distca variant colocated); a
        # compile-only report ran no step.
        r["cad_ran"] = None if args.compile_only else (name not in ("colocated", "wlb")
                                                       and r["imbalance"] is not None)
        if r["imbalance"] is None:  # colocated, or distca stopped by the gate (attention.gate)
          load = metrics_lib.attention_load_per_device(batch.layout)
          r["imbalance"] = (metrics_lib.imbalance(load), metrics_lib.imbalance(load))
          if name != "colocated":
            print(f"{kind:9s} {name:14s} ran colocated attention (predicted saving below "
                  f"attention.min_gain)", flush=True)
        r.update(batch=kind, variant=name, speedup=base_time / r["median_s"],
                 predicted_gain=gate.predicted_cad_gain(shape, batch.layout,
                                                        attention_config=config.attention),
                 predicted_saving=_predicted_saving(config, batch, shape, saving_cache))
        rows.append(r)
        if args.compile_only:  # a memory report: no steps ran
          print(f"{kind:9s} {name:14s} compiled  host {r['host_ms']:.0f} ms  temp {r['temp_gib']:.1f} GiB  "
                f"args {r['args_gib']:.1f} GiB  compile {r['compile_s']:.0f}s", flush=True)
          continue
        print(f"{kind:9s} {name:14s} {r['median_s']*1e3:9.1f} ms  x{r['speedup']:.3f}  "
              f"imbalance {r['imbalance'][0]:.2f}->{r['imbalance'][1]:.2f}  predicted saving "
              f"{r['predicted_saving']:+.3f}  host {r['host_ms']:.0f} ms  "
              f"peak {max(r['peak_gib']):.1f} GiB  temp {r['temp_gib']:.1f} GiB  compile {r['compile_s']:.0f}s",
              flush=True)
        if "loads" in r:  # per device: attention area / mean, tokens / tokens_per_device
          import numpy as np

          area, tok = (np.asarray(x) for x in r.pop("loads"))
          r["token_imbalance"] = float(tok.max() / tok.mean())
          print(f"          loads: attention " + " ".join(f"{x:.2f}" for x in area / area.mean())
                + "  tokens " + " ".join(f"{x:.2f}" for x in tok / T), flush=True)
        if "per_device_ms" in r:  # traced: busy ms of the step per device and phase
          for dev, ph in r["per_device_ms"].items():
            print(f"          {dev}: " + "  ".join(f"{k} {v:.0f} ms" for k, v in ph.items()), flush=True)
      times = {r["variant"]: r["median_s"] for r in rows if r["batch"] == kind}
      if "wlb" in times and "distca" in times:  # CAD against the paper's baseline, same batch
        print(f"{kind:9s} distca vs wlb  x{times['wlb'] / times['distca']:.3f} (wlb's step time "
              f"over distca's)", flush=True)
  if args.suite not in ("mfu", "overhead"):  # (those printed their own tables)
    cols = [k for k, v in rows[0].items() if k != "peak_gib" and not isinstance(v, dict)]
    print("\n| " + " | ".join(cols) + " | peak GiB |")
    for r in rows:
      cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in (r.get(k) for k in cols)]
      print("| " + " | ".join(cells) + f" | {max(r['peak_gib']):.1f} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(main())
