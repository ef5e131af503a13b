"""Where a kernel's warps wait, from Nsight Compute's per-SASS-line counters.

    python launch/ncu_stalls.py ncu_mosaic_sass.csv [--top 25]

Reads the CSV of `ncu -i REPORT --page source --csv --print-source sass` (what `bash
launch/gpu_session.sh ncuside` writes) and prints: the share of the kernel's warp-stall samples
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


def read(path: str) -> tuple[list[str], list[dict[str, str]]]:
  """(stall reason columns, one row per SASS instruction) of the CSV; the first line names the
  kernel, the second holds the column names."""
  with open(path, newline="") as fh:
    rows = list(csv.reader(fh))
  header = next(r for r in rows if SAMPLES in r)
  body = [dict(zip(header, r)) for r in rows[rows.index(header) + 1:] if len(r) == len(header)]
  reasons = [h for h in header if h.startswith("stall_") and not h.endswith("(Not Issued)")]
  return reasons, body


def count(row: dict[str, str], key: str) -> int:
  value = row.get(key, "") or "0"
  return int(float(value.replace(",", ""))) if value.strip() not in ("-", "") else 0


def summary(path: str, top: int = 25) -> str:
  reasons, body = read(path)
  total = sum(count(r, SAMPLES) for r in body)
  if not total:
    return f"{path}: no warp-stall samples"
  out = [f"{len(body)} instructions, {total:,} warp-stall samples", "", "| reason | share |",
         "|---|---|"]
  by_reason = {c: sum(count(r, c) for r in body) for c in reasons}
  by_reason["stall_other"] = total - sum(by_reason.values())
  out += [f"| {c[len('stall_'):]} | {s / total:.1%} |"
          for c, s in sorted(by_reason.items(), key=lambda kv: -kv[1]) if s >= 0.005 * total]
  by_exec = collections.Counter()
  for r in body:
    by_exec[count(r, "Instructions Executed")] += count(r, SAMPLES)
  out += ["", "| times executed | share of samples |", "|---|---|"]
  out += [f"| {e:,} | {s / total:.1%} |" for e, s in by_exec.most_common(6)]
  hot = sorted(range(len(body)), key=lambda i: -count(body[i], SAMPLES))[:top]
  out += ["", "| line | share | times executed | instruction | top reasons |", "|---|---|---|---|---|"]
  for i in sorted(hot):
    r = body[i]
    # Reasons the CSV has no column for (e.g. warpgroup_arrive) count as "other".
    other = count(r, SAMPLES) - sum(count(r, c) for c in reasons)
    why = sorted([(count(r, c), c[len("stall_"):]) for c in reasons] + [(other, "other")],
                 reverse=True)[:2]
    why = ", ".join(f"{name} {n / max(count(r, SAMPLES), 1):.0%}" for n, name in why if n)
    out.append(f"| {i} | {count(r, SAMPLES) / total:.1%} | {count(r, 'Instructions Executed'):,} | "
               f"`{r.get('Source', '').strip()[:60]}` | {why} |")
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
