"""Train a Llama-style model with colocated or disaggregated core attention.

    python launch/train.py                                  # the default job: configs/tiny.yaml, CAD
    python launch/train.py --config configs/llama_1b.yaml train.steps=100 attention.impl=distca

With no accelerator, JAX's CPU backend is split into `train.cpu_devices` simulated devices (8 by
default) so the mesh code paths are the ones a GPU cluster runs.

Settings: the defaults below, then the `--config` YAML file (without one, configs/tiny.yaml: the
tiny model on 8 simulated CPU devices with CAD on every step), then `section.field=value` overrides
(values read as YAML: `true`, `1e-4`, `[0, 1]`). `--print-config` prints the resolved
configuration as YAML (a file `--config` reads back) and exits without training. A bad value stops
the command before JAX starts with one `config error: <field>: ...` line and exit status 2.

Outputs: each run writes config.json, summary.json, tb/ and checkpoints/ into `train.out_dir`;
unset, into a new `runs/<config name>-<YYYYmmdd-HHMMSS>`, linked as `runs/latest`. Checkpoints are
saved every `checkpoint.every` steps and where the run ends. Resume: the same command with
`train.out_dir=` that run's directory (e.g. `runs/latest`) continues from its newest good
checkpoint (`checkpoint.step=N` picks one; one that fails its checksums or cannot be read is
skipped and renamed `<step>.aside`); a directory that holds another run's checkpoints is never
silently started over, and a refused run writes nothing into it. SIGTERM or Ctrl-C stops a run after the step it is in, with a
checkpoint and the summary; the exit status is then 128 + the signal's number (143, 130).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The default job's config: what `python launch/train.py` runs without --config.
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def _parse(argv):
  from distca_jax.config import Config
  from distca_jax.launch_env import add_multihost_args
  from distca_jax.schema_io import describe

  schema = "\n".join(["configuration (distca_jax/config.py; type, [default], the field's comment):",
                      ""] + describe(Config))
  parser = argparse.ArgumentParser(description=__doc__, epilog=schema,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                      help="YAML file overriding the defaults (configs/*.yaml; default: the "
                           "default job, configs/tiny.yaml)")
  parser.add_argument("--print-config", action="store_true",
                      help="print the resolved configuration as YAML and exit (nothing runs)")
  add_multihost_args(parser)
  parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=10")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = _parse(argv)
  # Config first (no jax import yet): the CPU device count must be set before jax starts.
  from distca_jax.config import ConfigError, load_config, to_yaml

  try:
    config = load_config(args.config, args.overrides)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  if args.print_config:
    print(to_yaml(config), end="")
    return 0
  from distca_jax.launch_env import run_training

  code, summary = run_training(config, args)
  if summary is not None:  # also a run SIGTERM / SIGINT stopped (code 128 + the signal's number)
    from distca_jax.train import loop

    print(loop.format_summary(summary))
  return code


if __name__ == "__main__":
  sys.exit(main())
