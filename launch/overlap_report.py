"""How much of the all-to-all communication in a profile ran beside compute.

    python launch/overlap_report.py perfetto_trace.json.gz

Reads a Chrome/Perfetto trace written by `jax.profiler` (create_perfetto_trace=True), takes the
GPU kernel events of each device, classifies them as communication (NCCL kernels: all-to-all,
send/recv, all-gather, reduce-scatter, all-reduce) or compute (everything else), and reports per
device: communication time, the part of it covered by compute kernels running at the same time
on another stream, and that fraction. Overlap that is not in the trace did not happen.
"""

from __future__ import annotations

import collections
import gzip
import json
import sys


def _intervals_union(iv):
  iv = sorted(iv)
  out = []
  for s, e in iv:
    if out and s <= out[-1][1]:
      out[-1][1] = max(out[-1][1], e)
    else:
      out.append([s, e])
  return out


def _covered(a, b_union):
  """Length of interval a covered by the (sorted, disjoint) union b."""
  s, e = a
  total = 0.0
  for bs, be in b_union:
    if be <= s:
      continue
    if bs >= e:
      break
    total += min(e, be) - max(s, bs)
  return total


def gpu_events(path: str):
  """(device process name, event) for every complete event of a GPU process in a trace."""
  with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {}
  for ev in events:
    if ev.get("ph") == "M" and ev.get("name") == "process_name":
      names[ev["pid"]] = ev["args"].get("name", "")
  for ev in events:
    if ev.get("ph") != "X" or "dur" not in ev:
      continue
    proc = names.get(ev["pid"], "")
    if "/device:GPU" in proc or "GPU" in proc:
      yield proc, ev


def report(path: str) -> list[dict]:
  per_dev = collections.defaultdict(lambda: {"comm": [], "compute": []})
  for proc, ev in gpu_events(path):
    name = ev.get("name", "").lower()
    kind = "comm" if ("nccl" in name or "all_to_all" in name or "alltoall" in name
                      or "sendrecv" in name) else "compute"
    per_dev[proc][kind].append((float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])))
  rows = []
  for dev, d in sorted(per_dev.items()):
    comp = _intervals_union(d["compute"])
    comm = _intervals_union(d["comm"])
    comm_t = sum(e - s for s, e in comm)
    covered = sum(_covered((s, e), comp) for s, e in comm)
    rows.append({"device": dev, "comm_ms": comm_t / 1e3, "comm_overlapped_ms": covered / 1e3,
                 "overlap": covered / comm_t if comm_t else float("nan"),
                 "compute_ms": sum(e - s for s, e in comp) / 1e3})
  return rows


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  rows = report(argv[0])
  print("| device | communication ms | of it beside compute ms | overlap | compute ms |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['device']} | {r['comm_ms']:.2f} | {r['comm_overlapped_ms']:.2f} | {r['overlap']:.0%} | {r['compute_ms']:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
