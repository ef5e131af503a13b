"""Train a Llama-style model with colocated or disaggregated core attention.

    python launch/train.py                                  # built-in default: tiny model, CPU ok
    python launch/train.py --config configs/llama_1b.yaml train.steps=100 attention.impl=distca

With no accelerator, JAX's CPU backend is split into `train.cpu_devices` simulated devices (8 by
default) so the mesh code paths are the ones a GPU cluster runs.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse(argv):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", help="YAML file overriding the defaults (configs/*.yaml)")
  parser.add_argument("--coordinator", help="jax.distributed coordinator host:port (multi-host)")
  parser.add_argument("--num-processes", type=int, help="processes in the job (multi-host)")
  parser.add_argument("--process-id", type=int, help="this process's index (multi-host)")
  parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=10")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = _parse(argv)
  # Config first (no jax import yet): the CPU device count must be set before jax starts.
  from distca_jax.config import ConfigError, load_config

  try:
    config = load_config(args.config, args.overrides)
  except (ConfigError, ValueError) as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  from distca_jax.launch_env import configure_xla

  configure_xla(cpu_devices=config.train.cpu_devices)
  from distca_jax import mesh as mesh_lib
  from distca_jax.train import loop

  try:
    mesh_lib.initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                    timeout_s=config.train.init_timeout_s)
  except mesh_lib.DistributedInitError as e:
    print(f"distributed start-up failed: {e}", file=sys.stderr)
    return 3
  try:
    summary = loop.run(config)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  # Only after a run every process finished: a failed process must not wait at the barrier.
  mesh_lib.shutdown_distributed()
  print(loop.format_summary(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
