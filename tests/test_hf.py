"""Hugging Face checkpoints in and out (`models/hf.py`, `launch/convert.py`, `model.init_from`).

Every checkpoint here is written by the test in Hugging Face's layout (`helpers.hf_tensors`) and
every expected value comes from transformers' equations written out in numpy (`helpers.hf_logits`)
or the published RoPE formulas (`helpers.hf_inv_freq`), never from our own writer.
"""

import json
import math

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from distca_jax import attention as attn
from distca_jax import mesh as mesh_lib
from distca_jax.config import ConfigError
from distca_jax.data.sources import make_batch
from distca_jax.models import hf, rope
from distca_jax.train.evaluate import document_logits
from distca_jax.train.step import Trainer
from helpers import (HF_TINY, hf_inv_freq, hf_logits, hf_loss, hf_tensors, launch_script,
                     small_config, write_hf_checkpoint)

convert = launch_script("convert")

LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
QWEN2 = dict(HF_TINY, architectures=["Qwen2ForCausalLM"], model_type="qwen2", rms_norm_eps=1e-6,
             tie_word_embeddings=True, use_sliding_window=False, sliding_window=4096)


def _checkpoint(tmp_path, cfg, name="hf", shards=1, dtype=np.float32, seed=0):
  t = hf_tensors(cfg, seed, dtype)
  write_hf_checkpoint(tmp_path / name, cfg, t, shards)
  return tmp_path / name, t


def _our_logits(paths, tokens):
  """Logits of one document of `tokens` from the parameters of each checkpoint of `paths` (all
  of the first one's shape), on one device in fp32."""
  cfg = small_config(f"model.init_from={paths[0]}", "data.tokens_per_device=128", "mesh.data=1")
  return document_logits(cfg, tokens, paths)


@pytest.mark.parametrize("case", ["llama_sharded_llama3", "qwen2_tied_bias_yarn"])
def test_imported_logits_match_transformers_equations(tmp_path, case):
  """Logits of the model started from a Hugging Face directory (and from its import) equal the
  numpy implementation of transformers' Llama / Qwen2 in fp32 to 1e-4."""
  if case == "llama_sharded_llama3":
    cfg, shards = dict(HF_TINY, rope_scaling=LLAMA3), 3
  else:
    cfg, shards = dict(QWEN2, rope_scaling=YARN), 1
  path, t = _checkpoint(tmp_path, cfg, shards=shards)
  tokens = np.random.default_rng(1).integers(0, cfg["vocab_size"], 128).astype(np.int32)
  want = hf_logits(t, cfg, tokens)
  assert convert.main(["import", str(path), str(tmp_path / "imported")]) == 0
  got, imported = _our_logits([path, tmp_path / "imported"], tokens)
  assert np.max(np.abs(got - want)) <= 1e-4 * max(1.0, np.max(np.abs(want))), np.max(np.abs(got - want))
  np.testing.assert_array_equal(imported, got)


def test_rope_inverse_frequencies_follow_the_published_formulas():
  """llama3 (Llama 3.1's own numbers) and YaRN against the formulas, and spot values worked by
  hand: Llama 3.1 keeps frequencies 0-28, divides 35-63 by 8; YaRN (head 128, 4096 -> x4) keeps
  dimensions below 20, divides from 46 by 4, and is half-way at 33."""
  cfg = dict(HF_TINY, hidden_size=512, num_attention_heads=4, rope_theta=500_000.0,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
  ours = rope.inv_freq(128, 500_000.0, hf.shape_fields(cfg)["rope_scaling"])
  plain = 500_000.0 ** (-np.arange(0, 128, 2) / 128)
  np.testing.assert_allclose(ours, hf_inv_freq(cfg)[0], rtol=1e-6)
  np.testing.assert_allclose(ours[:29], plain[:29], rtol=1e-6)
  np.testing.assert_allclose(ours[35:], plain[35:] / 8, rtol=1e-6)
  assert np.all((ours[29:35] < plain[29:35]) & (ours[29:35] > plain[29:35] / 8))

  cfg = dict(HF_TINY, hidden_size=512, num_attention_heads=4, rope_theta=10_000.0,
             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})
  scaling = hf.shape_fields(cfg)["rope_scaling"]
  ours = rope.inv_freq(128, 10_000.0, scaling)
  plain = 10_000.0 ** (-np.arange(0, 128, 2) / 128)
  want, factor = hf_inv_freq(cfg)
  np.testing.assert_allclose(ours, want, rtol=1e-6)
  np.testing.assert_allclose(ours[:20], plain[:20], rtol=1e-6)
  np.testing.assert_allclose(ours[46:], plain[46:] / 4, rtol=1e-6)
  np.testing.assert_allclose(ours[33], 0.625 * plain[33], rtol=1e-6)
  assert rope.attention_factor(scaling) == pytest.approx(factor) == pytest.approx(0.1 * math.log(4) + 1)


def _tensors(path):
  out = {}
  for f in sorted(path.glob("*.safetensors")):
    with safe_open(str(f), framework="np") as h:
      out.update({k: h.get_tensor(k) for k in h.keys()})
  return out


def test_import_export_is_bit_exact_from_the_import_and_from_a_run(tmp_path):
  """bf16 in, bf16 out, every tensor's bytes unchanged: straight from the imported directory,
  and from a run's checkpoint started from it (its fp32 parameters round back exactly)."""
  from distca_jax.train.checkpoint import Checkpointer

  cfg = dict(HF_TINY, torch_dtype="bfloat16", bos_token_id=7)
  path, t = _checkpoint(tmp_path, cfg, shards=2, dtype=ml_dtypes.bfloat16)
  imported, back = tmp_path / "imported", tmp_path / "back"
  assert convert.main(["import", str(path), str(imported), "--max-shard-bytes", "20000"]) == 0
  assert len(list(imported.glob("params-*.safetensors"))) > 1
  assert convert.main(["export", str(imported), str(back), "--max-shard-bytes", "30000"]) == 0
  index = json.loads((back / "model.safetensors.index.json").read_text())
  assert set(index["weight_map"]) == set(t)
  got = _tensors(back)
  for name, x in t.items():
    assert got[name].dtype == x.dtype and got[name].tobytes() == x.tobytes(), name
  exported = json.loads((back / "config.json").read_text())
  assert {k: exported[k] for k in cfg if k != "rope_scaling"} == {k: v for k, v in cfg.items()
                                                                  if k != "rope_scaling"}

  # A run's checkpoint: the trainer's state saved as the loop saves it.
  run = tmp_path / "run"
  conf = small_config(f"model.init_from={imported}", "mesh.data=2", "mesh.tensor=2")
  trainer = Trainer(conf, mesh_lib.make_mesh(conf.mesh, jax.devices()[:4]))
  with Checkpointer(run / "checkpoints", 1, 1) as ck:
    ck.maybe_save(0, trainer.init_state(0), {"step": 0, "model": trainer.shape.record()}, force=True)
  (run / "config.json").write_text(json.dumps({"model": {"init_from": str(imported)}, "checkpoint": {}}))
  assert convert.main(["export", str(run), str(tmp_path / "from_run")]) == 0
  got = _tensors(tmp_path / "from_run")
  for name, x in t.items():
    assert got[name].dtype == x.dtype and got[name].tobytes() == x.tobytes(), name


@pytest.fixture(scope="module")
def step0(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("step0")
  cfg = dict(QWEN2)
  path, t = _checkpoint(tmp, cfg)
  lens = np.array([200, 150, 100, 62])
  tokens = np.random.default_rng(2).integers(0, cfg["vocab_size"], lens.sum()).astype(np.int32)
  return path, hf_loss(t, cfg, lens, tokens), lens, tokens


@pytest.mark.parametrize("layout", ["one_device", "fsdp_tensor", "cad"])
def test_step0_loss_is_the_checkpoints_on_any_layout(step0, layout):
  """The step-0 loss of a run started from a checkpoint (tied, with q/k/v bias) equals
  transformers' equations on one device, on 8 devices with FSDP and tensor parallelism, and
  with CAD's exchange."""
  path, want, lens, tokens = step0
  n, args = {"one_device": (1, ["mesh.data=1", "data.tokens_per_device=512"]),
             "fsdp_tensor": (8, ["mesh.data=4", "mesh.tensor=2", "data.tokens_per_device=128"]),
             "cad": (8, ["mesh.data=4", "mesh.tensor=2", "data.tokens_per_device=128",
                         "attention.impl=distca", "attention.gate=false"])}[layout]
  cfg = small_config(f"model.init_from={path}", *args)
  batch = make_batch(lens, tokens, cfg.mesh.data, cfg.data.tokens_per_device)
  trainer = Trainer(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:n]))
  arrays, ctx = trainer.put_batch(batch, attn.host_context(cfg.attention, batch, trainer.shape))
  loss = float(jax.jit(trainer.loss_fn)(trainer.load_params(str(path)), arrays, ctx)[0])
  assert loss == pytest.approx(want, rel=1e-5)


def _refused(tmp_path, cfg, tensors, *, needle):
  write_hf_checkpoint(tmp_path / "bad", cfg, tensors)
  out = tmp_path / "out"
  assert convert.main(["import", str(tmp_path / "bad"), str(out)]) == 2
  assert not out.exists() and not list(tmp_path.glob(".out.partial*"))
  with pytest.raises(hf.CheckpointFormatError, match=needle):
    hf.Checkpoint(tmp_path / "bad")


@pytest.mark.parametrize("what", ["architecture", "sliding_window", "moe", "missing", "extra", "shape"])
def test_refusals_name_what_and_write_nothing(tmp_path, what):
  cfg, t = dict(HF_TINY), hf_tensors(HF_TINY)
  needle = {"architecture": "GPT2LMHeadModel", "sliding_window": "sliding_window=4096",
            "moe": "num_local_experts", "missing": "model.layers.1.mlp.up_proj.weight is missing",
            "extra": "model.layers.0.self_attn.o_proj.bias", "shape": "gate_proj.weight has shape \\[96, 64\\], config.json implies \\[128, 64\\]"}[what]
  if what == "architecture":
    cfg["architectures"] = ["GPT2LMHeadModel"]
  elif what == "sliding_window":
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096)
  elif what == "moe":
    cfg["num_local_experts"] = 4
  elif what == "missing":
    del t["model.layers.1.mlp.up_proj.weight"]
  elif what == "extra":
    t["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
  else:
    cfg["intermediate_size"] = 128
  _refused(tmp_path, cfg, t, needle=needle)


def test_init_from_config_errors_name_the_field(tmp_path):
  """An explicit model field that disagrees with the checkpoint is an error naming it; RoPE
  fields may change; a scaling type without its fields is refused naming the field."""
  path, _ = _checkpoint(tmp_path, dict(HF_TINY, rope_scaling=LLAMA3))
  with pytest.raises(ConfigError, match="model.hidden: 32 disagrees"):
    small_config(f"model.init_from={path}", "model.hidden=32")
  with pytest.raises(ConfigError, match="model.tie_embeddings"):
    small_config(f"model.init_from={path}", "model.tie_embeddings=true")
  with pytest.raises(ConfigError, match="model.init_from: .*nope"):
    small_config(f"model.init_from={tmp_path / 'nope'}")
  from distca_jax.models.presets import resolve

  extended = resolve(small_config(f"model.init_from={path}", "model.rope_theta=1e6",
                                  "model.rope_scaling.factor=32").model)
  assert extended.rope_theta == 1e6 and extended.rope_scaling.factor == 32
  assert extended.rope_scaling.original_max_position_embeddings == 64 and extended.hidden == 64
  assert resolve(small_config(f"model.init_from={path}", "model.rope_scaling.type=none").model).rope_scaling is None
  with pytest.raises(ConfigError, match="model.rope_scaling.factor: required"):
    small_config("model.rope_scaling.type=yarn")
  with pytest.raises(ConfigError, match="model.rope_scaling.beta_fast: not used"):
    small_config("model.rope_scaling.type=linear", "model.rope_scaling.factor=2",
                 "model.rope_scaling.beta_fast=16")


def test_export_keeps_the_rope_scaling_and_the_architecture(tmp_path):
  """Qwen2 (tied, biased) with YaRN in, the same architecture and Hugging Face's rope_scaling out."""
  cfg = dict(QWEN2, rope_scaling=YARN)
  path, _ = _checkpoint(tmp_path, cfg)
  assert convert.main(["import", str(path), str(tmp_path / "imported")]) == 0
  assert convert.main(["export", str(tmp_path / "imported"), str(tmp_path / "back")]) == 0
  back = json.loads((tmp_path / "back" / "config.json").read_text())
  assert back["architectures"] == ["Qwen2ForCausalLM"] and back["tie_word_embeddings"] is True
  assert back["rope_scaling"] == YARN and back["max_position_embeddings"] == 256
  assert hf.Checkpoint(tmp_path / "back").fields == hf.Checkpoint(path).fields
  assert convert.main(["export", str(tmp_path / "imported"), str(tmp_path / "back")]) == 2  # not empty


def test_sharded_load_reads_only_each_devices_slices(step0, monkeypatch):
  """FSDP over 4 and tensor parallelism over 2: every read of a projection is one device's
  shard (an eighth of it), never the whole tensor."""
  path = step0[0]
  reads = []
  read = hf.Checkpoint.read
  monkeypatch.setattr(hf.Checkpoint, "read", lambda self, name, index=None: reads.append(
      (name, read(self, name, index).size)) or read(self, name, index))
  cfg = small_config(f"model.init_from={path}", "mesh.data=4", "mesh.tensor=2",
                     "data.tokens_per_device=128")
  trainer = Trainer(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:8]))
  trainer.load_params(str(path))
  wq = [size for name, size in reads if name == "blocks.0.attn.wq"]
  assert len(wq) == 8 and all(size == 64 * 64 // 8 for size in wq), wq


def test_pipelined_checkpoints_export_one_entry_per_layer():
  """A pipeline's stacked blocks come back as the unpipelined model's, as `join_blocks` does."""
  from distca_jax.train import pipeline
  from distca_jax.train.export import _unstack_blocks

  rng = np.random.default_rng(0)
  pure = {"embed": rng.normal(size=(4, 2)), "final_norm": {"scale": rng.normal(size=2)},
          "lm_head": rng.normal(size=(2, 4)),
          "blocks": {i: {"attn": {"wq": rng.normal(size=(2, 3)).astype(np.float32)}} for i in range(4)}}
  stacked = pipeline.split_blocks(pure, 4, 2)
  flat = {"blocks.attn.wq": np.asarray(stacked["blocks"]["attn"]["wq"]), "embed": pure["embed"]}
  out = _unstack_blocks(flat, 4, 2)
  for i in range(4):
    np.testing.assert_array_equal(out[f"blocks.{i}.attn.wq"], pure["blocks"][i]["attn"]["wq"])


def test_a_run_started_from_a_checkpoint_resumes_its_own(tmp_path, step0, monkeypatch):
  """A run started from `model.init_from` that has a checkpoint of its own resumes it without
  reading the source's parameters."""
  from distca_jax.train import loop

  args = [f"model.init_from={step0[0]}", "mesh.data=1", "data.tokens_per_device=128",
          "optim.decay_steps=10", "train.imbalance_after=false", f"train.out_dir={tmp_path / 'run'}"]
  first = loop.run(small_config(*args, "train.steps=1"), devices=jax.devices()[:1], log=lambda *a: None)
  assert first.start_step == 0

  def no_reads(*a, **k):
    raise AssertionError("the source was read")

  monkeypatch.setattr(hf.Checkpoint, "read", no_reads)
  messages = []
  again = loop.run(small_config(*args, "train.steps=2"), devices=jax.devices()[:1],
                   log=messages.append)
  assert again.start_step == 1 and len(again.losses) == 1
  assert any("resumed from checkpoint at step 1" in m for m in messages), messages
