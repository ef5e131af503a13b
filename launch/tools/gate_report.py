"""Compare two `launch/train.py` runs of the same sampled batches step by step: colocated
attention against distca with its gate (`bash launch/gpu_session.sh gaterun` writes both logs).

    python launch/tools/gate_report.py colocated.log distca.log

Reads each run's per-step log lines (`step N: ... step_s=... compile_count=... cad=...`, written
with `train.progress=false`; `gate_fitting.read_step_log`), keeps the steps on which neither run
compiled, and prints the run-level speedup (sum of colocated step times over the sum of distca's), the same over the steps
the gate gave CAD and over those it kept colocated, and how often each happened; then, over the
steps CAD ran, the gate's predicted saving (`cad_predicted_saving`) against the measured one,
overall and, where the CAD steps ran at more than one exchange shape (the logged capacities
`exchange_q_rows`, `exchange_kv_rows`, the relayed round's `exchange_kv2_rows` when the run
has one, or the ragged exchange's `exchange_send_*`, and
`nano_batches`, which only grow over a run), per shape:
a cost the gate's model misses that grows with the padded blocks shows there; and
how long the two runs' losses agree (same batches, same initialisation: the same function, until
bf16 rounding, which the optimizer carries on, sets them apart).
"""

from __future__ import annotations

import sys

import numpy as np

from distca_jax.gate_fitting import read_step_log as read
from distca_jax.schedule.transport import TRANSPORTS


def exchange_shape(values: dict) -> tuple[int, int, int, int]:
  """(query rows, K/V rows, relayed K/V rows, nano-batches) of a logged CAD step: its exchange
  capacities under its transport's prefix (each value compiles the step once). A log without the
  relayed K/V round has no ..._kv2_rows: read as 0."""
  prefix = next((t.log_prefix for t in TRANSPORTS.values() if f"{t.log_prefix}_q_rows" in values),
                "exchange")
  return (*(int(values.get(f"{prefix}_{k}_rows", 0)) for k in ("q", "kv", "kv2")),
          int(values.get("nano_batches", 0)))

# Logged losses carry four significant digits.
LOSS_TOLERANCE = 1e-3


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 2:
    print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
    return 2
  col, cad = read(argv[0]), read(argv[1])
  both = sorted(s for s in col.keys() & cad.keys()
                if not col[s]["compiled"] and not cad[s]["compiled"])
  if not both:
    print("no step ran uncompiled in both runs", file=sys.stderr)
    return 1
  print(f"{len(both)} steps timed in both runs (of {len(col)} / {len(cad)})")
  print("| steps | count | colocated s | distca s | speedup |\n|---|---|---|---|---|")
  for name, pick in (("all", lambda s: True), ("CAD ran", lambda s: cad[s].get("cad") == 1.0),
                     ("gated (colocated)", lambda s: cad[s].get("cad") == 0.0)):
    chosen = [s for s in both if pick(s)]
    if chosen:
      a = sum(col[s]["step_s"] for s in chosen)
      b = sum(cad[s]["step_s"] for s in chosen)
      print(f"| {name} | {len(chosen)} | {a:.2f} | {b:.2f} | {a / b:.3f} |")
  # The gate's prediction against the step it predicted, on the steps CAD ran.
  cad_steps = [s for s in both if cad[s].get("cad") == 1.0 and "cad_predicted_saving" in cad[s]]
  pairs = np.array([(cad[s]["cad_predicted_saving"], 1 - cad[s]["step_s"] / col[s]["step_s"])
                    for s in cad_steps])
  if len(pairs):
    err = pairs[:, 0] - pairs[:, 1]
    print(f"\nCAD steps: predicted saving {pairs[:, 0].mean():+.1%} on average, measured "
          f"{pairs[:, 1].mean():+.1%}; error RMS {np.sqrt(np.mean(err ** 2)):.1%}, at most "
          f"{np.abs(err).max():.1%}; same sign on {int(np.sum(np.sign(pairs[:, 0]) == np.sign(pairs[:, 1])))} "
          f"of {len(pairs)}")
  shape_of = [exchange_shape(cad[s]) for s in cad_steps]
  if len(set(shape_of)) > 1:
    print("\n| query rows | K/V rows | relayed K/V rows | nano-batches | CAD steps | predicted | "
          "measured | predicted - measured |\n|---|---|---|---|---|---|---|---|")
    for shape in sorted(set(shape_of)):
      sel = pairs[[sh == shape for sh in shape_of]]
      print(f"| {shape[0]:,} | {shape[1]:,} | {shape[2]:,} | {shape[3]} | {len(sel)} | "
            f"{sel[:, 0].mean():+.1%} | "
            f"{sel[:, 1].mean():+.1%} | {(sel[:, 0] - sel[:, 1]).mean() * 100:+.1f} points |")
  steps = sorted(s for s in col.keys() & cad.keys() if "loss" in col[s] and "loss" in cad[s])
  rel = [abs(cad[s]["loss"] - col[s]["loss"]) / max(abs(col[s]["loss"]), 1e-30) for s in steps]
  apart = [s for s, r in zip(steps, rel) if r > LOSS_TOLERANCE]
  if steps and not apart:
    print(f"\nlosses within {LOSS_TOLERANCE:.1%} of each other on all {len(steps)} steps")
  elif steps:
    print(f"\nlosses within {LOSS_TOLERANCE:.1%} of each other up to step {apart[0] - 1}; first "
          f"apart at step {apart[0]} ({rel[steps.index(apart[0])]:.2%}), apart on {len(apart)} of "
          f"{len(steps)} steps")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
