"""Benchmark of the CA-task planner: planning time, imbalance and bytes, with the baselines.

  python launch/bench_scheduler.py [--devices 512] [--tokens 131072] [--batches 5]
      [--eps 0.05 0.1] [--dist pretrain prolong] [--repeats 5] [--arrays-devices 8]

The planner's target: one step of 512 devices × 128K tokens of Pretrain planned in ≤ 50 ms on one
core, compute imbalance ≤ 1.05 at ε = 0.05. Time is CPU time of this process (`process_time`,
so other processes on a shared machine do not inflate it; numpy is pinned to one thread), median
and best over `--repeats` runs per batch, of `planner.balance` (the schedule) and separately of
the byte accounting (`traffic.traffic`). Bytes are per device per layer, fwd+bwd, for one
tensor-parallel rank's heads (llama3_8b, TP = 8). "time imbalance": max / mean over servers of the
predicted kernel time (cost.AnalyticKernel: 300 TFLOP/s, 128-row tiles), the plan's quality in
time rather than FLOPs. `--arrays-devices` also times building the
dispatch arrays (plan.make_plan with arrays) at a device count where they fit in memory.
`--step-devices` times the trainer's whole host path per step (the source's batch, then
dispatch.plan_step: ping-pong split, schedule, dense dispatch arrays, validation; with
`--local-devices k`, also as one process of a multi-process job holding k devices' rows builds
them) and reports how much of the tiled all_to_all
is padding (every (device, server) block padded to the largest one's bucket). `--pairs` shows
why: how few (device, server) pairs the moving rows use, and the rows a device sends in the tiled
exchange ((N - 1) blocks of the common capacity) against the busiest device's real rows (what a
transport sending only the moving rows would be bound by). `--hotspot` shows the busiest device's
K/V bytes with the two-round relayed exchange (`schedule/relay.py`) off and on, and the bytes
that cross nodes, planned without and with the nodes (`balance(nodes=...)`), on Pretrain,
ProLong and two synthetic batches (`doclens.stress_lengths`), and exits:

  python launch/bench_scheduler.py --hotspot [pretrain prolong short long] [--devices 512]
      [--fanouts 4 8 16 32] [--node-size 8]
The packed exchange's rows and buffers: `launch/bench_exchange.py`.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
  os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from distca_jax.data.doclens import STRESS_DISTS, LengthSampler, load_lengths, stress_lengths  # noqa: E402
from distca_jax.data.packing import pack  # noqa: E402
from distca_jax.models.presets import PRESETS  # noqa: E402
from distca_jax.schedule.baselines import colocated, per_document_cp, wlb_packing  # noqa: E402
from distca_jax.schedule.cost import AnalyticKernel, CommModel  # noqa: E402
from distca_jax.schedule.plan import make_plan  # noqa: E402
from distca_jax.schedule.planner import balance  # noqa: E402
from distca_jax.schedule.traffic import traffic  # noqa: E402


def _cpu_ms(fn, repeats):
  times = []
  out = None
  for _ in range(repeats):
    t0 = time.process_time()
    out = fn()
    times.append((time.process_time() - t0) * 1e3)
  return out, statistics.median(times), min(times)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--devices", type=int, default=512)
  ap.add_argument("--tokens", type=int, default=131072)
  ap.add_argument("--batches", type=int, default=5)
  ap.add_argument("--eps", type=float, nargs="+", default=[0.05, 0.1])
  ap.add_argument("--dist", nargs="+", default=["pretrain", "prolong"])
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--arrays-devices", type=int, default=8)
  ap.add_argument("--tp", type=int, default=8)
  ap.add_argument("--step-devices", type=int, nargs="*", default=[],
                  help="device counts at which to time the trainer's host path (then exit)")
  ap.add_argument("--local-devices", type=int, default=0,
                  help="--step-devices: also time one process of a multi-process job that feeds "
                       "this many of the devices (it builds and checks only their rows)")
  ap.add_argument("--step-batches", type=int, default=3,
                  help="--step-devices: the median host time over this many batches (the first "
                       "steps of a process are slower: page faults, caches)")
  ap.add_argument("--baseline", default=None, metavar="DIR",
                  help="--step-devices: also time the host path of the source tree DIR (e.g. an "
                       "earlier commit's `git archive`) in the same run, interleaved with this "
                       "tree's, and print the two side by side (relays on, 8 slices)")
  ap.add_argument("--emit-json", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--all-rows-upto", type=int, default=32,
                  help="--step-devices: time the all-rows host path only up to this many devices")
  ap.add_argument("--pairs", type=int, nargs="*", default=[],
                  help="device counts at which to show how the moving rows use the exchange's "
                       "(device, server) pairs (then exit)")
  ap.add_argument("--hotspot", nargs="*", default=None, metavar="DIST",
                  help="the busiest device's bytes with relayed K/V off and on, on these "
                       "distributions (default: pretrain prolong short long; then exit)")
  ap.add_argument("--fanouts", type=int, nargs="+", default=[4, 8, 16, 32],
                  help="--hotspot: relay fanouts (slices per relayed shard) to compare")
  ap.add_argument("--node-size", type=int, default=8,
                  help="--hotspot: devices a node (the node-aware planner's nodes, and which "
                       "bytes cross the network)")
  args = ap.parse_args(argv)
  if args.hotspot is not None:
    return hotspot(args)
  if args.step_devices and (args.baseline or args.emit_json):
    return compare_host_path(args)
  if args.step_devices:
    return step_host_path(args)
  if args.pairs:
    return pair_usage(args)

  comm = CommModel.for_model(PRESETS["llama3_8b"], tensor_parallel=args.tp)
  n, t = args.devices, args.tokens
  print(f"# {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} "
        f"loadavg={os.getloadavg()[0]:.1f} numpy={np.__version__}")
  print(f"# {n} devices x {t} tokens, llama3_8b TP={args.tp}: q row {comm.q_row_bytes:.0f} B, "
        f"kv row {comm.kv_row_bytes:.0f} B per layer fwd+bwd")
  kernel = AnalyticKernel(heads=comm.heads, head_dim=comm.head_dim)
  print("| dist | eps | plan ms (median / best) | bytes ms | moves | tasks | imbalance before -> after "
        "| time imbalance after | max send or recv MB/layer | mean send MB/layer |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  base_rows = []
  for dist in args.dist:
    sampler = LengthSampler(load_lengths(dist), full_context_replacement=(dist == "prolong"),
                            elongate_factor=max(1, t // 131072))
    batches = [sampler.sample(n * t, b) for b in range(args.batches)]
    layouts = [pack(l, n, t) for l in batches]
    for eps in args.eps:
      med, best, imb0, imb1, mx, mean, moves, ntask, tms, timb = [], [], [], [], [], [], [], [], [], []
      for lay in layouts:
        (tasks, stats), m, b = _cpu_ms(lambda: balance(lay, comm, eps), args.repeats)
        tr, tm, _ = _cpu_ms(lambda: traffic(tasks, lay, comm), 1)
        med.append(m), best.append(b), tms.append(tm)
        imb0.append(stats.imbalance_before), imb1.append(stats.imbalance_after)
        mx.append(max(tr.send.max(), tr.recv.max()) / 1e6), mean.append(tr.send.mean() / 1e6)
        moves.append(stats.moves), ntask.append(tasks.size)
        ms = np.bincount(tasks.server, weights=kernel.fwdbwd_ms(tasks.q_len, tasks.kv_len), minlength=n)
        timb.append(ms.max() / ms.mean())
      print(f"| {dist} | {eps} | {statistics.median(med):.1f} / {min(best):.1f} (worst batch "
            f"{max(med):.1f}) | {statistics.median(tms):.1f} | {np.mean(moves):.0f} | {np.mean(ntask):.0f} | "
            f"{np.mean(imb0):.2f} -> {np.mean(imb1):.3f} (worst {max(imb1):.3f}) | {np.mean(timb):.3f} | "
            f"{np.mean(mx):.0f} | "
            f"{np.mean(mean):.0f} |")
    # Baselines on the same batches.
    for name, fn in (
        ("colocated", lambda l, lay: colocated(lay, comm)),
        ("wlb (cp=1, cap 1.5T)", lambda l, lay: wlb_packing(l, n, t, comm, cp=1)),
        ("wlb (cp=8, cap 1.5T)", lambda l, lay: wlb_packing(l, n, t, comm, cp=8)),
        (f"per-doc CP (cp={n})", lambda l, lay: per_document_cp(l, n, t, comm))):
      loads = [fn(l, lay) for l, lay in zip(batches, layouts)]
      base_rows.append((dist, name, np.mean([x.compute_imbalance for x in loads]),
                        np.mean([x.memory_imbalance for x in loads]),
                        np.mean([max(x.send.max(), x.recv.max()) for x in loads]) / 1e6))
  print("\n| dist | baseline | compute imbalance | memory imbalance | max bytes MB/layer |")
  print("|---|---|---|---|---|")
  for dist, name, ci, mi, mb in base_rows:
    print(f"| {dist} | {name} | {ci:.3f} | {mi:.3f} | {mb:.0f} |")

  if args.arrays_devices:
    na = args.arrays_devices
    lens = LengthSampler(load_lengths("pretrain")).sample(na * t, 0)
    lay = pack(lens, na, t)
    from distca_jax.dispatch import build_dispatch

    def plan_and_arrays():
      plan = make_plan(lay, comm, 0.05)
      build_dispatch(plan.tasks, lay, plan.capacities)
      return plan

    plan, m, b = _cpu_ms(plan_and_arrays, max(1, args.repeats // 2))
    c = plan.capacities
    print(f"\nmake_plan with dispatch arrays, {na} devices x {t} tokens (pretrain, eps 0.05): "
          f"{m:.1f} ms median, {b:.1f} ms best; capacities c={c.c} ckv={c.ckv} skv={c.skv} "
          f"ctask={c.ctask}; imbalance {plan.stats.imbalance_before:.2f} -> {plan.stats.imbalance_after:.3f}")


def compare_host_path(args):
  """One process's host work per step (a process of `--local-devices` devices: its rows' batch
  and `dispatch.plan_step`), this tree against `--baseline`'s in one run: per device count, the
  baseline's (a subprocess on that tree), then this tree's, then the baseline's again (this
  machine's load drifts). Wall and CPU ms (median over `--step-batches`), and of it the planning
  of the step's nano-batches (`dispatch.host._plans_and_kv`: schedule, K/V requests with relays,
  capacities, traffic; CPU ms, best of 3), with the plans' moves and imbalance, which must agree."""
  import json
  import subprocess
  import sys

  if args.emit_json:
    for dist in args.dist:
      for n in args.step_devices:
        print(json.dumps(_host_numbers(args, dist, n)), flush=True)
    return
  k = args.local_devices or 8
  print(f"# a process of {k} devices, host path per step (median of {args.step_batches} "
        f"batches), {args.tokens} tokens/device, llama3_8b, ping-pong on, relays on (8 slices); "
        f"CPU {platform.processor() or platform.machine()}, loadavg {os.getloadavg()[0]:.1f}; "
        f"before: {args.baseline}")
  print("| dist | devices | host ms, wall: before / after / before again | host CPU ms: before / "
        "after / before again | planning CPU ms: before / after | moves, imbalance after: "
        "before / after |")
  print("|---|---|---|---|---|---|")

  def baseline(dist, n):
    cmd = [sys.executable, os.path.abspath(__file__), "--emit-json", "--step-devices", str(n),
           "--dist", dist, "--tokens", str(args.tokens), "--local-devices", str(k),
           "--step-batches", str(args.step_batches)]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(args.baseline))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])

  for dist in args.dist:
    for n in args.step_devices:
      b0 = baseline(dist, n)
      a = _host_numbers(argparse.Namespace(**{**vars(args), "local_devices": k}), dist, n)
      b1 = baseline(dist, n)
      print(f"| {dist} | {n} | {b0['wall']:.0f} / {a['wall']:.0f} / {b1['wall']:.0f} "
            f"| {b0['cpu']:.0f} / {a['cpu']:.0f} / {b1['cpu']:.0f} "
            f"| {min(b0['plan'], b1['plan']):.0f} / {a['plan']:.0f} "
            f"| {b0['moves']}, {b0['imbalance']:.3f} / {a['moves']}, {a['imbalance']:.3f} |",
            flush=True)


def _host_numbers(args, dist: str, n: int) -> dict:
  """The host path's wall and CPU ms for a process of `args.local_devices` devices, the planning's
  CPU ms, and the plans' moves and imbalance after (batch 0), on the code imported."""
  from distca_jax import dispatch
  from distca_jax.dispatch import host

  config, shape, source = _trainer_source(dist, n, args.tokens, ["attention.kv_relay_fanout=8"])
  devices = np.arange(min(args.local_devices, n))
  walls, cpus = [], []
  for i in range(max(args.step_batches, 1)):
    t0, c0 = time.perf_counter(), time.process_time()
    step = dispatch.plan_step(config.attention, source.batch(i, devices), shape, devices)
    walls.append((time.perf_counter() - t0) * 1e3)
    cpus.append((time.process_time() - c0) * 1e3)
    if i == 0:  # what batch 0 reports, not its arrays (a trainer frees a step's when it ran)
      layouts, imbalance = [b.layout for b in step.batches], float(step.imbalance()[1])
    del step
  plans, _, plan_ms = _cpu_ms(
      lambda: host._plans_and_kv(config.attention, layouts, shape)[0], 3)
  return {"wall": float(np.median(walls)), "cpu": float(np.median(cpus)), "plan": plan_ms,
          "moves": sum(p.stats.moves for p in plans), "imbalance": imbalance}


def _trainer_source(dist: str, n: int, t: int, extra=()):
  """(config, model shape, data source) of the trainer's CAD job on `n` devices of `t` tokens
  (llama3_8b, the paper's elongation for t), the gate off: the CAD host path on every batch."""
  from distca_jax.config import load_config
  from distca_jax.data.sources import synthetic_from_config
  from distca_jax.models.presets import resolve

  config = load_config(None, ["model.preset=llama3_8b", f"data.tokens_per_device={t}",
                              "data.length_scale=1", f"data.elongate_factor={max(1, t // 65536)}",
                              "attention.impl=distca", "attention.gate=false",
                              "attention.min_imbalance=1", f"mesh.data={n}", f"data.distribution={dist}",
                              *extra])
  shape = resolve(config.model)
  return config, shape, synthetic_from_config(config.data, shape.vocab_size, n)


def step_host_path(args):
  """The trainer's per-step host work (`dispatch.plan_step`) against the device count, and the
  padding of its tiled all_to_alls: rows sent per device (N - 1 blocks of capacity c) vs the rows
  that really move, summed over the exchange, for Q and for K/V, both nano-batches."""
  from distca_jax import dispatch, gate

  t = args.tokens
  print(f"# host path per step (median of {args.step_batches} batches), {t} tokens/device, "
        f"llama3_8b, ping-pong on; CPU "
        f"{platform.processor() or platform.machine()}, loadavg {os.getloadavg()[0]:.1f}")
  k = args.local_devices
  print("| dist | devices | host ms (wall: batch + plan_step), all rows | host ms, a process of "
        f"{k or '-'} devices | of it schedule ms | WLB baseline host ms, all rows / a process "
        "| imbalance before -> after | Q rows sent: padded / real | K/V rows sent: padded / real |")
  print("|---|---|---|---|---|---|---|---|---|")
  for dist in args.dist:
    for n in args.step_devices:
      config, shape, source = _trainer_source(dist, n, t)

      def timed(devices):  # a process's data and plans for `devices` (None: every row)
        times = []
        for i in range(max(args.step_batches, 1)):
          t0 = time.perf_counter()
          step = dispatch.plan_step(config.attention, source.batch(i, devices), shape, devices)
          times.append((time.perf_counter() - t0) * 1e3)
          if i == 0:  # batch 0's plan is the one reported
            ctx = step
        return ctx, float(np.median(times))

      ctx, wall = timed(None) if n <= args.all_rows_upto else (None, None)
      if k and k < n:
        ctx, local = timed(np.arange(k))
      else:
        local = None
      t0 = time.perf_counter()
      for b in ctx.batches:
        make_plan(b.layout, gate.comm_model(shape, config.attention),
                  epsilon=config.attention.epsilon)
      sched = (time.perf_counter() - t0) * 1e3
      # The counts are the whole plan's on every process (off-diagonal blocks only).
      pad_q = sum(n * (n - 1) * d.q.send_idx.shape[-1] for d in ctx.dispatch)
      pad_kv = sum(n * (n - 1) * d.kv.send_idx.shape[-1] for d in ctx.dispatch)
      real_q = sum(int(d.q.send_count.sum()) for d in ctx.dispatch)
      real_kv = sum(int(d.kv.send_count.sum()) for d in ctx.dispatch)
      wlb_all = wlb_host_ms(config, shape, source, None) if n <= args.all_rows_upto else None
      wlb_local = wlb_host_ms(config, shape, source, np.arange(k)) if k and k < n else None
      before, after = ctx.imbalance()
      ratio = lambda a, b: f"{a / b:.1f}x" if b else "-"
      ms = lambda x: "-" if x is None else f"{x:.0f}"
      print(f"| {dist} | {n} | {ms(wall)} | {ms(local)} | {sched:.0f} | {ms(wlb_all)} / {ms(wlb_local)} "
            f"| {before:.2f} -> {after:.2f} | "
            f"{pad_q:,} / {real_q:,} ({ratio(pad_q, real_q)}) | "
            f"{pad_kv:,} / {real_kv:,} ({ratio(pad_kv, real_kv)}) |", flush=True)


def wlb_host_ms(config, shape, source, rows) -> float:
  """Wall ms of the WLB-LLM baseline's host step (`data.packing=wlb`, CP groups of 8 or all): the
  batch of `rows` (None: all), its packing, its re-packed rows."""
  import dataclasses

  from distca_jax import wlb_attention

  n = config.mesh.data
  config = dataclasses.replace(config, data=dataclasses.replace(config.data, packing="wlb",
                                                                wlb_cp=min(8, n)))
  t0 = time.perf_counter()
  wlb_attention.host_item(config, source.batch(0, rows), shape, 8, rows=rows)
  return (time.perf_counter() - t0) * 1e3


def pair_usage(args):
  """Per nano-batch of the trainer's plan (ping-pong on): the query and K/V rows each (device,
  server) pair carries. The tiled exchange pads every pair to the largest pair's bucket; its rows
  per device, (N - 1) x capacity, against the busiest device's real rows (max over devices of the
  rows it sends or receives) is its cost relative to a transport that sends only what moves."""
  from distca_jax import dispatch, gate
  from distca_jax.schedule.items import exchange_capacity
  from distca_jax.schedule.traffic import pair_rows

  t = args.tokens
  print(f"# (device, server) pairs of the exchange, {t} tokens/device, llama3_8b, ping-pong on, batch 0")
  print("| dist | devices | nano | rows | moved | pairs used | largest pair | mean used pair "
        "| capacity | tiled rows / device | busiest device's rows | tiled / busiest |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for dist in args.dist:
    for n in args.pairs:
      config, shape, source = _trainer_source(dist, n, t)
      batch = source.batch(0)
      comm = gate.comm_model(shape, config.attention)
      for k, nano in enumerate(dispatch.split_pingpong_batch(batch)):
        lay = nano.layout
        tasks = make_plan(lay, comm, epsilon=config.attention.epsilon).tasks
        q, kvm, _ = pair_rows(tasks, lay)
        for name, m in (("Q", q), ("K/V", kvm)):
          used = int((m > 0).sum())
          cap = exchange_capacity(int(m.max(initial=0)), lay.buffer_len)
          busiest = max(m.sum(1).max(initial=0), m.sum(0).max(initial=0))
          tiled = (n - 1) * cap
          ratio = f"{tiled / busiest:.1f}x" if busiest else "-"
          print(f"| {dist} | {n} | {('ping', 'pong')[k]} | {name} | {int(m.sum()):,} | {used} / {n * (n - 1)} "
                f"| {int(m.max(initial=0)):,} | {m.sum() / max(used, 1):,.0f} | {cap:,} | {tiled:,} "
                f"| {int(busiest):,} | {ratio} |", flush=True)



def hotspot(args):
  """Per distribution, planner (`flat`: nodes unknown; `nodes`: `balance(nodes=...)`, a
  destination takes from its own node's sources first) and K/V relay: plan time (`balance`, CPU
  ms, median and worst batch), the relay's routing time (`kv_requests`), imbalance after, moves,
  the busiest device's bytes per layer (max of sent and received) over the mean device's, in GB,
  and the busiest of round 1 (Q and direct K/V) plus the busiest of round 2 (forwarded K/V; the
  rounds run one after the other, so this sum, not the busiest total, bounds the exchange's
  time), the bytes that cross nodes (`--node-size` devices a node) in all and at the busiest
  device's network link, and the share of K/V rows sent in round 2. Means over `--batches`
  batches."""
  from distca_jax.schedule.traffic import kv_requests, pair_rows
  from distca_jax.schedule.relay import Relay

  comm = CommModel.for_model(PRESETS["llama3_8b"], tensor_parallel=args.tp)
  n, t, per_node = args.devices, args.tokens, args.node_size
  node = np.arange(n) // per_node
  across = node[:, None] != node[None, :]
  relays = [None] + [Relay(f) for f in args.fanouts]
  print(f"# {n} devices x {t} tokens, {per_node} devices a node, llama3_8b TP={args.tp}, eps 0.1, "
        f"{args.batches} batches; CPU {platform.processor() or platform.machine()}, "
        f"loadavg {os.getloadavg()[0]:.1f}")
  print("| dist | planner | K/V relay | plan ms (median / worst) | relay ms | imbalance after | moves "
        "| busiest / mean | busiest GB | round 1 + round 2 busiest GB | across nodes GB "
        "| busiest network GB | K/V rows in round 2 |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for dist in args.hotspot or STRESS_DISTS:
    layouts = [pack(stress_lengths(dist, n, t, b), n, t) for b in range(args.batches)]
    for planner, nodes in (("flat", None), ("nodes", node)):
      plans = []
      for lay in layouts:
        (tasks, stats), ms, _ = _cpu_ms(lambda: balance(lay, comm, 0.1, nodes=nodes), args.repeats)
        plans.append((lay, tasks, stats, ms))
      for relay in relays:
        rows = []
        for lay, tasks, stats, ms in plans:
          kv, kv_ms, _ = _cpu_ms(lambda: kv_requests(tasks, lay, relay), 1)
          tr = traffic(tasks, lay, comm, pairwise=True, relay=relay)
          busy = np.maximum(tr.send, tr.recv)
          net = np.where(across, tr.pair_bytes, 0.0)
          moved = kv.pair_server[kv.piece_pair] != kv.piece_src
          second = kv.piece_rows[kv.piece_via >= 0].sum() / max(kv.piece_rows[moved].sum(), 1)
          q, kv1, kv2 = pair_rows(tasks, lay, kv)
          rounds = sum(max(m.sum(0).max(), m.sum(1).max()) for m in (
              q * comm.q_row_bytes + kv1 * comm.kv_row_bytes, kv2 * comm.kv_row_bytes))
          rows.append((ms, kv_ms, stats.imbalance_after, stats.moves, busy.max() / busy.mean(),
                       busy.max() / 1e9, rounds / 1e9, net.sum() / 1e9,
                       max(net.sum(0).max(), net.sum(1).max()) / 1e9, second))
        r = np.array(rows)
        name = "off" if relay is None else f"fanout {relay.fanout}"
        print(f"| {dist} | {planner} | {name} | {np.median(r[:, 0]):.1f} / {r[:, 0].max():.1f} "
              f"| {r[:, 1].mean():.1f} | {r[:, 2].mean():.3f} | {r[:, 3].mean():.0f} "
              f"| {r[:, 4].mean():.1f}x (worst {r[:, 4].max():.1f}x) | {r[:, 5].mean():.2f} "
              f"| {r[:, 6].mean():.2f} | {r[:, 7].mean():.0f} | {r[:, 8].mean():.2f} "
              f"| {100 * r[:, 9].mean():.0f}% |", flush=True)


if __name__ == "__main__":
  main()
