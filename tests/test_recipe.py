"""The context-extension recipe: its CPU miniature (configs/prolong_mini.yaml: a mixture of
long and short sources, documents cut at the training length, gradient accumulation, CAD) runs
end to end; its checkpoint keeps the data layout and each source's tokens; a resume on another
layout is refused in one line."""

from pathlib import Path

import jax
import numpy as np
import pytest

from distca_jax.config import ConfigError, load_config
from distca_jax.data.mixture import mixture_from_config
from distca_jax.train import loop
from distca_jax.train.checkpoint import Checkpointer

ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT / "configs" / "prolong_mini.yaml"


def test_the_recipe_miniature_trains_and_keeps_its_data_layout(tmp_path):
  cfg = load_config(MINI, [f"train.out_dir={tmp_path}", "train.tensorboard=false"])
  assert cfg.train.microbatches > 1 and len(cfg.data.mixture) > 1 and cfg.data.max_doc_len
  assert cfg.attention.impl == "distca"
  summary = loop.run(cfg, devices=jax.devices()[:cfg.mesh.data], log=lambda *_: None)

  assert summary.steps == cfg.train.steps and summary.microbatches == cfg.train.microbatches
  assert all(np.isfinite(summary.losses)) and summary.colocated_steps == 0  # CAD on every step
  batches = cfg.train.steps * cfg.train.microbatches
  mix = mixture_from_config(cfg.data, 512, cfg.mesh.data)
  assert summary.data_tokens == mix.tokens_by_source(batches)
  total = batches * cfg.mesh.data * cfg.data.tokens_per_device
  assert sum(summary.data_tokens.values()) == total
  for source in cfg.data.mixture:  # each source's weight of the tokens, to the token
    assert abs(summary.data_tokens[source.name] - source.weight * total) <= 1

  with Checkpointer(tmp_path / "checkpoints", save_every=1, keep=3) as ck:
    step, extra = ck.read_extra()
  assert step == cfg.train.steps
  assert extra["data"]["layout"]["microbatches"] == cfg.train.microbatches
  assert extra["data"]["tokens_by_source"] == summary.data_tokens

  # Resumed without accumulation, its batches would differ: refused in one line naming the change.
  more = [f"train.out_dir={tmp_path}", "train.microbatches=1", f"train.steps={cfg.train.steps + 1}"]
  with pytest.raises(ConfigError, match="train.microbatches 2 -> 1.*data.resume_new_layout") as e:
    loop.run(load_config(MINI, more), devices=jax.devices()[:cfg.mesh.data], log=lambda *_: None)
  assert "\n" not in str(e.value)
