"""Fit the CAD step gate's cost model to measured step times (docs/PERFORMANCE.md, "The step gate").

    python launch/fit_gate.py [--expect 50] [--sim]

CPU only. For each measured batch (4 x H100, Llama-3-8B shape with 2 layers, 64K tokens per
device; colocated and distca step ms from `bench_train.py --suite cad`) it rebuilds the batch
from the sampler, fits the colocated step time as c0 + k x (the slowest device's attention
area), prints `metrics.predicted_cad_gain` beside the measured saving, then plans the batch as
the trainer does (ping-pong on), counts the rows that cross devices, fits the exchange overhead
as a + b x rows, and predicts each batch's net saving from a fit of the others (leave-one-out).
`--expect N`: then, for the sampler's first N batches of each distribution on 4 and 2 devices,
the gate's decisions and the speedup its predictions give over those N steps (a prediction from
the fitted model, not a measurement). `--sim`: the simulator's own cost terms fit to the same
batches.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# (distribution, sampler step) -> (colocated ms, distca ms with CAD running), same process each.
MEASURED = {
    ("pretrain", 0): (1548.6, 1592.2), ("pretrain", 1): (1546.2, 1577.0),
    ("pretrain", 2): (2739.5, 1992.7), ("prolong", 0): (2156.4, 1899.9),
    ("prolong", 1): (2204.2, 1833.1), ("prolong", 2): (1978.2, 1829.1),
    ("prolong", 32): (2259.0, 2210.0), ("pretrain", 38): (1616.9, 1647.9),
    ("prolong", 14): (1603.4, 1639.1), ("pretrain", 29): (2327.0, 2144.9),
    ("pretrain", 46): (1618.7, 1632.0), ("pretrain", 60): (1601.3, 1600.1),
    ("pretrain", 79): (1819.3, 1849.4), ("prolong", 58): (2032.8, 2041.5),
}
DEVICES = 4


def expect(steps: int) -> None:
  """Share of steps the gate gives CAD, and the predicted speedup of the gated run over the
  colocated one summed over `steps` sampled batches."""
  from distca_jax import dispatch
  from distca_jax.config import load_config
  from distca_jax.data.sources import synthetic_from_config
  from distca_jax.models.presets import resolve
  from distca_jax.train import metrics

  cfg = load_config(None, ["model.preset=llama3_8b", "model.layers=2", "data.length_scale=1",
                           "data.tokens_per_device=65536", "attention.impl=distca",
                           "attention.gate=false"])
  shape = resolve(cfg.model)
  per_area = (3.5 * cfg.attention.gate_attention_cost * 4.0 * shape.head_dim * shape.heads
              * shape.layers)
  print(f"\n| devices | batches | CAD on | predicted speedup over {steps} steps |\n|---|---|---|---|")
  for n in (4, 2):
    for dist in ("pretrain", "prolong"):
      data = dataclasses.replace(cfg.data, distribution=dist)
      src = synthetic_from_config(data, shape.vocab_size, n)
      colocated, gated, cad = 0.0, 0.0, 0
      for step in range(steps):
        layout = src.batch(step).layout
        saving = metrics.predicted_cad_saving(
            shape, layout, dispatch.host_context(cfg.attention, src.batch(step), shape).plans,
            cfg.attention)
        tokens = np.bincount(layout.buffer, weights=layout.length, minlength=n)
        t = (3.0 * shape.matmul_flops_per_token() * tokens
             + per_area * metrics.attention_load_per_device(layout)).max()
        runs_cad = saving >= cfg.attention.min_gain
        colocated += t
        gated += t * (1 - saving) if runs_cad else t
        cad += runs_cad
      print(f"| {n} | {dist} | {cad / steps:.0%} | {colocated / gated:.3f} |")


SIM_ARGS = ["gpus=[4]", "tensor_parallel=1", "pipeline_parallel=[1]", "tokens_per_rank=[65536]",
            "distributions=[pretrain,prolong]", "batches=80", "elongate_factor=1", "exchange=tiled",
            "layers=2", "hardware.linear_tflops=250",
            "hardware.time_table=kernels/tables/NVIDIA_H100_triton.json", "progress=false"]


def fit_simulator() -> None:
  """The simulator's own calibration terms (`cad_fixed_overhead`, `cad_ms_per_gb`) on the same
  batches: a grid of both, each scored by the RMS error of the simulated CAD speedup against the
  measured one (the simulator's attention model is not the gate's, so its terms differ)."""
  import itertools

  from distca_jax.sim.config import load_sim_config
  from distca_jax.sim.engine import make_simulator, points

  print(f"\n| cad_fixed_overhead | cad_ms_per_gb | RMS error of the speedup | mean | max |\n"
        f"|---|---|---|---|---|")
  for fixed, per_gb in itertools.product((0.0, 0.01, 0.02, 0.025), (0.0, 5.0, 7.0, 16.6)):
    cfg = load_sim_config(None, SIM_ARGS + [f"cad_fixed_overhead={fixed}",
                                            f"cad_ms_per_gb={per_gb}"])
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
  ap.add_argument("--expect", type=int, default=0)
  ap.add_argument("--sim", action="store_true",
                  help="also calibrate the simulator's CAD cost terms on the same batches")
  args = ap.parse_args()
  fit()
  if args.expect:
    expect(args.expect)
  if args.sim:
    fit_simulator()


def fit(verbose: bool = True) -> dict:
  """The fit above; prints it (and the per-batch table) when `verbose`. Returns the cost model
  it implies (`attention.gate_attention_cost`, `gate_exchange_fixed`,
  `gate_exchange_flops_per_byte`) and, per batch, the measured and the shipped gate's predicted
  saving (fractions of the colocated step)."""
  from distca_jax import dispatch
  from distca_jax.config import load_config
  from distca_jax.data.sources import synthetic_from_config
  from distca_jax.models.presets import resolve
  from distca_jax.train import metrics

  cfg = load_config(None, ["model.preset=llama3_8b", "model.layers=2", "data.length_scale=1",
                           "data.tokens_per_device=65536", "attention.impl=distca",
                           "attention.gate=false"])
  shape = resolve(cfg.model)
  rows = []
  for (dist, step), (col, cad) in MEASURED.items():
    data = dataclasses.replace(cfg.data, distribution=dist)
    batch = synthetic_from_config(data, shape.vocab_size, DEVICES).batch(step)
    area = metrics.attention_load_per_device(batch.layout)
    ctx = dispatch.host_context(cfg.attention, batch, shape)
    planned = sum(p.stats.load_after for p in ctx.plans)
    off = ~np.eye(DEVICES, dtype=bool)
    moved = sum(int(np.asarray(d.send_q_valid)[off].sum() + np.asarray(d.send_kv_valid)[off].sum())
                for d in ctx.dispatch)
    dev_bytes = sum(p.traffic.send + p.traffic.recv for p in ctx.plans).max() * shape.layers
    tokens = np.bincount(batch.layout.buffer, weights=batch.layout.length, minlength=DEVICES)
    rows.append(dict(batch=f"{dist}@{step}", col=col, cad=cad, gain=metrics.predicted_cad_gain(
        shape, batch.layout), imb=metrics.imbalance(area), max=area.max(), planned=planned.max(),
                     moved=moved, bytes=dev_bytes, plans=ctx.plans, layout=batch.layout,
                     linear=3.0 * shape.matmul_flops_per_token() * tokens.max()))
  c0, k = np.linalg.lstsq(np.array([[1.0, r["max"]] for r in rows]),
                          np.array([r["col"] for r in rows]), rcond=None)[0]
  say = print if verbose else (lambda *a, **k: None)
  say(f"colocated step ms = {c0:.1f} + {k * 1e9:.1f} per 1e9 attention area of the slowest device")
  ideal = np.array([k * (r["max"] - r["planned"]) for r in rows])
  saved = np.array([r["col"] - r["cad"] for r in rows])
  X = np.array([[1.0, r["moved"]] for r in rows])
  a, b = np.linalg.lstsq(X, ideal - saved, rcond=None)[0]
  say(f"exchange overhead ms = {a:.1f} + {b * 1e3:.3f} per 1000 rows moved (all devices)")
  # The same against the busiest device's bytes (what the gate uses: it holds for any device
  # count), in the units of metrics.predicted_cad_saving: matmul FLOPs of the step.
  Xb = np.array([[1.0, r["bytes"]] for r in rows])
  ab, bb = np.linalg.lstsq(Xb, ideal - saved, rcond=None)[0]
  resid = ideal - saved - Xb @ np.array([ab, bb])
  flops_per_ms = rows[0]["linear"] / c0
  ratio = k * flops_per_ms / (3.5 * 4.0 * shape.head_dim * shape.heads * shape.layers)
  say(f"exchange overhead ms = {ab:.1f} + {bb * 1e9:.3f} per GB the busiest device moves "
      f"(residuals {np.abs(resid).max():.0f} ms at most)")
  a = cfg.attention
  say(f"fitted: attention.gate_attention_cost={ratio:.3f} attention.gate_exchange_fixed="
      f"{ab / c0:.4f} attention.gate_exchange_flops_per_byte={bb * flops_per_ms:.4g}")
  say(f"shipped: attention.gate_attention_cost={a.gate_attention_cost} "
      f"attention.gate_exchange_fixed={a.gate_exchange_fixed} "
      f"attention.gate_exchange_flops_per_byte={a.gate_exchange_flops_per_byte:.4g}\n")
  X = Xb
  out = dict(gate_attention_cost=ratio, gate_exchange_fixed=ab / c0,
             gate_exchange_flops_per_byte=bb * flops_per_ms, batches={})
  say("| batch | imbalance | predicted gain | rows moved | fitted step ms | measured saving "
        "| net saving, leave-one-out | predicted_cad_saving |")
  say("|---|---|---|---|---|---|---|---|")
  for i, r in enumerate(rows):
    keep = np.arange(len(rows)) != i
    ai, bi = np.linalg.lstsq(X[keep], (ideal - saved)[keep], rcond=None)[0]
    net = ideal[i] - ai - bi * r["bytes"]
    shipped = metrics.predicted_cad_saving(shape, r["layout"], r["plans"], cfg.attention)
    out["batches"][r["batch"]] = (saved[i] / r["col"], shipped)
    say(f"| {r['batch']} | {r['imb']:.2f} | {r['gain']:.3f} | {r['moved']:,} | "
        f"{c0 + k * r['max']:.0f} (measured {r['col']:.0f}) | {saved[i] / r['col']:+.1%} | "
        f"{net / r['col']:+.1%} | {shipped:+.1%} |")
  return out


if __name__ == "__main__":
  main()
