"""A run's checkpointed parameters read on the host, without its optimizer state: what
`launch/convert.py export` writes out as a Hugging Face checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from distca_jax.models.presets import ModelShape
from distca_jax.train.checkpoint import Checkpointer, CheckpointCorruptError
from distca_jax.train.finite import leaf_name


def read_run_params(ck_dir: str | Path, step: int | None = None
                    ) -> tuple[int, ModelShape, dict[str, np.ndarray]]:
  """(step, model shape, {param name: array}) of checkpoint `step` (default: the newest) in
  `ck_dir`. Names as `models/hf.py` spells them (`blocks.0.attn.wq`), in the unpipelined layout
  whatever pipeline stages the run had."""
  checkpointer = Checkpointer(ck_dir, 1, 1, read_only=True)
  step, extra = checkpointer.read_extra(step)
  shape = ModelShape.from_record(extra["model"])
  path = Path(ck_dir).absolute() / str(step) / "state"
  reader = ocp.PyTreeCheckpointer()
  absl = logging.getLogger("absl")
  level = absl.level
  absl.setLevel(logging.ERROR)  # orbax warns that a step item has no metadata file of its own
  try:
    meta = reader.metadata(path).item_metadata
    meta = getattr(meta, "tree", meta)["params"]
    item = jax.tree.map(lambda m: np.zeros((), m.dtype), meta)
    args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    params = reader.restore(path, args=ocp.args.PyTreeRestore(
        item={"params": item}, restore_args={"params": args}, partial_restore=True))["params"]
  except Exception as e:  # orbax/tensorstore raise many unrelated types for unreadable files
    raise CheckpointCorruptError(f"checkpoint step {step} in {ck_dir}: cannot read its "
                                 f"parameters ({type(e).__name__}: {e})") from e
  finally:
    absl.setLevel(level)
  flat = {leaf_name(p).removesuffix("/value").replace("/", "."): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  stages = int(extra.get("pipeline_stages", 1))
  if stages > 1:
    flat = _unstack_blocks(flat, shape.layers, stages)
  return step, shape, flat


def _unstack_blocks(flat: dict[str, np.ndarray], layers: int, stages: int) -> dict[str, np.ndarray]:
  """The pipeline layout's stacked blocks ([stages, layers / stages, ...] under `blocks.<name>`)
  as one entry per layer (`blocks.<i>.<name>`)."""
  per = layers // stages
  out = {}
  for name, x in flat.items():
    if not name.startswith("blocks."):
      out[name] = x
      continue
    rest = name.removeprefix("blocks.")
    for i in range(layers):
      out[f"blocks.{i}.{rest}"] = x[i // per, i % per]
  return out
