"""The installed package: `models/` and `kernels/` exist only as `distca_jax.models` and
`distca_jax.kernels`, the length distributions ship with their provenance, and nothing else of
the repository (launch/, tests/) leaks into site-packages.

Runs in CI on purpose: a packaging mistake breaks every user's install but no other test (they
all run from the source tree)."""

import importlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What the build needs from the tree; everything else (.git, runs/, caches) stays behind.
BUILD_INPUTS = ("pyproject.toml", "README.md", "distca_jax", "models", "kernels", "launch",
                "tests", "configs")


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
  # Build from a copy: an in-tree build writes build/ and *.egg-info into a tree that other
  # processes may be reading.
  src = tmp_path_factory.mktemp("src")
  for name in BUILD_INPUTS:
    path = ROOT / name
    if path.is_dir():
      shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    elif path.exists():
      shutil.copy2(path, src / name)
  out = tmp_path_factory.mktemp("dist")
  proc = subprocess.run(
      [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
       "-q", "-w", str(out), str(src)],
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  wheels = list(out.glob("distca_jax-*.whl"))
  assert len(wheels) == 1, wheels
  with zipfile.ZipFile(wheels[0]) as zf:
    return set(zf.namelist())


@pytest.mark.parametrize("name", [
    "distca_jax/__init__.py",
    "distca_jax/models/__init__.py",
    "distca_jax/models/llama.py",
    "distca_jax/models/presets.py",
    "distca_jax/kernels/__init__.py",
    "distca_jax/kernels/reference.py",
    "distca_jax/data/doclens/pretrain.json",
    "distca_jax/data/doclens/prolong.json",
    "distca_jax/data/doclens/README.md",  # provenance and license of the distributions
    "distca_jax/kernels/tables/NVIDIA_H100_triton.json",  # measured (q, kv) kernel times
    "distca_jax/kernels/tables/NVIDIA_H200_mosaic.json",
    "distca_jax/schedule/plan.py",
    "distca_jax/train/loop.py",
])
def test_wheel_contains(wheel_names, name):
  assert name in wheel_names


def test_wheel_has_no_generic_top_level_packages(wheel_names):
  top = {n.split("/")[0] for n in wheel_names if "/" in n}
  top = {t for t in top if not t.endswith((".dist-info", ".data"))}
  assert top == {"distca_jax"}, top
  for name in wheel_names:
    assert not name.startswith(("models/", "kernels/", "launch/", "tests/", "configs/")), name


def test_subpackages_import_under_distca_jax():
  models = importlib.import_module("distca_jax.models")
  kernels = importlib.import_module("distca_jax.kernels")
  # Editable install: the repository's folders; regular install: site-packages/distca_jax/*.
  assert Path(models.__file__).resolve().parent in (ROOT / "models", Path(importlib.import_module(
      "distca_jax").__file__).resolve().parent / "models")
  assert Path(kernels.__file__).resolve().parent.name == "kernels"
  from distca_jax.models.llama import Llama  # noqa: F401
  from distca_jax.kernels import attention  # noqa: F401


def test_generic_names_not_importable():
  """`import models` must not resolve to this repository's folder (it would shadow or be shadowed
  by any other project's `models`). Run in a fresh interpreter outside the repository, where the
  repository root is not on sys.path."""
  code = ("import importlib.util as u, sys; "
          "print(all(u.find_spec(n) is None for n in ('models', 'kernels')))")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                        timeout=60)
  assert proc.stdout.strip() == "True", proc.stdout + proc.stderr
