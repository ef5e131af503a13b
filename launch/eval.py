"""Evaluate a saved checkpoint on held-out batches, without training.

    python launch/eval.py runs/latest                       # its newest checkpoint
    python launch/eval.py runs/latest --step 200 eval.batches=8 eval.buckets=[1024,8192]
    python launch/eval.py runs/latest --init                # its model.init_from, before training

Reads the run's config.json (then `section.field=value` overrides: the `eval` section says which
batches and position buckets), restores the checkpoint's parameters onto the run's mesh and
attention path (CAD included; the same data ranks, so the same held-out batches), and prints the held-out loss, perplexity and loss by token
position (`distca_jax/train/evaluate.py`), also written to RUN_DIR/eval-step<N>.json. Exit
status 2 with one line for a bad config or a checkpoint that is not there or of another model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
  from distca_jax.launch_env import add_multihost_args

  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("run_dir", help="a training run's directory (its config.json, checkpoints/)")
  parser.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
  parser.add_argument("--init", action="store_true",
                      help="evaluate the parameters the run started from (model.init_from), step 0")
  add_multihost_args(parser)
  parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. eval.batches=8")
  args = parser.parse_args(argv)
  from distca_jax.config import ConfigError, load_config

  run_dir = Path(args.run_dir)
  if not (run_dir / "config.json").exists():
    print(f"config error: {run_dir}: no config.json (not a training run's directory)", file=sys.stderr)
    return 2
  try:
    # The recorded config, but a run's out_dir and checkpoints are where they are now.
    config = load_config(run_dir / "config.json", list(args.overrides) + [f"train.out_dir={run_dir}"])
    if not config.eval.batches:
      raise ConfigError("eval.batches: 0, nothing to evaluate (set eval.batches=N)")
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  from distca_jax.launch_env import configure_xla

  configure_xla(cpu_devices=config.train.cpu_devices)
  import jax

  from distca_jax import mesh as mesh_lib
  from distca_jax.train import evaluate, loop
  from distca_jax.train.checkpoint import CheckpointError
  from distca_jax.train.step import Trainer

  mesh_lib.initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                  timeout_s=config.train.init_timeout_s,
                                  heartbeat_s=config.train.heartbeat_timeout_s)
  ck_dir = Path(config.checkpoint.dir) if config.checkpoint.dir else run_dir / "checkpoints"
  try:
    m = config.mesh
    # The run's mesh: the held-out batches have a buffer per data rank (on a machine with more
    # devices than a set mesh.data needs, the first of them).
    devices = jax.devices()[:m.data * m.pipe * m.tensor] if m.data > 0 else None
    mesh = mesh_lib.make_mesh(m, devices)
    trainer = Trainer(config, mesh)
    params, step = evaluate.restore_params(trainer, ck_dir, args.step, init=args.init)
    evaluator = evaluate.make_evaluator(trainer.config, trainer, loop.make_source,
                                        mesh_lib.local_rows(mesh))
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  except CheckpointError as e:
    print(f"checkpoint error: {e}", file=sys.stderr)
    return 2
  result = evaluator(params, step)
  print(result.line())
  if jax.process_index() == 0:
    (run_dir / f"eval-step{step}.json").write_text(json.dumps(result.as_dict(), indent=2))
  mesh_lib.shutdown_distributed()
  return 0


if __name__ == "__main__":
  sys.exit(main())
