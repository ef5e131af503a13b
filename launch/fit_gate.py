"""Fit the CAD step gate's cost model to measured step times (docs/PERFORMANCE.md, "Gated runs").

    python launch/fit_gate.py [--expect 50] [--sim] [--from cad.json ... --devices N --set ...]
    python launch/fit_gate.py --logs colocated.log distca.log --devices 2 --set ... data.distribution=prolong

CPU only. For each measured batch (4 x H100, Llama-3-8B shape with 2 layers, 64K tokens per
device; colocated and distca step ms from `bench_train.py --suite cad`; `--from` adds pairs
from such runs' JSON) it rebuilds the batch from the sampler, fits the colocated step time from
the slowest device's matmul and attention FLOPs, prints `gate.predicted_cad_gain` beside the
measured saving, then plans the batch as the trainer does (ping-pong on), fits the exchange's
overhead from the matmul time and the bytes the busiest device moves, prints the three
`attention.gate_*` costs it implies, and predicts each batch's net saving from a fit of the
others (leave-one-out).
`--expect N [--expect-devices 4 2] [--expect-set k=v ...] [--expect-per-node 8]`: then, for the
sampler's first N batches of each distribution, the gate's decisions and the speedup its
predictions give over those N steps, planned as the trainer plans them (with that many data
ranks per node: the exchange's bytes across nodes cost more), a prediction from the fitted
model, not a measurement. `--sim [--sim-machinery F]`: the simulator's own cost terms fit to
the same batches, its machinery term held at what one GPU measured.
`--kernel-logs BASE.log OTHER.log ...` (`gpu_session.sh kfit`): one-device colocated training
runs of the same sampled steps, one per attention kernel; per run, the step time fit as matmul
plus attention FLOPs, and `gate_attention_cost` scaled by each kernel's attention time per FLOP
over the first run's (the kernel the shipped costs were fit with). `--no-fit`: skip the fit above.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distca_jax import gate, gate_fitting
from distca_jax.schedule.transport import TILED

# The fit's measurements and shipped costs are data (distca_jax/gate_fit.json): (distribution,
# sampler step) -> (colocated ms, distca ms with CAD running), of SETUP on DEVICES devices.
MEASURED = gate.measured_batches()
KERNEL_COST_RATIO = gate.KERNEL_COST_RATIO
DEVICES = gate.FIT_DEVICES
SETUP = gate.FIT_SETUP


def expect(steps: int, devices=(4, 2), overrides=(), per_node: int = 0) -> None:
  """Per device count and distribution: the steps the gate gives CAD, and the predicted speedup
  of the gated run over the colocated one summed over the sampler's first `steps` batches,
  planned as the trainer plans them (the gate on, capacities that only grow: `StepShapes`) and,
  for comparison, with every step taking its own buckets (compilations not counted). A
  prediction from the gate's cost model, not a measurement. `overrides`: config overrides on
  the default setup (Llama-3-8B shape with 2 layers, 64K tokens per device). `per_node`: data
  ranks per node (consecutive ranks share one; 0: every rank on one node), as the trainer's
  `attention.data_rank_nodes` would find them."""
  from distca_jax import dispatch
  from distca_jax.config import load_config
  from distca_jax.data.sources import synthetic_from_config
  from distca_jax.models.presets import resolve

  cfg = load_config(None, list(SETUP) + ["attention.impl=distca", "attention.gate=true"]
                    + list(overrides))
  shape = resolve(cfg.model)
  nodes = f", {per_node} data ranks per node" if per_node else ""
  print(f"\n{' '.join(overrides) or 'default setup'}{nodes}, {steps} steps\n"
        "| devices | batches | CAD steps | predicted speedup | own buckets: CAD steps, speedup "
        "| step shapes |\n|---|---|---|---|---|---|")
  for n in devices:
    attention = cfg.attention
    if per_node:
      attention = dataclasses.replace(attention, data_rank_nodes=tuple(i // per_node for i in range(n)))
    for dist in ("pretrain", "prolong"):
      src = synthetic_from_config(dataclasses.replace(cfg.data, distribution=dist),
                                  shape.vocab_size, n)
      out = []
      for shapes in (dispatch.StepShapes(), None):
        colocated, gated, cad = 0.0, 0.0, 0
        for step in range(steps):
          batch = src.batch(step)
          ctx = dispatch.plan_step(attention, batch, shape, shapes=shapes)
          linear, attn = gate.colocated_flops(shape, batch.layout)
          t = (linear + gate.gate_attention_cost(attention) * attn).max()
          runs_cad = ctx.cad
          colocated += t
          gated += t * (1 - ctx.predicted_saving) if runs_cad else t
          cad += runs_cad
        out.append((cad, colocated / gated, shapes.growths if shapes else None))
      (cad, speedup, grown), (own_cad, own_speedup, _) = out
      print(f"| {n} | {dist} | {cad} | {speedup:.3f} | {own_cad}, {own_speedup:.3f} | {grown} |")


SIM_ARGS = ["gpus=[4]", "tensor_parallel=1", "pipeline_parallel=[1]", "tokens_per_rank=[65536]",
            "distributions=[pretrain,prolong]", "batches=80", "elongate_factor=1", "exchange=tiled",
            "layers=2", "hardware.linear_tflops=250",
            "hardware.time_table=NVIDIA_H100_triton", "progress=false"]


def fit_simulator(machinery: float) -> None:
  """The simulator's own calibration terms on the same batches: `cad_machinery` held at what one
  GPU measures (`machinery`), a grid of `cad_exchange_fixed` and `cad_ms_per_gb`, each scored by
  the RMS error of the simulated CAD speedup against the measured one (the simulator's attention
  model is not the gate's, so its terms differ)."""
  import itertools

  from distca_jax.sim.config import load_sim_config
  from distca_jax.sim import make_simulator, points

  print(f"\ncad_machinery={machinery} (one GPU)\n| cad_exchange_fixed | cad_ms_per_gb | "
        f"RMS error of the speedup | mean | max |\n|---|---|---|---|---|")
  for fixed, per_gb in itertools.product((0.0, 0.005, 0.01, 0.02), (0.0, 5.0, 7.0, 16.6)):
    cfg = load_sim_config(None, SIM_ARGS + [f"cad_machinery={machinery}",
                                            f"cad_exchange_fixed={fixed}", f"cad_ms_per_gb={per_gb}"])
    err = []
    for point in points(cfg):
      sim = make_simulator(cfg, point)
      for (dist, step), (col, cad) in MEASURED.items():
        if dist == point.distribution:
          r, _ = sim.batch(step)
          err.append(r["colocated"].iter_s / r["cad"].iter_s - col / cad)
    err = np.asarray(err)
    print(f"| {fixed} | {per_gb} | {np.sqrt((err ** 2).mean()):.4f} | {err.mean():+.4f} | "
          f"{np.abs(err).max():.4f} |")


def main() -> None:
  import argparse

  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--from", dest="files", nargs="*", default=[],
                  help="bench_train.py --suite cad --json files whose sampled batches join the "
                       "fit (their setup: --devices and --set)")
  ap.add_argument("--devices", type=int, default=DEVICES, help="devices of the --from runs")
  ap.add_argument("--set", nargs="*", default=list(SETUP),
                  help="config overrides of the --from runs (model, tokens per device)")
  ap.add_argument("--expect", type=int, default=0, metavar="STEPS",
                  help="predict gated runs over this many sampled steps (see expect())")
  ap.add_argument("--expect-devices", type=int, nargs="*", default=[4, 2])
  ap.add_argument("--expect-set", nargs="*", default=[],
                  help="config overrides for --expect (e.g. data.tokens_per_device=131072)")
  ap.add_argument("--expect-per-node", type=int, default=0, metavar="N",
                  help="--expect with N data ranks per node (attention.data_rank_nodes; 0: one node)")
  ap.add_argument("--machinery", type=float, default=None, metavar="F",
                  help="CAD's machinery held in the fit, a fraction of the matmul time, as one "
                       "GPU measures it for the code the batches ran (bench_train.py --suite "
                       "overhead; default: the shipped batches'); the written profile charges it")
  ap.add_argument("--sim", action="store_true",
                  help="also calibrate the simulator's CAD cost terms on the same batches")
  ap.add_argument("--sim-machinery", type=float, default=gate.FIT_MACHINERY, metavar="F",
                  help="--sim: cad_machinery, as measured on one GPU (bench_train.py --suite "
                       "overhead: CAD's step over colocated's, less one, over the linear time; "
                       "default: the shipped batches' code's)")
  ap.add_argument("--logs", nargs=2, action="append", default=[], metavar=("COLOCATED", "DISTCA"),
                  help="two launch/train.py logs of the same sampled steps (gpu_session.sh "
                       "gaterun): each CAD step that neither run compiled joins the fit (their "
                       "setup: --devices and --set, data.distribution included)")
  ap.add_argument("--kernel-logs", nargs="*", default=[], metavar="LOG",
                  help="one-device colocated launch/train.py logs of the same steps, one per "
                       "attention kernel, the one the shipped costs were fit with first (their "
                       "setup: --set); see kernel_cost()")
  ap.add_argument("--no-fit", action="store_true",
                  help="skip the 4-GPU fit (e.g. with --kernel-logs or --expect)")
  ap.add_argument("--write-profile", metavar="PATH",
                  help="write the fit as a cost profile a run loads (attention.gate_profile=PATH)")
  args = ap.parse_args()
  if args.kernel_logs:
    kernel_cost(args.kernel_logs, tuple(args.set))
  if not args.no_fit:
    extra = from_bench_json(args.files, args.devices, tuple(args.set))
    if args.files:
      print(f"{len(extra)} measured pairs from {', '.join(args.files)} join the fit")
    for col, cad in args.logs:
      pairs = from_train_logs(col, cad, args.devices, tuple(args.set))
      print(f"{len(pairs)} CAD steps from {col} / {cad} join the fit")
      extra += pairs
    fitted = fit(extra=extra, machinery=args.machinery)
    if args.write_profile:
      write_profile(args.write_profile, fitted)
  if args.expect:
    expect(args.expect, args.expect_devices, args.expect_set, args.expect_per_node)
  if args.sim:
    fit_simulator(args.sim_machinery)


def write_profile(path, fitted: dict) -> dict:
  """Writes `fit`'s costs as a cost profile (`gate.read_profile`'s format) at `path`: the fit's
  kernel's attention cost, and each other kernel's scaled by its measured ratio
  (`KERNEL_COST_RATIO`); the machinery held and the exchange's two costs; the shipped price of a byte between nodes (not
  fitted: the measurements are one node's). Returns it."""
  import json
  from pathlib import Path

  shipped = gate.read_profile()
  att = fitted["attention_cost"]
  profile = {
      "about": "A cost profile of the step gate, written by launch/fit_gate.py --write-profile "
               "(attention.gate_profile loads it; distca_jax/gate_fit.json says what each field is).",
      "fit_kernel": gate.GATE_FIT_KERNEL,
      "attention_cost": {gate.GATE_FIT_KERNEL: att,
                         **{k: att * r for k, r in KERNEL_COST_RATIO.items()}},
      "machinery": fitted["machinery"],
      "exchange_fixed": fitted["exchange_fixed"],
      "exchange_flops_per_byte": fitted["exchange_flops_per_byte"],
      "network_byte_cost": shipped["network_byte_cost"],
  }
  Path(path).write_text(json.dumps(profile, indent=2) + "\n")
  print(f"wrote the cost profile {path}: run with attention.gate_profile={path}")
  return profile


def kernel_cost(paths, setup: tuple) -> list[dict]:
  """Each attention kernel's cost in training steps, from one-device colocated `launch/train.py`
  logs of the same sampled steps (`gpu_session.sh kfit`): per log, the uncompiled steps' times
  fit as c_lin x matmul FLOPs + c_att x attention FLOPs (least squares; the batches' attention
  area varies, their tokens do not), printed with `gate_attention_cost` scaled by c_att over the
  first log's. The step gate's costs were fit with the first log's kernel; a kernel that runs
  attention faster (per FLOP) in a step leaves less for CAD to balance. Returns the fits."""
  import os

  from distca_jax.config import load_config
  from distca_jax.data.sources import synthetic_from_config
  from distca_jax.models.presets import resolve

  cfg = load_config(None, list(SETUP) + list(setup))
  shape = resolve(cfg.model)
  src = synthetic_from_config(cfg.data, shape.vocab_size, 1)
  fits = []
  print("| kernel log | steps | matmul TF/s | attention TF/s | step ms (min-max) | fit RMS ms "
        "| attention per FLOP vs first | gate_attention_cost |\n|---|---|---|---|---|---|---|---|")
  for path in paths:
    steps = {s: v for s, v in gate_fitting.read_step_log(path).items() if not v["compiled"]}
    if len(steps) < 3:
      raise SystemExit(f"{path}: {len(steps)} uncompiled steps, too few to fit")
    # Log step s trained on the sampler's batch s - 1.
    flops = np.array([[f.max() for f in gate.colocated_flops(shape, src.batch(s - 1).layout)]
                      for s in steps])
    ms = np.array([v["step_s"] * 1e3 for v in steps.values()])
    try:
      c_lin, c_att, rms = gate_fitting.fit_kernel_cost(flops, ms)
    except ValueError as e:
      raise SystemExit(f"{path}: {e}") from None
    fits.append(dict(path=path, steps=len(ms), c_lin=c_lin, c_att=c_att, rms=rms))
    ratio = c_att / fits[0]["c_att"]
    print(f"| {os.path.basename(path)} | {len(ms)} | {1e-9 / c_lin:.0f} | {1e-9 / c_att:.0f} | "
          f"{ms.min():.0f}-{ms.max():.0f} | {rms:.1f} | {ratio:.3f} | "
          f"{gate.gate_attention_cost(cfg.attention, gate.GATE_FIT_KERNEL) * ratio:.3g} |")
  return fits


def from_bench_json(paths, devices: int, setup: tuple) -> list[tuple]:
  """Measured pairs from `bench_train.py --suite cad --json` files: per sampled batch
  (`pretrain`, `prolong@3`, ...), colocated's step and CAD's (`distca-ungated`, or `distca` when
  it ran CAD rather than being gated). Batches of other kinds (skewed, uniform) are skipped."""
  import json

  out = []
  for path in paths:
    rows = json.load(open(path))
    for kind in dict.fromkeys(r["batch"] for r in rows):
      dist, _, step = kind.partition("@")
      if dist not in ("pretrain", "prolong"):
        continue
      by = {r["variant"]: r for r in rows if r["batch"] == kind}
      cad = by.get("distca-ungated") or (by["distca"] if by.get("distca", {}).get("cad_ran")
                                         else None)
      if "colocated" in by and cad is not None:
        out.append((devices, setup, dist, int(step or 0), by["colocated"]["median_s"] * 1e3,
                    cad["median_s"] * 1e3))
  return out


def from_train_logs(colocated_log: str, distca_log: str, devices: int, setup: tuple) -> list[tuple]:
  """Measured pairs from two `launch/train.py` logs of the same sampled steps (colocated, and
  distca with its gate): per step on which CAD ran and neither run compiled, both step times and
  the rows per exchanged block the step ran with (its run's grown capacities, which set the
  tiled exchange's bytes): `c`, `ckv` and, for the relayed K/V round, `ckv2`. The trainer logs
  `exchange_kv2_rows` only while its run has that round; a step without it keeps `ckv2` None,
  and the fit takes the step's own plan's instead: 0 when the run had no relayed round (its
  capacities only grow, so no step's plan needed one), the step's own need on a log written
  before the trainer logged the round. Log step s trained on the sampler's batch s - 1; the
  distribution is `data.distribution` in `setup` (default: the config's)."""
  from distca_jax.config import load_config
  from distca_jax.schedule.capacities import Capacities

  dist = load_config(None, list(setup)).data.distribution
  rest = tuple(o for o in setup if not o.startswith("data.distribution="))
  col, cad = gate_fitting.read_step_log(colocated_log), gate_fitting.read_step_log(distca_log)
  out = []
  for s in sorted(col.keys() & cad.keys()):
    c, d = col[s], cad[s]
    if c["compiled"] or d["compiled"] or d.get("cad") != 1.0:
      continue
    rows = lambda k: f"{TILED.log_prefix}_{k}_rows"  # the tiled exchange's logged capacities
    if rows("q") not in d:  # another transport's capacities (`Transport.log_rows`)
      raise SystemExit(f"{distca_log}: step {s} ran CAD without the tiled exchange's capacities "
                       f"({rows('q')}): --logs fits the gate's exchange costs on "
                       "attention.exchange=tiled runs")
    kv2 = d.get(rows("kv2"))
    caps = Capacities(c=int(d[rows("q")]), ckv=int(d[rows("kv")]),
                      ckv2=None if kv2 is None else int(kv2))
    out.append((devices, rest, dist, s - 1, c["step_s"] * 1e3, d["step_s"] * 1e3, caps))
  return out


def logged_over(own, logged):
  """`own` capacities (a step's plan's) with each size `logged` gives (not None) in its place."""
  return dataclasses.replace(own, **{
      f.name: getattr(logged, f.name) for f in dataclasses.fields(logged)
      if getattr(logged, f.name) is not None})


def fit(verbose: bool = True, extra=(), machinery: float | None = None) -> dict:
  """The fit above (`gate_fitting.fit_step_costs`), over MEASURED and `extra` ((devices, overrides,
  distribution, step, colocated ms, CAD ms[, capacities]) tuples), CAD's machinery held at
  `machinery` (None: what one GPU measured for the code the shipped batches ran); prints it (and the per-batch
  table) when `verbose`. Returns the cost profile's fitted costs (`attention_cost` of the fit's
  kernel, `machinery`, `exchange_fixed`, `exchange_flops_per_byte`: `StepCostFit.costs`) and,
  per batch, the measured and the shipped gate's predicted saving (fractions of the colocated
  step)."""
  from distca_jax import dispatch
  from distca_jax.config import load_config
  from distca_jax.data.sources import synthetic_from_config
  from distca_jax.models.presets import resolve

  entries = [(DEVICES, SETUP, d, s, col, cad, None) for (d, s), (col, cad) in MEASURED.items()]
  rows, batches = [], []
  for devices, setup, dist, step, col, cad, *caps in list(entries) + list(extra):
    cfg = load_config(None, list(setup) + ["attention.impl=distca", "attention.gate=false"])
    shape = resolve(cfg.model)
    batch = synthetic_from_config(dataclasses.replace(cfg.data, distribution=dist),
                                  shape.vocab_size, devices).batch(step)
    ctx = dispatch.plan_step(cfg.attention, batch, shape)
    planned = sum(p.stats.load_after for p in ctx.plans)
    linear, attn = gate.colocated_flops(shape, batch.layout)
    # The exchange at the capacities the step ran with: a training run's grown ones where its
    # log says (from_train_logs), else the step's own (a benchmark compiles each batch).
    ran = logged_over(ctx.capacities, caps[0]) if caps and caps[0] else ctx.capacities
    moved_bytes = gate.exchange_bytes(cfg.attention, shape, ctx.plans, ran).max() * shape.layers
    batches.append(gate_fitting.FitBatch(
        colocated_ms=col, distca_ms=cad, linear_flops=linear.max(), attention_flops=attn.max(),
        planned_flops=gate.model_flops(shape).attention_per_area * planned.max(),
        exchange_bytes=moved_bytes))
    rows.append(dict(
        batch=f"{dist}@{step}" + ("" if (devices, setup) == (DEVICES, SETUP) else f" ({devices} dev)"),
        imb=gate.imbalance(attn),
        gain=gate.predicted_cad_gain(shape, batch.layout, attention_config=cfg.attention),
        moved=int(sum(p.traffic.q_rows_out.sum() + p.traffic.kv_rows_out.sum() for p in ctx.plans)),
        predicted=ctx.predicted_saving, attention=cfg.attention))
  if machinery is None:
    machinery = gate.FIT_MACHINERY
  result = gate_fitting.fit_step_costs(batches, machinery)
  say = print if verbose else (lambda *a, **k: None)
  say(f"colocated step = matmul FLOPs at {1e-9 / result.ms_per_linear_flop:.0f} TF/s + attention "
      f"FLOPs at {1e-9 / result.ms_per_attention_flop:.0f} TF/s (effective)")
  say(f"CAD's overhead = ({result.machinery:.4f} machinery, held + {result.exchange_fixed:.4f} "
      f"exchange calls) x the matmul time + "
      f"{result.exchange_ms_per_byte * 1e9:.3f} ms per GB the busiest device moves (residuals "
      f"{result.max_residual_ms:.0f} ms at most)")
  fitted = result.costs
  shipped = gate.costs(rows[0]["attention"])  # the profile's, of the kernel these batches ran
  say("fitted:  " + " ".join(f"{k}={v:.4g}" for k, v in fitted.items()))
  say("shipped: " + " ".join(f"{k}={getattr(shipped, k):.4g}" for k in fitted) + "\n")
  out = dict(fitted, batches={})
  say("| batch | imbalance | predicted gain | rows moved | fitted step ms | measured saving "
      "| net saving, leave-one-out | predicted_cad_saving |")
  say("|---|---|---|---|---|---|---|---|")
  for i, (r, b) in enumerate(zip(rows, batches)):
    saved = result.measured_saving_ms[i] / b.colocated_ms
    out["batches"][r["batch"]] = (saved, r["predicted"])
    say(f"| {r['batch']} | {r['imb']:.2f} | {r['gain']:.3f} | {r['moved']:,} | "
        f"{result.fitted_colocated_ms[i]:.0f} (measured {b.colocated_ms:.0f}) | {saved:+.1%} | "
        f"{result.leave_one_out_saving_ms[i] / b.colocated_ms:+.1%} | {r['predicted']:+.1%} |")
  return out


if __name__ == "__main__":
  main()
