"""Test setup: 16 simulated CPU devices (set before jax is imported anywhere), one persistent
compilation cache for the whole run, and every test run from a temporary working directory, so
that a run without `train.out_dir` (whose directory defaults to `runs/...` under the working
directory) never writes into the checkout."""

import os
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Most of the suite's time is XLA compiling small CPU programs, and much of a compile is LLVM
# optimising code that then runs on toy shapes: tests compile without it (the HLO passes, and so
# the numerics, are unchanged). Processes the tests start get the same flag (`helpers.child_env`).
if os.environ["JAX_PLATFORMS"] == "cpu":
  os.environ.setdefault("DISTCA_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0")
_flags = (os.environ.get("XLA_FLAGS", "") + " " + os.environ.get("DISTCA_TEST_XLA_FLAGS", "")).strip()
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=16"
os.environ["XLA_FLAGS"] = _flags.strip()
# Set at import, so pytest-xdist's workers (started after the controller read this file) share one
# directory, and the tests that start processes can hand it to them.
os.environ.setdefault("DISTCA_TEST_COMPILE_CACHE", tempfile.mkdtemp(prefix="distca_compile_cache_"))


@pytest.fixture(autouse=True, scope="session")
def _compile_cache():
  """Tests build many trainers that compile the same small programs (a step under each remat
  policy, a model's initialisation): after the first, each loads from the cache."""
  from distca_jax.compile_cache import enable_compile_cache

  enable_compile_cache(os.environ["DISTCA_TEST_COMPILE_CACHE"])


@pytest.fixture(autouse=True, scope="session")
def _outside_the_checkout(tmp_path_factory):
  """The whole test run (module fixtures included) happens in a temporary directory."""
  before = os.getcwd()
  os.chdir(tmp_path_factory.mktemp("cwd"))
  yield
  os.chdir(before)


# The longest tests, started first: with two workers a long test left for the end runs alone
# while the other worker idles.
_LONG_FIRST = ("tests/test_multihost.py", "tests/test_pipeline.py::test_pipeline_matches_reference",
               "tests/test_bench.py")


def pytest_collection_modifyitems(items):
  items.sort(key=lambda item: not item.nodeid.startswith(_LONG_FIRST))
