"""What fills a compiled step's temporary memory: the buffers live at the peak of the scheduled
HLO. Run the program with
`XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_module_re=.*train_step.*"`, then

    python launch/tools/xla_buffers.py DIR [--top 30]

For each `*after_optimizations.txt` module (scheduled HLO: text order is execution order) it
walks the entry computation, gives every instruction that allocates (not parameters, constants,
tuples, get-tuple-element, bitcasts, async done halves) a buffer that lives from its definition
to its last use, and prints the peak and the largest buffers live there, with the JAX name stack
of the op that made each. An estimate: it ignores in-place reuse (a scatter or dynamic update
writing into its operand counts twice) and treats a multi-output fusion as one buffer, so it can
exceed XLA's own figure (`compiled.memory_analysis().temp_size_in_bytes`), but it names the
values that keep memory alive — e.g. a fusion that materialises many zero buffers at step start.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
import sys
from pathlib import Path

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
          "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_NO_ALLOC = {"get-tuple-element", "bitcast", "tuple", "parameter", "constant", "partition-id",
             "replica-id", "copy-done", "all-to-all-done", "all-gather-done", "all-reduce-done",
             "collective-permute-done", "async-done", "send-done", "recv-done", "opt-barrier"}


def _nbytes(type_text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(type_text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _BYTES[dtype]
  return total


def peak_buffers(hlo_text: str) -> tuple[int, str, list[tuple[int, str, str]]]:
  """(peak bytes, instruction at the peak, [(bytes, instruction, op_name)] live there, largest
  first) for the entry computation of scheduled HLO text."""
  entry = hlo_text[hlo_text.index("\nENTRY"):]
  entry = entry[:entry.index("\n}\n")]
  order, size, sources, last_use, op_name = [], {}, {}, {}, {}
  for line in entry.split("\n")[1:]:
    m = _INSTR.match(line)
    if not m:
      continue
    name, type_text, opcode, rest = m.groups()
    meta = re.search(r'op_name="([^"]*)"', line)
    op_name[name] = meta.group(1) if meta else ""
    operands = re.findall(r"%([\w.\-]+)", rest.split("metadata=")[0])
    order.append(name)
    if opcode in _NO_ALLOC:  # aliases what its operands hold
      sources[name] = (set() if opcode == "parameter"
                       else set().union(*(sources.get(o, set()) for o in operands)))
      size[name] = 0
    else:
      sources[name], size[name] = {name}, _nbytes(type_text)
    for o in operands:
      for src in sources.get(o, ()):
        last_use[src] = len(order) - 1
  ends = collections.defaultdict(list)
  for i, name in enumerate(order):
    if size[name]:
      ends[last_use.get(name, i)].append(name)
  live, live_bytes, peak, at, best = set(), 0, 0, "", set()
  for i, name in enumerate(order):
    if size[name]:
      live.add(name)
      live_bytes += size[name]
    if live_bytes > peak:
      peak, at, best = live_bytes, name, set(live)
    for done in ends.get(i, ()):
      if done in live:
        live.discard(done)
        live_bytes -= size[done]
  top = sorted(((size[n], n, op_name[n]) for n in best), reverse=True)
  return peak, f"{at} ({op_name.get(at, '')})", top


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("dump_dir")
  parser.add_argument("--top", type=int, default=30)
  args = parser.parse_args(argv)
  files = sorted(Path(args.dump_dir).glob("*after_optimizations.txt*"))
  if not files:
    print(f"no *after_optimizations.txt modules in {args.dump_dir}", file=sys.stderr)
    return 1
  for path in files:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
      peak, at, top = peak_buffers(f.read())
    print(f"{path.name}: peak {peak / 2**30:.3f} GiB live at {at[:140]}")
    for nbytes, name, op in top[:args.top]:
      print(f"  {nbytes / 2**30:8.3f} GiB  {name[:36]:36s} {op[:140]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
