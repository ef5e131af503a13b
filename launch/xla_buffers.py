"""The largest values in XLA's buffer-assignment dump of a compiled module: what fills its
temporary memory. Run the program with
`XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_module_re=.*train_step.*"`, then

    python launch/xla_buffers.py DIR [--top 30]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("dump_dir")
  parser.add_argument("--top", type=int, default=30)
  args = parser.parse_args(argv)
  files = sorted(Path(args.dump_dir).glob("*after_optimizations-buffer-assignment.txt"))
  if not files:
    print(f"no buffer-assignment dumps in {args.dump_dir}", file=sys.stderr)
    return 1
  for path in files:
    allocations = re.split(r"\n(?=allocation \d+:)", path.read_text())
    sized = []
    for block in allocations:
      head = re.match(r"allocation (\d+): size (\d+)(.*)", block)
      if head:
        sized.append((int(head.group(2)), head.group(3).strip()[:60], block))
    if not sized:
      continue
    size, kind, block = max(sized, key=lambda x: x[0])
    print(f"{path.name}: largest allocation {size / 2**30:.2f} GiB {kind}")
    values = sorted(((int(m.group(2)), m.group(1), m.group(4)) for m in VALUE.finditer(block)), reverse=True)
    for nbytes, name, shape in values[:args.top]:
      print(f"  {nbytes / 2**30:8.3f} GiB  {shape:40s} {name}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
