"""Profile training steps: compile time, step-time median and p90, an xprof trace, the per-phase
breakdown (core attention, dispatch, return, other) and per-device attention load.

    python launch/profile_steps.py                                   # tiny default model, CPU ok
    python launch/profile_steps.py --config configs/llama_1b.yaml attention.impl=distca --measure 10
    tensorboard --logdir runs/profile/trace                    # Profile tab: the trace

Runs `train.steps = warmup + measure + trace` steps of the normal training loop with
`train.profile=true`: the first steps compile (their time is the compile time), `--warmup` more
are left out of the statistics, `--measure` are timed, and the last `--trace` steps are traced
into <train.out_dir>/trace. Writes <train.out_dir>/profile.json and attention_load.png (per-device
attention load without and with the CAD scheduler) and prints the report. Same config and
multi-host arguments as launch/train.py; overrides given here win over the ones it sets.

(Not named `profile.py`: a script's folder comes first on sys.path, so that file would shadow
the standard library's `profile`, which cProfile imports, for every script in launch/.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _parse(argv):
  from distca_jax.launch_env import add_multihost_args

  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", help="YAML file overriding the defaults (configs/*.yaml)")
  parser.add_argument("--warmup", type=int, default=1, help="steady steps left out of the statistics")
  parser.add_argument("--measure", type=int, default=5, help="timed steps")
  parser.add_argument("--trace", type=int, default=2, help="traced steps (after the timed ones)")
  add_multihost_args(parser)
  parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. model.preset=llama_1b")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = _parse(argv)
  from distca_jax.config import ConfigError, load_config

  # One compile step + warm-up + timed steps precede the trace (a second compile, e.g. a new
  # window bucket, only shifts the statistics; it never lands in the trace's step count).
  first_traced = 1 + args.warmup + args.measure + 1
  defaults = [f"train.steps={first_traced + args.trace - 1}", "train.profile=true",
              f"train.profile_start={first_traced}", f"train.profile_steps={args.trace}",
              f"train.profile_warmup={args.warmup}", "train.out_dir=runs/profile", "train.progress=false",
              # No checkpoints: a second profile into runs/profile must not resume the first.
              "checkpoint.every=0"]
  try:
    config = load_config(args.config, defaults + list(args.overrides))
  except (ConfigError, ValueError) as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  # GPU command buffers (CUDA graphs) hide which HLO op each kernel belongs to from the
  # profiler; run without them (costs some launch overhead: step times are slightly high).
  if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
  from distca_jax.launch_env import run_training

  code, summary = run_training(config, args, log=lambda *a: None)
  if code:
    return code
  from distca_jax.train import loop
  from distca_jax.train import profile as profile_lib

  report_path = Path(config.train.out_dir) / "profile.json"
  if report_path.exists():  # process 0 only
    print(loop.format_summary(summary))
    print(profile_lib.format_report(json.loads(report_path.read_text())))
    print(f"report: {report_path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
