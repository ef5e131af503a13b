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
  from distca_jax.launch_env import add_multihost_args

  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", help="YAML file overriding the defaults (configs/*.yaml)")
  add_multihost_args(parser)
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
  from distca_jax.launch_env import run_training

  code, summary = run_training(config, args)
  if code:
    return code
  from distca_jax.train import loop

  print(loop.format_summary(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
