"""Imports point one way, proved by reading the source (nothing is imported).

Every module under `distca_jax/`, `models/` (installed as `distca_jax.models`) and `kernels/`
(installed as `distca_jax.kernels`) is parsed with `ast`; every `import` and `from ... import`
counts, the ones inside functions (lazy imports) included. The rules:

* `distca_jax.schedule.*` imports only itself, `distca_jax.data.packing`, `distca_jax.data.doclens`,
  numpy and the standard library (the scheduler runs in the simulator and on the host, no JAX);
* `distca_jax.kernels.*` imports only itself, JAX, numpy, the standard library and the optional
  triton / jax_triton;
* `distca_jax.sim.*` imports the scheduler, data, `models.presets`, the schema and config-level
  modules, never the trainer;
* nothing imports `distca_jax.train.*` but `distca_jax.train.*` itself and
  `distca_jax.launch_env` (the launchers in `launch/` are outside the package);
* `distca_jax.models.*` imports nothing about meshes;
* no import cycles, lazy imports included. Importing `a.b.c` from outside package `a.b` also runs
  `a.b`'s `__init__`, so that counts as an import of `a.b` too.

A failure names each offending import as `file:line`, and each cycle as a path of them.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package name it is installed as (pyproject.toml's package-dir).
SOURCES = {"distca_jax": "distca_jax", "models": "distca_jax.models",
           "kernels": "distca_jax.kernels"}
PACKAGE = "distca_jax"
STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}


@dataclasses.dataclass(frozen=True)
class Import:
  """One import: `importer` (a module of the package) imports `target` (a module of the package,
  or an external module's dotted name) at `where` ("path:line"). `implicit`: the edge is a parent
  package whose `__init__` the import runs, not the named module."""

  importer: str
  target: str
  where: str
  implicit: bool = False

  def __str__(self):
    via = " (runs its package's __init__)" if self.implicit else ""
    return f"{self.where}: {self.importer} imports {self.target}{via}"


def module_files(root: Path = ROOT, sources: dict[str, str] = SOURCES) -> dict[str, Path]:
  """Module name -> source file, for every .py file under the source folders."""
  out = {}
  for folder, package in sources.items():
    for path in sorted((root / folder).rglob("*.py")):
      parts = list(path.relative_to(root / folder).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts.pop()
      out[".".join([package, *parts])] = path
  return out


def _internal(name: str) -> bool:
  return name == PACKAGE or name.startswith(PACKAGE + ".")


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
  """The absolute name of `from <level dots><name> import ...` written in `module`."""
  if level == 0:
    return name or ""
  base = module.split(".") if is_package else module.split(".")[:-1]
  base = base[:len(base) - (level - 1)]
  return ".".join(base + ([name] if name else []))


def imports_of(module: str, path: Path, known: set[str], root: Path = ROOT) -> list[Import]:
  """Every import in `module`'s source, at any depth (function bodies included). A name imported
  from a package is that package's submodule when one exists, else the package itself."""
  tree = ast.parse(path.read_text(), filename=str(path))
  rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
  is_package = path.name == "__init__.py"
  out = []
  for node in ast.walk(tree):
    where = f"{rel}:{getattr(node, 'lineno', 0)}"
    targets = []
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = _resolve(module, is_package, node.level, node.module)
      for alias in node.names:
        sub = f"{base}.{alias.name}"
        targets.append(sub if sub in known else base)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr == "import_module" and node.args
          and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
      targets = [node.args[0].value]  # importlib.import_module("literal")
    for target in dict.fromkeys(targets):
      out.append(Import(module, target, where))
      # Importing a.b.c from outside a.b runs a.b's (and a's) __init__ first.
      parts = target.split(".")
      for k in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:k])
        if parent in known and parent != module and not module.startswith(parent + "."):
          out.append(Import(module, parent, where, implicit=True))
  return out


def package_imports(root: Path = ROOT, sources: dict[str, str] = SOURCES) -> list[Import]:
  """Every import of every module of the package."""
  files = module_files(root, sources)
  known = set(files)
  return [imp for module, path in files.items() for imp in imports_of(module, path, known, root)]


def _within(name: str, *prefixes: str) -> bool:
  return any(name == p or name.startswith(p + ".") for p in prefixes)


def _top(name: str) -> str:
  return name.split(".")[0]


def direction_violations(imports: list[Import]) -> list[str]:
  """The imports that break the one-way rules (module docstring), each with its file:line."""
  bad = []
  for imp in imports:
    if imp.implicit:
      continue  # the named module is checked; its package's __init__ is checked as a module
    src, dst = imp.importer, imp.target
    internal = _internal(dst)
    why = None
    if _within(src, "distca_jax.schedule"):
      if internal and not _within(dst, "distca_jax.schedule", "distca_jax.data.packing",
                                  "distca_jax.data.doclens"):
        why = "the scheduler imports only itself and data.packing / data.doclens"
      elif not internal and _top(dst) not in STDLIB | {"numpy"}:
        why = "the scheduler imports only numpy and the standard library"
    elif _within(src, "distca_jax.kernels"):
      if internal and not _within(dst, "distca_jax.kernels"):
        why = "the kernels import nothing of the package above them"
      elif not internal and _top(dst) not in STDLIB | {"jax", "jaxlib", "numpy", "triton",
                                                        "jax_triton"}:
        why = "the kernels import only JAX, numpy, triton / jax_triton and the standard library"
    elif _within(src, "distca_jax.sim"):
      if internal and not _within(dst, "distca_jax.sim", "distca_jax.schedule", "distca_jax.data",
                                  "distca_jax.models.presets", "distca_jax.schema",
                                  "distca_jax.schema_io", "distca_jax.config", "distca_jax.gate"):
        why = ("the simulator imports the scheduler, data, models.presets and config-level "
               "modules, never the trainer")
    elif _within(src, "distca_jax.models"):
      if _within(dst, "distca_jax.mesh", "distca_jax.dispatch", "distca_jax.attention",
                 "distca_jax.colocated", "distca_jax.pipeline", "distca_jax.wlb_attention",
                 "distca_jax.train", "distca_jax.launch_env", "jax.sharding",
                 "jax.experimental.shard_map", "jax.experimental.multihost_utils"):
        why = "the model knows nothing about meshes (it calls core_attention and constrain)"
    if why is None and _within(dst, "distca_jax.train") and not _within(
        src, "distca_jax.train", "distca_jax.launch_env"):
      why = "only the trainer itself and launch_env import distca_jax.train"
    if why:
      bad.append(f"{imp}: {why}")
  return bad


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
  """Tarjan's strongly connected components (iterative)."""
  index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
  for start in sorted(graph):
    if start in index:
      continue
    work = [(start, iter(sorted(graph.get(start, ()))))]
    index[start] = low[start] = counter[0]
    counter[0] += 1
    stack.append(start)
    on_stack.add(start)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = counter[0]
          counter[0] += 1
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph.get(child, ())))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        comp = set()
        while True:
          member = stack.pop()
          on_stack.discard(member)
          comp.add(member)
          if member == node:
            break
        out.append(comp)
  return out


def find_cycles(imports: list[Import]) -> list[list[Import]]:
  """Import cycles among the package's modules, each as its list of imports (first importer =
  last target). Every import that lies on a cycle is on at least one reported cycle: for each
  such edge u -> v, the edge and a shortest path v -> u."""
  internal = [imp for imp in imports if _internal(imp.target)]
  edges: dict[tuple[str, str], Import] = {}
  for imp in internal:  # one import per (importer, target): an explicit one, the first line
    key = (imp.importer, imp.target)
    if key not in edges or (edges[key].implicit and not imp.implicit):
      edges[key] = imp
  graph = collections.defaultdict(set)
  for u, v in edges:
    graph[u].add(v)
  cycles, seen = [], set()
  for comp in _strongly_connected(graph):
    for u, v in sorted(edges):
      if u not in comp or v not in comp:
        continue
      # Shortest path v -> u inside the component (breadth first).
      prev, queue = {v: None}, collections.deque([v])
      while queue and u not in prev:
        node = queue.popleft()
        for nxt in sorted(graph[node] & comp):
          if nxt not in prev:
            prev[nxt] = node
            queue.append(nxt)
      path = [u]
      node = u
      while node != v:
        node = prev[node]
        path.append(node)
      nodes = [u] + path[::-1][:-1] if u != v else [u]  # u, v, ..., (back to u)
      k = nodes.index(min(nodes))  # one rotation per cycle
      canon = tuple(nodes[k:] + nodes[:k])
      if canon in seen:
        continue
      seen.add(canon)
      cycles.append([edges[(a, canon[(i + 1) % len(canon)])] for i, a in enumerate(canon)])
  return cycles


def format_cycle(cycle: list[Import]) -> str:
  """`a -> b -> a`, then each import on it with its file:line."""
  names = " -> ".join([imp.importer for imp in cycle] + [cycle[0].importer])
  return names + "".join(f"\n    {imp}" for imp in cycle)


# --- the package -------------------------------------------------------------------------------


def test_the_walk_sees_the_package():
  """The walk finds the three source folders' modules and known imports, lazy ones included, so
  the rules below cannot pass on an empty graph."""
  files = module_files()
  for name in ("distca_jax.schedule.planner", "distca_jax.models.llama", "distca_jax.kernels",
               "distca_jax.kernels.tasks", "distca_jax.sim.engine", "distca_jax.train.loop"):
    assert name in files, name
  edges = {(imp.importer, imp.target) for imp in package_imports()}
  assert ("distca_jax.sim.engine", "distca_jax.schedule.plan") in edges
  assert ("distca_jax.models.llama", "distca_jax.models.presets") in edges  # relative import
  assert ("distca_jax.kernels", "distca_jax.kernels.reference") in edges  # inside a function


def test_imports_point_one_way():
  bad = direction_violations(package_imports())
  assert not bad, "imports against the layering rules:\n  " + "\n  ".join(bad)


def test_no_import_cycles():
  cycles = find_cycles(package_imports())
  assert not cycles, "import cycles (lazy imports count):\n  " + "\n  ".join(
      format_cycle(c) for c in cycles)


# --- the checker itself ------------------------------------------------------------------------


def test_checker_reports_a_cycle_and_forbidden_edges():
  """A synthetic graph: a three-module cycle (one edge lazy), a self-contained pair cycle, and
  one forbidden edge per rule; each is reported with its file:line."""
  imp = [
      Import("distca_jax.sim.engine", "distca_jax.sim.pipeline", "sim/engine.py:9"),
      Import("distca_jax.sim.pipeline", "distca_jax.sim.report", "sim/pipeline.py:3"),
      Import("distca_jax.sim.report", "distca_jax.sim.engine", "sim/report.py:40"),
      Import("distca_jax.a", "distca_jax.b", "a.py:1"),
      Import("distca_jax.b", "distca_jax.a", "b.py:2"),
      Import("distca_jax.schedule.plan", "distca_jax.dispatch.format", "schedule/plan.py:7"),
      Import("distca_jax.schedule.plan", "jax", "schedule/plan.py:8"),
      Import("distca_jax.schedule.plan", "distca_jax.data.packing", "schedule/plan.py:9"),
      Import("distca_jax.kernels.pallas", "distca_jax.mesh", "kernels/pallas.py:5"),
      Import("distca_jax.kernels.pallas", "jax_triton", "kernels/pallas.py:6"),
      Import("distca_jax.sim.engine", "distca_jax.train.metrics", "sim/engine.py:12"),
      Import("distca_jax.dispatch", "distca_jax.train.metrics", "dispatch.py:30"),
      Import("distca_jax.launch_env", "distca_jax.train.loop", "launch_env.py:3"),
      Import("distca_jax.models.llama", "distca_jax.mesh", "models/llama.py:4"),
  ]
  bad = direction_violations(imp)
  assert [b.split(":")[0] + ":" + b.split(":")[1] for b in bad] == [
      "schedule/plan.py:7", "schedule/plan.py:8", "kernels/pallas.py:5", "sim/engine.py:12",
      "dispatch.py:30", "models/llama.py:4"], bad
  cycles = find_cycles(imp)
  paths = sorted(" -> ".join(i.importer for i in c) for c in cycles)
  assert paths == ["distca_jax.a -> distca_jax.b",
                   "distca_jax.sim.engine -> distca_jax.sim.pipeline -> distca_jax.sim.report"]
  text = "\n".join(format_cycle(c) for c in cycles)
  for where in ("sim/engine.py:9", "sim/pipeline.py:3", "sim/report.py:40", "a.py:1", "b.py:2"):
    assert where in text, text
  assert find_cycles(imp[3:4] + imp[5:]) == []  # no cycle left once each is broken


def test_parser_finds_lazy_relative_and_package_imports(tmp_path):
  """The source walk on a synthetic package: an import inside a function, a relative import, a
  name from a package's __init__ (an edge to the package), a submodule by `from . import`, and
  the package's __init__ run by importing one of its submodules from outside it."""
  src = tmp_path / "pkg"
  (src / "sub").mkdir(parents=True)
  (src / "__init__.py").write_text("")
  (src / "sub" / "__init__.py").write_text("from .leaf import f\n")
  (src / "sub" / "leaf.py").write_text("from . import other\nfrom .. import top\n")
  (src / "sub" / "other.py").write_text("import numpy\n")
  (src / "top.py").write_text("import os\n\ndef g():\n  from distca_jax.sub.leaf import f\n"
                              "  return f\n")
  got = {str(i) for i in package_imports(tmp_path, {"pkg": "distca_jax"})}
  assert got == {
      "pkg/sub/__init__.py:1: distca_jax.sub imports distca_jax.sub.leaf",
      "pkg/sub/leaf.py:1: distca_jax.sub.leaf imports distca_jax.sub.other",
      "pkg/sub/leaf.py:2: distca_jax.sub.leaf imports distca_jax.top",
      "pkg/sub/other.py:1: distca_jax.sub.other imports numpy",
      "pkg/top.py:1: distca_jax.top imports os",
      "pkg/top.py:4: distca_jax.top imports distca_jax.sub.leaf",
      "pkg/top.py:4: distca_jax.top imports distca_jax.sub (runs its package's __init__)",
  }, got
  cycles = find_cycles(package_imports(tmp_path, {"pkg": "distca_jax"}))
  assert sorted(" -> ".join(i.importer for i in c) for c in cycles) == [
      "distca_jax.sub -> distca_jax.sub.leaf -> distca_jax.top",
      "distca_jax.sub.leaf -> distca_jax.top"], cycles
