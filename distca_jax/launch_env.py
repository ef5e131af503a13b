"""Process environment for JAX, set before JAX starts: XLA flags for GPUs and simulated CPUs."""

from __future__ import annotations

import os

# Flags that let XLA overlap collectives with compute on GPU (ping-pong relies on them):
# the latency-hiding scheduler reorders independent collectives and matmuls.
GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
)


def configure_xla(cpu_devices: int = 0, gpu_flags: bool = True) -> None:
  """Appends our flags to XLA_FLAGS unless the user already set them. Must run before jax is
  imported. `cpu_devices` > 0 splits the host platform into that many devices (it only affects
  the CPU backend, so it is harmless on GPU machines)."""
  if "jax" in __import__("sys").modules and _backends_started():
    return
  flags = os.environ.get("XLA_FLAGS", "").split()
  names = {f.split("=")[0] for f in flags}
  extra = []
  if cpu_devices > 0 and "--xla_force_host_platform_device_count" not in names:
    extra.append(f"--xla_force_host_platform_device_count={cpu_devices}")
  if gpu_flags:
    extra += [f for f in GPU_XLA_FLAGS if f.split("=")[0] not in names]
  os.environ["XLA_FLAGS"] = " ".join(flags + extra)


def _backends_started() -> bool:
  try:
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)
  except Exception:  # private API moved: assume not started
    return False
