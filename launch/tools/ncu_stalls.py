"""Where a kernel's warps wait, from Nsight Compute's per-SASS-line counters.

    python launch/tools/ncu_stalls.py ncu_mosaic_sass.csv [--top 25]

Reads the CSV of `ncu -i REPORT --page source --csv --print-source sass` (REPORT taken with
`--section SourceCounters`, e.g. `-k regex:ca_tasks_bwd -c 1` on `launch/bench_kernels.py
--backends mosaic`) and prints: the share of the kernel's warp-stall samples
per stall reason; the share per execution count, which tells the warp roles of a warp-specialised
kernel apart (the producer's per-step instructions run a different number of times than the
consumers'); and the instructions with the most samples, in program order, with their top
reasons. A sample is attributed to the instruction the warp waits to issue, so a stall on a
barrier or a fence shows on the instruction after it.
"""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(value: str) -> int:
  value = (value or "").replace(",", "").strip()
  return int(float(value)) if value not in ("-", "") else 0


def read(path: str) -> tuple[list[str], list[dict[str, int]], list[str]]:
  """(stall reason columns, per SASS instruction its counters by column, its source text) of the
  CSV; the first line names the kernel, the second holds the column names. Counters are parsed
  once here (missing or "-" as 0)."""
  with open(path, newline="") as fh:
    rows = list(csv.reader(fh))
  header = next(r for r in rows if SAMPLES in r)
  lines = [r for r in rows[rows.index(header) + 1:] if len(r) == len(header)]
  reasons = [h for h in header if h.startswith("stall_") and not h.endswith("(Not Issued)")]
  numeric = {SAMPLES, "Instructions Executed", *reasons}
  body = [{k: _number(v) for k, v in zip(header, r) if k in numeric} for r in lines]
  at = header.index("Source") if "Source" in header else None
  source = [r[at].strip() if at is not None else "" for r in lines]
  return reasons, body, source


def summary(path: str, top: int = 25) -> str:
  reasons, body, source = read(path)
  total = sum(r.get(SAMPLES, 0) for r in body)
  if not total:
    return f"{path}: no warp-stall samples"
  out = [f"{len(body)} instructions, {total:,} warp-stall samples", "", "| reason | share |",
         "|---|---|"]
  by_reason = {c: sum(r.get(c, 0) for r in body) for c in reasons}
  by_reason["stall_other"] = total - sum(by_reason.values())
  out += [f"| {c[len('stall_'):]} | {s / total:.1%} |"
          for c, s in sorted(by_reason.items(), key=lambda kv: -kv[1]) if s >= 0.005 * total]
  by_exec = collections.Counter()
  for r in body:
    by_exec[r.get("Instructions Executed", 0)] += r.get(SAMPLES, 0)
  out += ["", "| times executed | share of samples |", "|---|---|"]
  out += [f"| {e:,} | {s / total:.1%} |" for e, s in by_exec.most_common(6)]
  hot = sorted(range(len(body)), key=lambda i: -body[i].get(SAMPLES, 0))[:top]
  out += ["", "| line | share | times executed | instruction | top reasons |", "|---|---|---|---|---|"]
  for i in sorted(hot):
    r = body[i]
    n = r.get(SAMPLES, 0)
    # Reasons the CSV has no column for (e.g. warpgroup_arrive) count as "other".
    other = n - sum(r.get(c, 0) for c in reasons)
    why = sorted([(r.get(c, 0), c[len("stall_"):]) for c in reasons] + [(other, "other")],
                 reverse=True)[:2]
    why = ", ".join(f"{name} {k / max(n, 1):.0%}" for k, name in why if k)
    out.append(f"| {i} | {n / total:.1%} | {r.get('Instructions Executed', 0):,} | "
               f"`{source[i][:60]}` | {why} |")
  return "\n".join(out)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
  ap.add_argument("--top", type=int, default=25, help="instructions to list")
  args = ap.parse_args(argv)
  print(summary(args.csv, args.top))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
