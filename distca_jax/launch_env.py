"""Process environment for JAX, set before JAX starts: XLA flags for GPUs and simulated CPUs, and
NCCL settings.

XLA reads `XLA_FLAGS` once, when the first backend starts, and aborts the process on a flag it
does not know. Every flag below is registered in XLA's common flag table (checked to parse on the
CPU-only jaxlib 0.10.2 of CI and on jaxlib 0.11.2 on the lent GPUs), so setting it is harmless
on CPU; it only changes what the GPU compiler does. Flags the user already put in `XLA_FLAGS`
win over ours.

GPU flags (`GPU_XLA_FLAGS`):

  --xla_gpu_enable_latency_hiding_scheduler=true
      Schedules asynchronous collectives (all_to_all, all-gather, reduce-scatter) as early as
      their inputs allow and their waits as late as possible, so that independent compute runs
      in between. Off by default. Ping-pong needs it: Pong's compute can only hide Ping's
      dispatch if the scheduler is allowed to move that dispatch next to it.
  --xla_gpu_enable_highest_priority_async_stream=true
      Runs the collectives' stream at the highest CUDA priority, so a communication kernel that
      is ready is not starved by the compute kernels it should overlap with.
  --xla_gpu_all_gather_combine_threshold_bytes=134217728
  --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728
  --xla_gpu_all_reduce_combine_threshold_bytes=134217728
      Combine the many small per-parameter FSDP all-gathers / gradient reduce-scatters (and the
      replicated-parameter all-reduces) up to 128 MiB per collective: fewer, larger NCCL calls
      reach closer to link bandwidth. Larger thresholds cost more temporary memory.

Deliberately not set: `--xla_gpu_enable_pipelined_*` and while-loop double buffering (they pay
off for scanned layers, which our model does not use, and have had correctness bugs), and
`--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer` (only for the optional
ragged_all_to_all path, see DESIGN.md).

Environment (`GPU_ENV`, set unless already set):

  NCCL_NVLS_ENABLE=0   NVLink SHARP (multicast) off: the lent GPU hosts require it, and NCCL
                       otherwise may try to set it up at communicator creation and fail.
"""

from __future__ import annotations

import os
import sys

GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
)

GPU_ENV = {"NCCL_NVLS_ENABLE": "0"}


def configure_xla(cpu_devices: int = 0, gpu_flags: bool = True) -> None:
  """Appends our flags to XLA_FLAGS unless the user already set them, and sets `GPU_ENV`
  defaults. Must run before jax starts a backend (it does nothing after). `cpu_devices` > 0
  splits the host platform into that many devices (it only affects the CPU backend, so it is
  harmless on GPU machines)."""
  for key, value in GPU_ENV.items():
    os.environ.setdefault(key, value)
  if "jax" in sys.modules and _backends_started():
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


def enable_compile_cache(directory: str, min_compile_s: float = 0.0) -> None:
  """Turns on JAX's persistent compilation cache in `directory`: a restarted or resumed run (and
  every process of a multi-host job that shares the directory) loads the step's executable
  instead of compiling it again. Safe to call after jax has started; entries are keyed by the
  program, the jax/XLA versions and the flags, so a stale entry is never used."""
  import jax

  jax.config.update("jax_compilation_cache_dir", str(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  try:
    # The cache is set up once, at the first compilation; re-read the settings now.
    from jax._src import compilation_cache

    compilation_cache.reset_cache()
  except Exception:  # private API moved: the settings apply from the next process on
    pass


def add_multihost_args(parser) -> None:
  """The launchers' multi-host arguments (`run_training` passes them to `jax.distributed`)."""
  parser.add_argument("--coordinator", help="jax.distributed coordinator host:port (multi-host)")
  parser.add_argument("--num-processes", type=int, help="processes in the job (multi-host)")
  parser.add_argument("--process-id", type=int, help="this process's index (multi-host)")


def run_training(config, args, **run_kwargs):
  """The training loop as a launcher runs it: XLA configured for `config` (so jax must not have
  started a backend yet), `jax.distributed` started from the multi-host arguments of `args` (or
  the cluster's environment), `loop.run(config, **run_kwargs)`, then shut down. Returns (exit
  code, summary): (0, summary); (3, None) if the distributed start failed; (2, None) on a
  ConfigError the run raised; the reason printed to stderr."""
  from distca_jax.config import ConfigError

  configure_xla(cpu_devices=config.train.cpu_devices)
  from distca_jax import mesh as mesh_lib
  from distca_jax.train import loop

  try:
    mesh_lib.initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                    timeout_s=config.train.init_timeout_s)
  except mesh_lib.DistributedInitError as e:
    print(f"distributed start-up failed: {e}", file=sys.stderr)
    return 3, None
  try:
    summary = loop.run(config, **run_kwargs)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2, None
  # Only after a run every process finished: a failed process must not wait at the barrier.
  mesh_lib.shutdown_distributed()
  return 0, summary
