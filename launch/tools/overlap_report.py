"""How much of the all-to-all communication in a profile ran beside compute.

    python launch/tools/overlap_report.py perfetto_trace.json.gz

Reads a Chrome/Perfetto trace written by `jax.profiler` (create_perfetto_trace=True), takes the
GPU kernel events of each device, classifies them as communication (NCCL kernels: all-to-all,
send/recv, all-gather, reduce-scatter, all-reduce) or compute (everything else), and reports per
device: communication time, the part of it covered by compute kernels running at the same time
on another stream, and that fraction. Overlap that is not in the trace did not happen.
"""

from __future__ import annotations

import argparse
import collections
import sys

from distca_jax.perfetto import covered, gpu_events, intervals_union


def report(path: str) -> list[dict]:
  """Per GPU process of the trace: communication ms, the part of it beside compute ms, that
  fraction (nan without communication) and compute ms."""
  per_dev = collections.defaultdict(lambda: {"comm": [], "compute": []})
  for proc, ev in gpu_events(path):
    name = ev.get("name", "").lower()
    kind = "comm" if ("nccl" in name or "all_to_all" in name or "alltoall" in name
                      or "sendrecv" in name) else "compute"
    per_dev[proc][kind].append((float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])))
  rows = []
  for dev, d in sorted(per_dev.items()):
    comp = intervals_union(d["compute"])
    comm = intervals_union(d["comm"])
    comm_t = sum(e - s for s, e in comm)
    beside = sum(covered((s, e), comp) for s, e in comm)
    rows.append({"device": dev, "comm_ms": comm_t / 1e3, "comm_overlapped_ms": beside / 1e3,
                 "overlap": beside / comm_t if comm_t else float("nan"),
                 "compute_ms": sum(e - s for s, e in comp) / 1e3})
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("trace", help="perfetto_trace.json.gz written by jax.profiler")
  rows = report(parser.parse_args(argv).trace)
  print("| device | communication ms | of it beside compute ms | overlap | compute ms |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['device']} | {r['comm_ms']:.2f} | {r['comm_overlapped_ms']:.2f} | "
          f"{r['overlap']:.0%} | {r['compute_ms']:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
