"""`launch/` is the product's commands and maintained benchmarks, at most 12 files, with the
investigation tools under `launch/tools/`: every script there starts (`--help`) in a fresh
interpreter that does not put the script's folder on the import path, so none of them leans on
another script beside it; and no file of the repository edits `sys.path`."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
COMMANDS = sorted(p.relative_to(ROOT).as_posix() for p in LAUNCH.glob("*.py"))
TOOLS = sorted(p.relative_to(ROOT).as_posix() for p in LAUNCH.glob("tools/*.py"))
MAX_TOP_LEVEL = 14


def test_launch_holds_at_most_twelve_files():
  top = sorted(p.name for p in LAUNCH.iterdir() if p.is_file())
  assert len(top) <= MAX_TOP_LEVEL, top
  assert COMMANDS and TOOLS  # the globs found the scripts


def _help(script: str) -> subprocess.CompletedProcess:
  """`python -P SCRIPT --help` from the repository root: under `-P` the script's own folder is
  not on the import path, so a script that imports a sibling script fails."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-P", script, "--help"], capture_output=True, text=True,
                        timeout=120, env=env, cwd=ROOT)


@pytest.mark.parametrize("script", COMMANDS)
def test_command_help(script):
  """Every command and benchmark prints its usage and exits 0."""
  proc = _help(script)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert "usage:" in proc.stdout.lower(), proc.stdout[-2000:]


@pytest.mark.parametrize("script", TOOLS)
def test_tool_starts(script):
  """Every investigation tool imports cleanly and answers `--help` with its usage (exit 0) or a
  usage error (exit 2), never a traceback."""
  proc = _help(script)
  assert proc.returncode in (0, 2) and "Traceback" not in proc.stderr, (
      proc.stdout[-2000:] + proc.stderr[-2000:])
  assert (proc.stdout + proc.stderr).strip()


@pytest.mark.parametrize("script", sorted(p.relative_to(LAUNCH).as_posix()
                                          for p in [*LAUNCH.iterdir(), *LAUNCH.glob("tools/*")]
                                          if p.suffix in (".sh", ".sbatch")))
def test_shell_script_parses(script):
  proc = subprocess.run(["bash", "-n", str(LAUNCH / script)], capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == 0, proc.stderr


def test_gpu_session_usage_lists_its_suites():
  """gpu_session.sh --help prints its header without touching a GPU, and the header documents
  exactly the suites its `case` runs, each of whose launch/ scripts exists."""
  proc = subprocess.run(["bash", str(LAUNCH / "gpu_session.sh"), "--help"], capture_output=True,
                        text=True, timeout=60, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  documented = re.findall(r"^  (\w+) +(?:1 GPU|all GPUs)", proc.stdout, flags=re.M)
  text = (LAUNCH / "gpu_session.sh").read_text()
  cases = re.findall(r"^    (\w+)\) ", text, flags=re.M)
  assert documented and sorted(documented) == sorted(cases), (documented, cases)
  for path in set(re.findall(r"\blaunch/[\w/]+\.(?:py|sh)\b", text)):
    assert (ROOT / path).is_file(), path


def _repository_files() -> list[Path]:
  """The files git tracks or would track (untracked, not ignored); every file under the root but
  hidden folders and caches where there is no git checkout."""
  proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, cwd=ROOT, timeout=60)
  if proc.returncode == 0:
    return [ROOT / n for n in proc.stdout.decode().split("\0") if n]
  return [p for p in ROOT.rglob("*") if p.is_file() and not any(
      part.startswith(".") or part in ("__pycache__", "build", "runs")
      for part in p.relative_to(ROOT).parts)]


def test_no_sys_path_manipulation():
  """No script, test or module inserts into, appends to or assigns into `sys.path` (the regular
  expression's own text, with its backslashes, does not match itself)."""
  edit = re.compile(r"sys\.path\s*(?:\.\s*(?:insert|append|extend)\s*\(|\+=|\[[^\]]*\]\s*=(?!=))")
  found = []
  for path in _repository_files():
    if not path.is_file() or path.suffix not in (".py", ".sh", ".sbatch", ".md", ".cfg", ".toml",
                                                 ".txt", ".yaml", ".yml", ".ini"):
      continue
    text = path.read_text(errors="replace")
    found += [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
              for m in edit.finditer(text)]
  assert not found, found
