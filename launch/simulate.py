"""At-scale simulation of core attention disaggregation against its baselines.

  python launch/simulate.py [--config configs/sim_<name>.yaml] [key=value ...] [--dump-plans DIR]

Runs every point of the sweep (models × gpus × tokens_per_rank × distributions ×
pipeline_parallel, or the union of `sweeps`) on `batches` sampled batches and prints one table
row per point and system: pipeline stages and micro-batches with the schedule's bubble fraction
(4D), compute (attention) imbalance, memory imbalance, bytes per device per layer, the fraction
of batches whose communication hides under compute, for CAD the most remote shards one server
computes next to the Appendix-A bound on shards in flight with communication hidden, the
fraction of GPU time not computing, predicted step time, and CAD's speedup over the system.
Writes `out_dir/sim.csv`, `out_dir/loads.png` (per-rank attention load before/after scheduling,
first point, first batch) and `out_dir/speedup.png` (speedup against GPU count).
The model behind the numbers: distca_jax/sim/engine.py; against the paper: docs/SIMULATOR.md.

Settings: the defaults below, then the `--config` YAML file, then `field=value` overrides (values
read as YAML: `gpus=[64,128]`; one value is a list of one). `--print-config` prints the resolved
configuration as YAML and exits. A bad value is one `config error: <field>: ...` line, exit 2.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

from distca_jax.schedule.relay import AUTO_FANOUT
from distca_jax.schema import ConfigError, check_writable_dir
from distca_jax.schema_io import describe, to_yaml
from distca_jax.sim.config import SimConfig, load_sim_config
from distca_jax.sim import SYSTEMS, make_simulator, points, summarize


def _relay_note(fanout) -> str:
  if fanout == "auto":
    return (f", K/V relay auto ({AUTO_FANOUT} slices in a second round where the servers span "
            "nodes, none on tiled)")
  return f", K/V relayed with fanout {fanout} in a second round" if fanout else ", no K/V relay"


def main(argv=None) -> int:
  schema = "\n".join(["configuration (distca_jax/sim/config.py; type, [default], the field's "
                      "comment):", ""] + describe(SimConfig))
  ap = argparse.ArgumentParser(description=__doc__, epilog=schema,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default=None, help="YAML file overriding distca_jax/sim/config.py")
  ap.add_argument("--print-config", action="store_true",
                  help="print the resolved configuration as YAML and exit (nothing runs)")
  ap.add_argument("--dump-plans", default=None, metavar="DIR",
                  help="write each CAD plan as JSON (format: schedule/plan.py Plan.dump_json)")
  ap.add_argument("--per-batch", action="store_true",
                  help="also print each batch's colocated and CAD step time (batch k is the "
                       "trainer's batch of step k with the same data settings: "
                       "bench_train.py's <distribution>@k), and CAD's speedup by colocated "
                       "imbalance over all batches")
  ap.add_argument("overrides", nargs="*", help="key=value, e.g. gpus=[64,128] epsilon=0.1")
  args = ap.parse_args(argv)
  try:
    cfg = load_sim_config(args.config, args.overrides)
    if args.dump_plans:
      check_writable_dir("--dump-plans", args.dump_plans)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  if args.print_config:
    print(to_yaml(cfg), end="")
    return 0
  out_dir = Path(cfg.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  dump = Path(args.dump_plans) if args.dump_plans else None
  if dump:
    dump.mkdir(parents=True, exist_ok=True)

  pts = points(cfg)
  total = len(pts) * cfg.batches
  bar = None
  if cfg.progress and total > 1:
    from tqdm import tqdm
    bar = tqdm(total=total, desc="simulate", unit="batch", file=sys.stderr)
  rows, first_loads, speedups, by_imbalance = [], None, [], []
  transports = {}  # each transport the points ran on, and why
  for p in pts:
    sim = make_simulator(cfg, p)
    pp = p.pipeline
    results = []
    for b in range(cfg.batches):
      res, loads = sim.batch(b, dump)
      results.append(res)
      if args.per_batch:
        col, cad = res["colocated"], res["cad"]
        by_imbalance.append((col.compute_imbalance, col.iter_s / cad.iter_s))
        name = f"{p.model} {p.gpus} GPUs pp {pp} {p.tokens_per_rank} {Path(p.distribution).stem}"
        print(f"{name}@{b}: "
              f"attention imbalance {col.compute_imbalance:.2f} -> {cad.compute_imbalance:.2f}, "
              f"colocated {col.iter_s * 1e3:.0f} ms, CAD {cad.iter_s * 1e3:.0f} ms, "
              f"x{col.iter_s / cad.iter_s:.3f}", file=sys.stderr if bar else sys.stdout)
      if first_loads is None:
        first_loads = (p, loads)
      if bar:
        bar.update(1)
    summary = summarize(results)
    for name in SYSTEMS:
      s = summary[name]
      rows.append({"model": p.model, "gpus": p.gpus, "tp": cfg.tensor_parallel, "pp": pp,
                   "microbatches": cfg.microbatches_for(pp), "bubble": getattr(sim, "bubble", 0.0),
                   "tokens_per_rank": p.tokens_per_rank, "distribution": Path(p.distribution).stem,
                   "system": name, **{k: s[k] for k in s}, "appendix_a_bound": sim.appendix_a_s,
                   "kv_relay_fanout": sim.relay.fanout if sim.relay else 0,
                   "exchange": sim.transport.name})
    transports[sim.transport] = sim.transport_reason
    speedups.append((p, summary))
  if bar:
    bar.close()

  print("CAD's exchange modelled as " + ", ".join(f"{t.name!r} ({t.carries}; {why})"
                                                 for t, why in transports.items())
        + _relay_note(cfg.kv_relay_fanout)
        + (f"; CAD overheads {cfg.cad_machinery} (machinery) + {cfg.cad_exchange_fixed} "
           f"(exchange calls) of linear time + {cfg.cad_ms_per_gb} ms/GB"
           if cfg.cad_machinery or cfg.cad_exchange_fixed or cfg.cad_ms_per_gb
           else "; no CAD overhead terms (ideal)"))
  _print_table(rows)
  if by_imbalance:
    print("\nCAD (ungated) over colocated by colocated attention imbalance, all batches:")
    for line in gate_table(by_imbalance):
      print(line)
  with open(out_dir / "sim.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  _plots(out_dir, first_loads, speedups)
  print(f"\nwrote {out_dir / 'sim.csv'}, {out_dir / 'loads.png'}, {out_dir / 'speedup.png'}"
        + (f", plans in {dump}" if dump else ""))
  return 0


GATE_BINS = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.75, 2.0, 2.5, 3.0, float("inf"))


def gate_table(pairs, bins=GATE_BINS) -> list[str]:
  """Markdown rows: per bin of colocated imbalance, the batches in it and the median (min-max) of
  CAD's speedup. `pairs`: (colocated imbalance, CAD speedup) per batch."""
  imb = np.array([p[0] for p in pairs])
  speedup = np.array([p[1] for p in pairs])
  out = ["| colocated imbalance | batches | CAD speedup: median (min-max) |", "|---|---|---|"]
  for lo, hi in zip(bins[:-1], bins[1:]):
    s = speedup[(imb >= lo) & (imb < hi)]
    if s.size:
      out.append(f"| {lo:.2f}-{hi:.2f} | {s.size} | {np.median(s):.3f} "
                 f"({s.min():.3f}-{s.max():.3f}) |")
  return out


def _print_table(rows):
  head = (f"{'model':<10} {'gpus':>5} {'pp':>3} {'M':>3} {'bubble':>6} {'T':>7} {'dist':<9} "
          f"{'system':<11} {'cp':>3} {'attn-imb':>8} {'mem-imb':>7} {'MB/layer':>9} {'hidden':>6} "
          f"{'shards':>9} {'idle':>5} {'step s':>7} {'CAD x':>6}")
  print(head)
  print("-" * len(head))
  for r in rows:
    shards = f"{r['shards_max']}/{r['appendix_a_bound']:.0f}" if r["system"] == "cad" else ""
    print(f"{r['model']:<10} {r['gpus']:>5} {r['pp']:>3} {r['microbatches']:>3} {r['bubble']:>6.3f} "
          f"{r['tokens_per_rank']:>7} {r['distribution']:<9} "
          f"{r['system']:<11} {r['cp']:>3} {r['compute_imbalance']:>8.3f} {r['memory_imbalance']:>7.3f} "
          f"{r['bytes_per_layer_mb']:>9.1f} {r['hidden_frac']:>6.2f} {shards:>9} {r['idle_frac']:>5.2f} "
          f"{r['iter_s']:>7.3f} {r['cad_speedup']:>6.3f}")


def _plots(out_dir: Path, first_loads, speedups):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  p, loads = first_loads
  fig, ax = plt.subplots(figsize=(8, 3.5))
  x = np.arange(loads["before"].size)
  mean = loads["before"].mean()
  ax.bar(x, loads["before"] / mean, color="#bbb", label="colocated (before)")
  ax.plot(x, loads["after"] / mean, "o-", color="C0", ms=3, label="CAD (after)")
  ax.axhline(1.0, color="k", lw=0.8, ls="--")
  ax.set_xlabel("rank (attention server)")
  ax.set_ylabel("attention load / mean")
  pp = f", PP {p.pipeline}" if p.pipeline > 1 else ""
  ax.set_title(f"{p.model}, {p.gpus} GPUs{pp}, {p.tokens_per_rank} tokens/rank, {Path(p.distribution).stem}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(out_dir / "loads.png", dpi=120)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6, 4))
  groups = {}
  for pt, s in speedups:
    groups.setdefault((pt.model, pt.tokens_per_rank, Path(pt.distribution).stem, pt.pipeline),
                      []).append((pt.gpus, s))
  for (m, t, d, pp), items in groups.items():
    items.sort()
    g = [i[0] for i in items]
    for name, style in (("wlb_best", "o-"), ("per_doc_cp", "s--")):
      ax.plot(g, [i[1][name]["cad_speedup"] for i in items], style,
              label=f"{m} {t // 1024}K {d}{f' PP{pp}' if pp > 1 else ''} vs {name}")
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("GPUs")
  ax.set_ylabel("CAD speedup (predicted)")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out_dir / "speedup.png", dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
