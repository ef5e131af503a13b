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
ragged exchange, `attention.exchange=ragged`).

Environment (`GPU_ENV`, set unless already set):

  NCCL_NVLS_ENABLE=0   NVLink SHARP (multicast) off: the lent GPU hosts require it, and NCCL
                       otherwise may try to set it up at communicator creation and fail.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Re-exported: launchers and tests turn the cache on through this module.
from distca_jax.compile_cache import enable_compile_cache  # noqa: F401

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


def add_multihost_args(parser) -> None:
  """The launchers' multi-host arguments (`run_training` passes them to `jax.distributed`)."""
  parser.add_argument("--coordinator", help="jax.distributed coordinator host:port (multi-host)")
  parser.add_argument("--num-processes", type=int, help="processes in the job (multi-host)")
  parser.add_argument("--process-id", type=int, help="this process's index (multi-host)")


def run_training(config, args, **run_kwargs):
  """The training loop as a launcher runs it: XLA configured for `config` (so jax must not have
  started a backend yet), `jax.distributed` started from the multi-host arguments of `args` (or
  the cluster's environment), `loop.run(config, **run_kwargs)`, then shut down. The run's
  directory, unless `train.out_dir` is set, is named after `args.config`'s file (`default`
  without one). Returns (exit code, summary): (0, summary); (128 + the signal's number,
  summary) for a run SIGTERM or SIGINT stopped (it saved a checkpoint and its summary);
  (3, None) if the distributed start failed; (2, None) on a ConfigError the run raised, a
  `checkpoint.step` with no checkpoint or a directory of another model's checkpoints; (1, None)
  when a step became non-finite, the processes planned different steps, or a checkpoint could
  not be read or saved. The reason is one
  line on stderr."""
  from distca_jax.config import ConfigError

  configure_xla(cpu_devices=config.train.cpu_devices)
  from distca_jax import mesh as mesh_lib
  from distca_jax.train import loop, stopping
  from distca_jax.train.checkpoint import CheckpointError, CheckpointMismatchError, NoCheckpointError

  try:
    mesh_lib.initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                    timeout_s=config.train.init_timeout_s,
                                    heartbeat_s=config.train.heartbeat_timeout_s)
  except mesh_lib.DistributedInitError as e:
    print(f"distributed start-up failed: {e}", file=sys.stderr)
    return 3, None
  run_kwargs.setdefault("name", Path(args.config).stem if getattr(args, "config", None) else "default")
  try:
    summary = loop.run(config, **run_kwargs)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2, None
  except (NoCheckpointError, CheckpointMismatchError) as e:  # checkpoint.step, train.out_dir
    print(f"checkpoint error: {e}", file=sys.stderr)
    return 2, None
  except CheckpointError as e:  # unreadable, or a save failed
    print(f"checkpoint error: {e}", file=sys.stderr)
    return 1, None
  except (loop.NonFiniteError, loop.PlanDisagreementError) as e:
    print(f"training stopped: {e}", file=sys.stderr)
    return 1, None
  # Only after a run every process finished: a failed process must not wait at the barrier.
  mesh_lib.shutdown_distributed()
  return stopping.exit_code(summary.interrupted), summary
