"""Hugging Face Llama-family checkpoints in and out (formats: models/hf.py).

  python launch/convert.py import HF_DIR OUT
  python launch/convert.py export RUN_DIR OUT [--step N] [--dtype bfloat16]
  python launch/convert.py export IMPORTED_DIR OUT

`import` reads a local Hugging Face directory (config.json, model.safetensors or its shards with
model.safetensors.index.json) of a LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM and
writes the parameters in this model's names and layouts (dtype unchanged); train from it with
`model.init_from=OUT` (or point `model.init_from` at the Hugging Face directory itself). Nothing
is downloaded.

`export` writes a Hugging Face directory (config.json, sharded model.safetensors with an index)
from a run's checkpoint (the newest, or `--step`) or an imported directory. Its dtype is the
original checkpoint's when the run started from one, else bfloat16 (`--dtype` sets it).

A checkpoint this model cannot represent, or an output directory that is not new or empty, is
refused with one line and exit 2 before anything is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


from distca_jax.models import hf


def import_command(hf_dir: str, out: str, shard_bytes: int) -> str:
  source = hf.import_hf(hf_dir, out, shard_bytes)
  f = source.fields
  return (f"imported {source.hf['architectures'][0]} ({f['layers']} layers, hidden {f['hidden']}, "
          f"{source.dtype}) into {out}; train from it with model.init_from={out}")


def export_command(src: str, out: str, step: int | None, dtype: str | None, shard_bytes: int) -> str:
  path = Path(src)
  if (path / hf.IMPORTED_META).is_file():
    if step is not None:
      raise hf.CheckpointFormatError(f"--step: {src} is an imported checkpoint, it has no steps")
    source = hf.Checkpoint(path)
    fields, base, dtype = source.fields, source.hf, dtype or source.dtype
    read, what = source.read, "the imported parameters"
  else:
    fields, base, params, step, default_dtype = _run_params(path, step)
    dtype = dtype or default_dtype
    read, what = params.__getitem__, f"step {step} of {src}"
  hf.export_hf(fields, read, out, dtype, base, shard_bytes)
  return f"exported {what} as a Hugging Face checkpoint ({dtype}) into {out}"


def _run_params(run_dir: Path, step: int | None):
  """(shape fields, base HF config or None, {name: fp32 array}, step, default dtype) of a run's
  checkpoint: the parameters only, read on the host (the optimizer state is not read)."""
  from distca_jax.train.checkpoint import CheckpointError
  from distca_jax.train.export import read_run_params

  config_path = run_dir / "config.json"
  if not config_path.is_file():
    raise hf.CheckpointFormatError(f"{run_dir}: neither a run directory (config.json) nor an "
                                   f"imported checkpoint ({hf.IMPORTED_META})")
  config = json.loads(config_path.read_text())
  ck_dir = Path(config.get("checkpoint", {}).get("dir") or run_dir / "checkpoints")
  try:
    step, shape, params = read_run_params(ck_dir, step)
  except CheckpointError as e:
    raise hf.CheckpointFormatError(str(e)) from None
  fields = {name: getattr(shape, name) for name in shape.__dataclass_fields__}
  base, dtype = None, "bfloat16"
  init_from = config.get("model", {}).get("init_from")
  if init_from:
    try:
      source = hf.Checkpoint(init_from)
      base, dtype = source.hf, source.dtype
    except hf.CheckpointFormatError:
      pass  # moved since: the exported config is built from the shape alone
  return fields, base, params, step, dtype


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=__doc__.split("\n\n", 1)[1])
  sub = parser.add_subparsers(dest="command", required=True)
  p_import = sub.add_parser("import", help="Hugging Face directory -> parameters for model.init_from")
  p_import.add_argument("hf_dir")
  p_import.add_argument("out")
  p_export = sub.add_parser("export", help="a run's checkpoint (or an imported one) -> Hugging Face")
  p_export.add_argument("src", help="a run's directory (train.out_dir) or an imported checkpoint")
  p_export.add_argument("out")
  p_export.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: newest)")
  p_export.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
  for p in (p_import, p_export):
    p.add_argument("--max-shard-bytes", type=int, default=hf.HF_SHARD_BYTES,
                   help="largest safetensors file (default: transformers' 5 GB)")
  args = parser.parse_args(argv)
  try:
    if args.command == "import":
      print(import_command(args.hf_dir, args.out, args.max_shard_bytes))
    else:
      print(export_command(args.src, args.out, args.step, args.dtype, args.max_shard_bytes))
  except hf.CheckpointFormatError as e:
    print(f"convert: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
