"""Checks the Hugging Face converter against transformers itself (needs torch and transformers,
which the package does not depend on; runs on the CPU, a minute or two).

  python launch/tools/hf_reference_check.py [--out DIR] [--keep]

For each case (Llama, Qwen2 with q/k/v bias, Mistral, Llama with tied embeddings, Llama with
llama3 and with yarn RoPE scaling) it builds a tiny random model with transformers, saves it with
`save_pretrained` (safetensors, fp32), imports it with `launch/convert.py import`, and compares:
  import  our logits (`model.init_from` the import, fp32) with transformers' on the same tokens;
  export  transformers' logits of `from_pretrained` on `launch/convert.py export` of the import
          with the original model's.
Prints one row per case (max abs differences, pass/fail at 1e-4 x max(1, max |logit|)) and exits
1 if any case fails or cannot run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

TOKENS = 128  # one document, positions 0..127 (data.tokens_per_device's smallest)
TOLERANCE = 1e-4
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10_000.0,
              max_position_embeddings=128)
# Scaled cases: a pretrained context of 32 extended 4x, so positions 0..127 reach past it; the
# max_position_embeddings the product of the two (transformers versions differ on which wins).
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama_llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "llama_yarn": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
}


def _convert():
  """launch/convert.py as a module (launch/ is scripts, not a package)."""
  path = Path(__file__).resolve().parents[1] / "convert.py"
  spec = importlib.util.spec_from_file_location("launch_convert", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _torch_model(name: str, seed: int):
  import torch
  import transformers

  config_cls, model_cls, extra = CASES[name]
  config = getattr(transformers, config_cls)(**COMMON, **extra)
  config.tie_word_embeddings = extra.get("tie_word_embeddings", False)
  torch.manual_seed(seed)
  model = getattr(transformers, model_cls)(config).float().eval()
  # transformers' initialisation (std 0.02) leaves logits near zero: widen it so a wrong layout
  # shows.
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if p.ndim == 2:
        p.normal_(0.0, p.shape[1] ** -0.5)
      elif "norm" in pname:
        p.copy_(1 + 0.1 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.5)
  return model


def _torch_logits(model, tokens):
  import torch

  with torch.no_grad():
    ids = torch.tensor(tokens[None].astype("int64"))
    return model(input_ids=ids).logits[0].double().numpy()


def _our_logits(path: Path, tokens):
  import numpy as np

  from distca_jax.config import load_config
  from distca_jax.train.evaluate import document_logits

  cfg = load_config(None, [f"model.init_from={path}", "model.dtype=float32", "model.remat=none",
                           f"data.tokens_per_device={TOKENS}", "mesh.data=1", "attention.gate=false"])
  return document_logits(cfg, tokens, [path])[0].astype(np.float64)


def check(name: str, work: Path, convert) -> tuple[float, float, float]:
  """(max |ours - transformers|, max |export reloaded - transformers|, max(1, max |logit|))."""
  import numpy as np
  import transformers

  model = _torch_model(name, seed=len(name))
  hf_dir, imported, exported = work / f"{name}_hf", work / f"{name}_imported", work / f"{name}_export"
  model.save_pretrained(hf_dir, safe_serialization=True)
  tokens = np.random.default_rng(0).integers(0, COMMON["vocab_size"], TOKENS).astype(np.int32)
  want = _torch_logits(model, tokens)
  scale = max(1.0, float(np.max(np.abs(want))))
  if convert.main(["import", str(hf_dir), str(imported)]) != 0:
    raise RuntimeError("import refused")
  ours = _our_logits(imported, tokens)
  if convert.main(["export", str(imported), str(exported)]) != 0:
    raise RuntimeError("export refused")
  reloaded = getattr(transformers, CASES[name][1]).from_pretrained(exported).float().eval()
  back = _torch_logits(reloaded, tokens)
  return float(np.max(np.abs(ours - want))), float(np.max(np.abs(back - want))), scale


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=__doc__.split("\n\n", 1)[1])
  parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
  parser.add_argument("--keep", action="store_true", help="keep the work directory")
  parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  try:
    import torch  # noqa: F401
    import transformers
  except ImportError as e:
    print(f"hf_reference_check: needs torch and transformers ({e})", file=sys.stderr)
    return 1
  work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="hf_reference_check_"))
  work.mkdir(parents=True, exist_ok=True)
  convert = _convert()
  print(f"transformers {transformers.__version__}, work directory {work}")
  print(f"{'model':<14} {'import max|diff|':>17} {'export-reload max|diff|':>24}  result")
  failed = 0
  for name in args.cases:
    try:
      d_import, d_export, scale = check(name, work, convert)
      ok = d_import <= TOLERANCE * scale and d_export <= TOLERANCE * scale
      print(f"{name:<14} {d_import:>17.2e} {d_export:>24.2e}  {'pass' if ok else 'FAIL'}", flush=True)
    except Exception as e:  # one broken case must not hide the others' results
      ok = False
      print(f"{name:<14} {'-':>17} {'-':>24}  FAIL ({type(e).__name__}: {e})", flush=True)
      traceback.print_exc(file=sys.stderr)
    failed += not ok
  print(f"pass: both differences at most {TOLERANCE:g} x max(1, max |logit|)")
  if not args.keep and not args.out:
    shutil.rmtree(work, ignore_errors=True)
  print(f"{len(args.cases) - failed}/{len(args.cases)} cases pass")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
