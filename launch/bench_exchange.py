"""Benchmark of the packed CAD exchange on the trainer's step plans: rows carried and buffers.

  python launch/bench_exchange.py 8 16 32 64 [--batches 3] [--tokens 65536] [--compile 8 16]

At each device count it plans the trainer's steps (`dispatch.plan_step`, ping-pong on, gate off)
of Pretrain, ProLong and short-document-heavy batches (`doclens.stress_lengths`) and prints the
rows each transport carries over the rows that move (query and K/V separately; `ragged` carries
exactly the moving rows, `tiled` every pair at the largest pair's), and the packed send + receive buffers over the busiest sender's plus the
busiest receiver's moving rows. At the `--compile` counts it also compiles the query and K/V
exchanges of the plan moving the most query rows (planned for each transport) on that many
simulated CPU devices and reads the buffers XLA allocates (`memory_analysis`) for the `tiled`
transport (the one that runs on the CPU), against the same moving rows: the transport alone, and
with the row gathers around it. The targets: rows carried <= 1.25x the rows moved, buffers <=
1.5x the busiest device's moving rows.

  python launch/bench_exchange.py --gpu-mock --compile 8 16 32 [--batches 1]   (one GPU)

compiles instead for a mocked GPU cluster of each `--compile` count (`jax_mock_gpu_topology`:
XLA's GPU compiler and buffer assignment for that many GPUs, nothing run), so the buffers are
the GPU's, `ragged` included. Each count runs in its own process: the mocked topology is fixed
when JAX starts. `--step-layers L` also compiles whole training steps there (llama3_8b with L
layers, colocated and CAD over each transport) and prints their temporaries per device.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np

from distca_jax.data.doclens import stress_lengths
from distca_jax.schedule.transport import RAGGED, TILED, TRANSPORTS


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("devices", type=int, nargs="*", help="device counts, e.g. 8 16 32 64")
  ap.add_argument("--batches", type=int, default=3, help="sampled batches per device count")
  ap.add_argument("--tokens", type=int, default=65536, help="tokens per device")
  ap.add_argument("--compile", type=int, nargs="*", default=[8, 16],
                  help="device counts at which to compile the exchanges (on simulated CPU "
                       "devices, or mocked GPUs with --gpu-mock) and read their buffers from "
                       "XLA's memory analysis")
  ap.add_argument("--gpu-mock", action="store_true",
                  help="compile for a mocked GPU cluster of each --compile count instead (one GPU "
                       "needed), with ragged among the transports")
  ap.add_argument("--timeout", type=int, default=300, help="seconds per mocked cluster")
  ap.add_argument("--step-layers", type=int, default=0,
                  help="with --gpu-mock: also compile whole training steps (llama3_8b with this many "
                       "layers, the first batch of --step-dist) colocated and with CAD over each "
                       "transport, and read their temporaries")
  ap.add_argument("--step-dist", default="prolong", help="the distribution of --step-layers' batch")
  args = ap.parse_args(argv)
  if args.step_layers and not args.gpu_mock:
    ap.error("--step-layers needs --gpu-mock: XLA's CPU memory analysis does not size a GPU step")
  if args.gpu_mock:
    return _mocked_clusters(args)
  if not args.devices:
    ap.error("give the device counts")
  return exchange_table(args)


# The mocked cluster is N hosts of one GPU, the only layout one real GPU can mock. Its compiler
# would otherwise share autotuning among the mocked hosts and wait for them forever
# (openxla/xla#28959); the exchanges have nothing to autotune.
MOCK_XLA_FLAGS = "--xla_gpu_shard_autotuning=false"


def _mocked_clusters(args) -> int:
  """`exchange_table` for each `--compile` count in a process of its own whose JAX mocks a
  cluster of that many GPUs."""
  rc = 0
  for n in args.compile or []:
    env = dict(os.environ, DISTCA_MOCK_GPUS=str(n), DISTCA_MOCK_TIMEOUT=str(args.timeout),
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {MOCK_XLA_FLAGS}".strip())
    cmd = [sys.executable, "-P", os.path.abspath(__file__), str(n), "--compile", str(n),
           "--batches", str(args.batches), "--tokens", str(args.tokens)]
    if args.step_layers:
      env["DISTCA_MOCK_STEP"] = f"{args.step_layers}:{args.step_dist}"
    try:
      rc |= subprocess.run(cmd, env=env, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
      print(f"| {n} | mocked cluster: not compiled in {args.timeout} s |", flush=True)
      rc = 1
  return rc


EXCHANGE_DISTS = ("pretrain", "prolong", "short")


def _step_contexts(dist: str, n: int, t: int, batches: int, exchange: str = TILED.name):
  """The trainer's CAD host contexts (`dispatch.plan_step`: ping-pong on, gate off) of `batches`
  sampled batches, each at its own buckets, planned for `exchange` (the plans are the same for
  every transport but for the static sizes each one's exchange takes: tiled blocks)."""
  from distca_jax import dispatch
  from distca_jax.config import load_config
  from distca_jax.data.sources import make_batch
  from distca_jax.models.presets import resolve

  config = load_config(None, ["model.preset=llama3_8b", f"data.tokens_per_device={t}",
                              "attention.impl=distca", "attention.gate=false",
                              "attention.min_imbalance=1", f"mesh.data={n}",
                              f"attention.exchange={exchange}"])
  shape = resolve(config.model)
  out = []
  for step in range(batches):
    lens = stress_lengths(dist, n, t, step)
    tokens = np.zeros(int(lens.sum()), np.int32)
    out.append(dispatch.plan_step(config.attention, make_batch(lens, tokens, n, t), shape))
  return config, shape, out


def _carried(d, name: str) -> dict[str, float]:
  """Rows each transport carries for one plan's query ("q") or K/V ("kv") exchange, the rows that
  move, and the packed buffers against the busiest sender's and receiver's moving rows."""
  from distca_jax.schedule.items import exchange_capacity

  r = getattr(d, name)
  count = np.asarray(r.send_count, np.int64)
  n = count.shape[0]
  moved = int(count.sum())
  buffers = r.send_rows + r.recv_rows
  busiest = int(count.sum(1).max() + count.sum(0).max())
  return {"moved": moved, RAGGED.name: moved,
          TILED.name: n * (n - 1) * exchange_capacity(int(count.max()), d.local_q_valid.shape[-1]),
          "buffers": buffers, "busiest": busiest}


def _compiled_buffers(plans: dict, n: int, row_heads: int = 8,
                      head_dim: int = 128) -> dict[tuple[str, str, str], int]:
  """XLA's buffers (bytes per device) for the query and the K/V exchange of one plan (rows of
  `row_heads` x `head_dim` bf16) on `n` devices, per transport, `plans`: {transport: the plan as
  planned for it}:
  {(name, mode, what): bytes}. what "exchange": the transport alone (`exchange.transport`: the
  packed send buffer in, the packed receive buffer out, and what it allocates between them);
  "movers": the exchange with the row gathers around it (`_rows_to_servers`, `_kv_to_servers`):
  for the query its temporaries and output less the local rows it passes on, for K/V its
  temporaries (the output is the kernel's K/V buffer, which every transport fills alike)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, PartitionSpec as P

  from distca_jax.dispatch import exchange as ex

  t = next(iter(plans.values())).local_q_valid.shape[-1]
  row = row_heads * head_dim * 2
  mesh = Mesh(np.array(jax.devices()[:n]).reshape(n, 1, 1), ("data", "pipe", "tensor"))
  rows_spec = P(("pipe", "data"))
  sharded = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(rows_spec, rows_spec),
                                            out_specs=rows_spec, check_vma=False))
  bf16 = lambda rows: jax.ShapeDtypeStruct((n, rows, row_heads, head_dim), jnp.bfloat16)
  out = {}
  for name, mover in (("q", ex._rows_to_servers), ("kv", ex._kv_to_servers)):
    for mode, plan in plans.items():
      send_rows, recv_rows = getattr(plan, name).send_rows, getattr(plan, name).recv_rows
      def alone(x, p, name=name, mode=mode, recv_rows=recv_rows):
        p = jax.tree.map(lambda a: a[0], p)
        return ex.transport(x[0], recv_rows, ex.Exchange.of(getattr(p, name)), mode)[None]

      def movers(x, p, mover=mover, mode=mode):
        p = jax.tree.map(lambda a: a[0], p)
        return mover(x[0], p, mode)[None]

      m = sharded(alone).lower(bf16(send_rows), plan).compile().memory_analysis()
      out[(name, mode, "exchange")] = int((send_rows + recv_rows) * row + m.temp_size_in_bytes)
      m = sharded(movers).lower(bf16(t), plan).compile().memory_analysis()
      kept = m.output_size_in_bytes - t * row if name == "q" else 0
      out[(name, mode, "movers")] = int(m.temp_size_in_bytes + kept)
  return out


def _compiled_step_bytes(n: int, t: int, dist: str, variants, *overrides: str) -> dict[str, tuple]:
  """{variant: (temporaries, arguments) bytes per device} of one training step compiled, not run,
  on the first `n` devices, for the first batch of `dist` (`t` tokens per device); variants:
  "colocated" or "distca:<transport>" (gate off: CAD runs). `overrides`: the model's config."""
  import jax

  from distca_jax import attention as attention_lib
  from distca_jax import mesh as mesh_lib
  from distca_jax.config import load_config
  from distca_jax.schedule.capacities import StepShapes
  from distca_jax.train.job import make_source
  from distca_jax.train.step import Trainer

  out = {}
  for variant in variants:
    impl, _, exchange = variant.partition(":")
    config = load_config(None, [*overrides, f"data.tokens_per_device={t}", f"mesh.data={n}",
                                f"attention.impl={impl}", f"attention.exchange={exchange or TILED.name}",
                                "attention.gate=false", "attention.min_imbalance=1",
                                # one node: a mocked cluster has no hosts to ask
                                "attention.data_rank_nodes=[" + ",".join(["0"] * n) + "]",
                                "data.length_scale=1", f"data.distribution={dist}"])
    trainer = Trainer(config, mesh_lib.make_mesh(config.mesh, jax.devices()[:n]))
    batch = make_source(config, n).batch(0)
    ctx = attention_lib.host_context(trainer.config.attention, batch, trainer.shape,
                                     shapes=StepShapes())
    m = trainer.lower(trainer.abstract_state(), *trainer.abstract_batch(batch, ctx)).compile() \
        .memory_analysis()
    out[variant] = (int(m.temp_size_in_bytes), int(m.argument_size_in_bytes))
  return out


def exchange_table(args):
  """Prints the packed exchange's table (module docstring)."""
  flags = os.environ.get("XLA_FLAGS", "")
  want = max(args.compile or [0])
  mocked = os.environ.get("DISTCA_MOCK_GPUS")
  if mocked:  # a process of `_mocked_clusters`
    import faulthandler

    import jax

    # Where a compile that will not finish waits, printed before the parent stops it.
    faulthandler.dump_traceback_later(max(1, int(os.environ["DISTCA_MOCK_TIMEOUT"]) - 5))

    jax.config.update("jax_mock_gpu_topology", f"1x{mocked}x1")
    modes = tuple(TRANSPORTS.values())
  else:
    if want and "xla_force_host_platform_device_count" not in flags:
      os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={want}".strip()
      os.environ.setdefault("JAX_PLATFORMS", "cpu")
    modes = tuple(m for m in TRANSPORTS.values() if not m.needs_gpu)
  t = args.tokens
  print(f"# packed exchange, llama3_8b, {t} tokens per device, ping-pong on, gate off, "
        f"{args.batches} batches per row; carried / moved rows per transport (mean over plans, "
        f"worst in brackets); buffers: send + receive rows over the busiest sender's + receiver's "
        f"moving rows")
  print("| devices | dist | Q moved | Q ragged | Q tiled | K/V moved | K/V ragged | K/V tiled | "
        "Q buffers / busiest | K/V buffers / busiest |")
  # "busiest": the step's busiest sender's plus busiest receiver's moving rows, over its plans.
  print("|---|---|---|---|---|---|---|---|---|---|")
  compiled_rows = []
  for n in args.devices:
    for dist in EXCHANGE_DISTS:
      config, shape, ctxs = _step_contexts(dist, n, t, args.batches)
      steps = [c.dispatch for c in ctxs if c.cad]
      plans = [d for ds in steps for d in ds]
      if not plans:
        print(f"| {n} | {dist} | nothing moves | | | | | | | |")
        continue
      cells = []
      for name in ("q", "kv"):
        rows = [_carried(d, name) for d in plans if _carried(d, name)["moved"]]
        ratio = lambda key: [r[key] / r["moved"] for r in rows]
        # A step holds one set of buffers for its plans (Ping and Pong): sized for the busier.
        per_step = [[_carried(d, name) for d in ds] for ds in steps]
        buffers = [r[0]["buffers"] / max(x["busiest"] for x in r) for r in per_step
                   if max(x["busiest"] for x in r)]
        cells.append((int(np.mean([r["moved"] for r in rows])),
                      *((np.mean(ratio(k)), np.max(ratio(k))) for k in (RAGGED.name, TILED.name)),
                      (np.mean(buffers), np.max(buffers))))
      fmt = lambda m: f"{m[0]:.2f}x ({m[1]:.2f}x)"
      (qm, *qr, qb), (km, *kr, kb) = cells
      print(f"| {n} | {dist} | {qm} | " + " | ".join(fmt(x) for x in qr) + f" | {km} | "
            + " | ".join(fmt(x) for x in kr) + f" | {fmt(qb)} | {fmt(kb)} |", flush=True)
      if n in (args.compile or []):
        # The plan moving the most query rows, planned for each transport; its step's buffers
        # are sized for the busier of its plans (Ping and Pong), so is the denominator.
        i, j = max(((i, j) for i, ds in enumerate(steps) for j in range(len(ds))),
                   key=lambda ij: int(np.asarray(steps[ij[0]][ij[1]].q.send_count).sum()))
        others = {mode: _step_contexts(dist, n, t, args.batches, mode.name)[2] for mode in modes
                  if mode is not TILED}
        step_of = lambda mode: [c.dispatch for c in (others.get(mode) or ctxs) if c.cad][i]
        got = _compiled_buffers({mode: step_of(mode)[j] for mode in modes}, n)
        busy = {name: max(_carried(d, name)["busiest"] for d in steps[i]) * 8 * 128 * 2
                for name in ("q", "kv")}
        compiled_rows.append((n, dist, busy, got))
  if compiled_rows:
    print()
    where = f"GPU (a mocked cluster of {mocked})" if mocked else "CPU"
    print("# compiled exchanges (the plan moving the most query rows), 8 heads x 128 bf16 rows, "
          f"XLA {where} buffers per device over the busiest sender's + receiver's moving rows: the "
          "transport alone (its send and receive buffers and what it allocates) / with the row "
          "gathers around it (_compiled_buffers)")
    print("| devices | dist | exchange | busiest moving MB | "
          + " | ".join(f"{mode.name}: alone / with gathers" for mode in modes) + " |")
    print("|---|---|---|---|" + "---|" * len(modes))
    for n, dist, busy, got in compiled_rows:
      for name, label in (("q", "Q"), ("kv", "K/V")):
        cells = [f"{got[(name, mode, 'exchange')] / busy[name]:.2f}x / "
                 f"{got[(name, mode, 'movers')] / busy[name]:.2f}x" for mode in modes]
        print(f"| {n} | {dist} | {label} | {busy[name] / 1e6:.1f} | " + " | ".join(cells) + " |",
              flush=True)
  step = os.environ.get("DISTCA_MOCK_STEP")
  if mocked and step:
    layers, dist = step.split(":")
    variants = ("colocated", *(f"distca:{m.name}" for m in modes))
    got = _compiled_step_bytes(int(mocked), t, dist, variants, "model.preset=llama3_8b",
                               f"model.layers={layers}", "model.remat=full", "mesh.tensor=1")
    print()
    print(f"# whole training steps compiled for the mocked cluster of {mocked} GPUs: llama3_8b, "
          f"{layers} layers, remat full, {t} tokens per device, the first {dist} batch, CAD on "
          f"(gate off); XLA's temporaries per device, GiB (and over colocated's)")
    print("| devices | dist | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    base = got["colocated"][0]
    print(f"| {mocked} | {dist} | " + " | ".join(
        f"{got[v][0] / 2**30:.2f} ({got[v][0] / base:.2f}x)" for v in variants) + " |", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
