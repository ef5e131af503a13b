"""The context-extension recipe end to end in its CPU miniature (configs/prolong_mini.yaml): a
Hugging Face checkpoint imported, trained from with a raised RoPE base on a mixture of long and
short sources (documents cut at the training length, gradient accumulation, CAD), evaluated by
position, exported back; the checkpoint keeps the data layout and each source's tokens; a resume
on another layout is refused in one line."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from distca_jax.config import ConfigError, load_config
from distca_jax.data.mixture import mixture_from_config
from distca_jax.train import loop
from distca_jax.train.checkpoint import Checkpointer
from helpers import HF_TINY, hf_tensors, launch_script, write_hf_checkpoint

ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT / "configs" / "prolong_mini.yaml"


def test_the_recipe_miniature_from_import_to_export(tmp_path):
  convert = launch_script("convert")
  pretrained, imported = tmp_path / "hf", tmp_path / "imported"
  write_hf_checkpoint(pretrained, HF_TINY, hf_tensors(HF_TINY))
  assert convert.main(["import", str(pretrained), str(imported)]) == 0
  run = tmp_path / "run"
  start = [f"train.out_dir={run}", "train.tensorboard=false", f"model.init_from={imported}"]
  cfg = load_config(MINI, start)
  assert cfg.train.microbatches > 1 and len(cfg.data.mixture) > 1 and cfg.data.max_doc_len
  assert cfg.attention.impl == "distca" and cfg.eval.batches > 0
  summary = loop.run(cfg, devices=jax.devices()[:cfg.mesh.data], log=lambda *_: None)
  assert summary.eval_loss is not None and np.isfinite(summary.eval_loss)
  assert summary.evals[-1]["step"] == cfg.train.steps

  # The pretrained model's held-out loss on the same batches, the baseline the run is judged by.
  assert launch_script("eval").main([str(run), "--init"]) == 0
  before = json.loads((run / "eval-step0.json").read_text())
  assert np.isfinite(before["loss"]) and before["tokens"] == summary.evals[-1]["tokens"]

  exported = tmp_path / "exported"
  assert convert.main(["export", str(run), str(exported)]) == 0
  hf_config = json.loads((exported / "config.json").read_text())
  assert hf_config["rope_theta"] == cfg.model.rope_theta != HF_TINY["rope_theta"]
  assert hf_config["hidden_size"] == HF_TINY["hidden_size"]

  assert summary.steps == cfg.train.steps and summary.microbatches == cfg.train.microbatches
  assert all(np.isfinite(summary.losses)) and summary.colocated_steps == 0  # CAD on every step
  batches = cfg.train.steps * cfg.train.microbatches
  mix = mixture_from_config(cfg.data, 512, cfg.mesh.data)
  assert summary.data_tokens == mix.tokens_by_source(batches)
  total = batches * cfg.mesh.data * cfg.data.tokens_per_device
  assert sum(summary.data_tokens.values()) == total
  for source in cfg.data.mixture:  # each source's weight of the tokens, to the token
    assert abs(summary.data_tokens[source.name] - source.weight * total) <= 1

  with Checkpointer(run / "checkpoints", save_every=1, keep=3) as ck:
    step, extra = ck.read_extra()
  assert step == cfg.train.steps
  assert extra["data"]["layout"]["microbatches"] == cfg.train.microbatches
  assert extra["data"]["tokens_by_source"] == summary.data_tokens

  # Resumed without accumulation, its batches would differ: refused in one line naming the change.
  more = start + ["train.microbatches=1", f"train.steps={cfg.train.steps + 1}"]
  with pytest.raises(ConfigError, match="train.microbatches 2 -> 1.*data.resume_new_layout") as e:
    loop.run(load_config(MINI, more), devices=jax.devices()[:cfg.mesh.data], log=lambda *_: None)
  assert "\n" not in str(e.value)
