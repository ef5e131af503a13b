"""Test setup: 16 simulated CPU devices (set before jax is imported anywhere), and every
test run from a temporary working directory, so that a run without `train.out_dir` (whose
directory defaults to `runs/...` under the working directory) never writes into the checkout."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=16").strip()


@pytest.fixture(autouse=True, scope="session")
def _outside_the_checkout(tmp_path_factory):
  """The whole test run (module fixtures included) happens in a temporary directory."""
  before = os.getcwd()
  os.chdir(tmp_path_factory.mktemp("cwd"))
  yield
  os.chdir(before)
