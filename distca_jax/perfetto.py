"""Reading the Chrome/Perfetto trace that `jax.profiler.trace(..., create_perfetto_trace=True)`
writes: the GPU kernel events of each device, and the interval arithmetic the benchmarks and
`launch/tools/overlap_report.py` use to add their times up without counting overlaps twice.

Times in the trace are microseconds (`ts`: start, `dur`: duration).
"""

from __future__ import annotations

import gzip
import json
from typing import Iterator


def gpu_events(path: str) -> Iterator[tuple[str, dict]]:
  """(device process name, event) for every complete (`ph == "X"`) event of a GPU process in the
  trace at `path` (`.json` or `.json.gz`). A CPU run's trace has none."""
  with gzip.open(path, "rt") if str(path).endswith(".gz") else open(path) as f:
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
    if "GPU" in proc:
      yield proc, ev


def intervals_union(intervals) -> list[list[float]]:
  """The union of (start, end) intervals given in any order, as sorted disjoint [start, end]
  pairs: overlapping kernels on several streams count once."""
  out = []
  for s, e in sorted(intervals):
    if out and s <= out[-1][1]:
      out[-1][1] = max(out[-1][1], e)
    else:
      out.append([s, e])
  return out


def covered(interval, union) -> float:
  """How much of `interval` (start, end) the sorted disjoint `union` covers."""
  s, e = interval
  total = 0.0
  for bs, be in union:
    if be <= s:
      continue
    if bs >= e:
      break
    total += min(e, be) - max(s, bs)
  return total
