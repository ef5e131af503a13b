"""Every configuration error fails at start-up with a message that names the field (and, for a
closed set, the allowed values); every shipped YAML loads."""

from pathlib import Path

import jax
import pytest

from distca_jax.config import Config, ConfigError, MeshConfig, load_config, parse_override
from distca_jax.mesh import make_mesh
from helpers import launch_script

ROOT = Path(__file__).resolve().parents[1]
# Simulator configs (sim_*.yaml) have their own schema (distca_jax/sim/config.py).
TRAIN_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("sim_"))
SIM_CONFIGS = sorted((ROOT / "configs").glob("sim_*.yaml"))


def _error(*overrides, path=None) -> str:
  with pytest.raises(ConfigError) as info:
    load_config(path, list(overrides))
  return str(info.value)


def test_defaults_are_valid():
  assert load_config(None, []) == Config()


@pytest.mark.parametrize("override, field", [
    ("model.nope=1", "model.nope"),
    ("nope.x=1", "nope"),
    ("train.stepz=3", "train.stepz"),
])
def test_unknown_key_named(override, field):
  msg = _error(override)
  assert msg.startswith(f"{field}:") and "unknown field" in msg


def test_unknown_key_lists_known_fields():
  assert "'steps'" in _error("train.stepz=3")


@pytest.mark.parametrize("override, field, allowed", [
    ("attention.impl=foo", "attention.impl", ["colocated", "distca"]),
    ("attention.kernel=flash", "attention.kernel", ["auto", "reference", "pallas", "triton", "cudnn"]),
    ("model.preset=gpt2", "model.preset", ["tiny", "llama_1b", "llama3_8b", "llama_34b", "custom"]),
    ("model.remat=some", "model.remat", ["none", "full", "save_dots"]),
    ("data.source=web", "data.source", ["synthetic", "corpus"]),
    ("attention.memory_mode=drop", "attention.memory_mode", ["keep", "resend"]),
])
def test_bad_literal_lists_allowed_values(override, field, allowed):
  msg = _error(override)
  assert msg.startswith(f"{field}:")
  for value in allowed:
    assert repr(value) in msg


@pytest.mark.parametrize("override, field", [
    ("train.steps=abc", "train.steps"),
    ("train.steps=1.5", "train.steps"),
    ("train.steps=true", "train.steps"),  # a bool is not an int here
    ("optim.lr=fast", "optim.lr"),
    ("mesh.fsdp=3", "mesh.fsdp"),
    ("data.distribution=3", "data.distribution"),
    ("model.hidden=wide", "model.hidden"),  # int | None
    ("train.peak_tflops=[1]", "train.peak_tflops"),
    ("attention.gate_nodes=3", "attention.gate_nodes"),  # a list of node numbers
    ("attention.gate_nodes=[0,a]", "attention.gate_nodes[1]"),
])
def test_wrong_type_named(override, field):
  assert _error(override).startswith(f"{field}:")


def test_section_must_be_a_mapping():
  assert _error("train=3").startswith("train:")


def test_list_field_becomes_a_tuple_and_matches_the_mesh():
  assert load_config(None, ["attention.gate_nodes=[0, 0, 1]"]).attention.gate_nodes == (0, 0, 1)
  assert _error("mesh.data=4", "attention.gate_nodes=[0,1]").startswith("attention.gate_nodes:")


def test_int_accepted_where_float_expected():
  assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0


def test_exponent_without_dot_parses():
  """PyYAML (YAML 1.1) reads `1e-4` as a string; float fields accept it all the same."""
  assert load_config(None, ["optim.lr=1e-4"]).optim.lr == 1e-4
  with pytest.raises(ConfigError, match="optim.lr"):
    load_config(None, ["optim.lr=fast"])


@pytest.mark.parametrize("tokens", [100, 1000, 129])
def test_tokens_per_device_multiple_of_128(tokens):
  msg = _error(f"data.tokens_per_device={tokens}")
  assert msg.startswith("data.tokens_per_device:") and "128" in msg


@pytest.mark.parametrize("override, field", [
    ("data.tokens_per_device=0", "data.tokens_per_device"),
    ("data.length_scale=0", "data.length_scale"),
    ("data.elongate_factor=0", "data.elongate_factor"),
    ("mesh.data=0", "mesh.data"),
    ("mesh.tensor=0", "mesh.tensor"),
    ("mesh.pipe=0", "mesh.pipe"),
    ("train.microbatches=0", "train.microbatches"),
    ("attention.epsilon=1.5", "attention.epsilon"),
    ("attention.min_imbalance=0.9", "attention.min_imbalance"),
    ("attention.min_gain=-1", "attention.min_gain"),
    ("attention.gate_exchange_fixed=-0.1", "attention.gate_exchange_fixed"),
    ("attention.gate_attention_cost=-0.5", "attention.gate_attention_cost"),
    ("attention.gate_network_byte_cost=0", "attention.gate_network_byte_cost"),
    ("attention.gate_nodes=[0,-1]", "attention.gate_nodes"),
    ("attention.min_gain=1", "attention.min_gain"),
    ("optim.lr=-1", "optim.lr"),
    ("train.steps=0", "train.steps"),
])
def test_out_of_range_named(override, field):
  assert _error(override).startswith(f"{field}:")


def test_corpus_source_needs_files():
  assert "data.corpus_tokens" in _error("data.source=corpus")


def test_heads_not_divisible_by_tensor():
  # tiny: 4 heads, 2 KV heads.
  msg = _error("mesh.tensor=3")
  assert msg.startswith("mesh.tensor:") and "model.heads" in msg
  assert _error("mesh.tensor=4").startswith("mesh.tensor:")  # divides heads, not kv_heads


def test_kv_heads_must_divide_heads():
  assert _error("model.kv_heads=3").startswith("model.kv_heads:")


def test_custom_preset_missing_fields():
  msg = _error("model.preset=custom", "model.hidden=64")
  assert msg.startswith("model.") and "model.preset=custom" in msg
  assert "vocab_size" in msg and "layers" in msg


def test_custom_preset_complete():
  fields = dict(vocab_size=256, hidden=64, layers=1, heads=2, kv_heads=1, head_dim=32, ffn=128,
                rope_theta=1e4)
  cfg = load_config(None, ["model.preset=custom"] + [f"model.{k}={v}" for k, v in fields.items()])
  assert cfg.model.hidden == 64


@pytest.mark.parametrize("cfg, n, phrase", [
    (MeshConfig(tensor=3), 8, "mesh.tensor"),         # 3 does not divide 8
    (MeshConfig(data=3, tensor=2), 8, "mesh.data"),   # 3 x 2 != 8
    (MeshConfig(data=2, tensor=2), 2, "mesh.data"),   # more than available
    (MeshConfig(data=4), 6, "mesh.data"),
])
def test_mesh_device_count_mismatch(cfg, n, phrase):
  with pytest.raises(ConfigError, match=phrase):
    make_mesh(cfg, jax.devices()[:n])


@pytest.mark.parametrize("cfg, n, shape", [
    (MeshConfig(), 8, {"data": 8, "pipe": 1, "tensor": 1}),
    (MeshConfig(tensor=2), 8, {"data": 4, "pipe": 1, "tensor": 2}),
    (MeshConfig(data=3, tensor=2), 6, {"data": 3, "pipe": 1, "tensor": 2}),
    (MeshConfig(data=1), 1, {"data": 1, "pipe": 1, "tensor": 1}),
])
def test_mesh_that_divides_devices(cfg, n, shape):
  assert dict(make_mesh(cfg, jax.devices()[:n]).shape) == shape


def test_yaml_file_missing(tmp_path):
  assert "does not exist" in _error(path=tmp_path / "nope.yaml")


@pytest.mark.parametrize("text", ["- a\n- b\n", "3\n", "just a string\n"])
def test_yaml_not_a_mapping(tmp_path, text):
  path = tmp_path / "bad.yaml"
  path.write_text(text)
  assert "mapping" in _error(path=path)


def test_yaml_errors_name_nested_field(tmp_path):
  path = tmp_path / "bad.yaml"
  path.write_text("attention:\n  impl: foo\n")
  msg = _error(path=path)
  assert msg.startswith("attention.impl:") and "'distca'" in msg


def test_yaml_then_overrides(tmp_path):
  path = tmp_path / "ok.yaml"
  path.write_text("train:\n  steps: 7\noptim:\n  lr: 0.01\n")
  cfg = load_config(path, ["train.steps=9"])
  assert (cfg.train.steps, cfg.optim.lr) == (9, 0.01)


@pytest.mark.parametrize("text", ["train.steps", "=3", ".steps=3", "train..steps=3", "train.=1"])
def test_override_syntax_errors(text):
  with pytest.raises(ConfigError, match="override"):
    parse_override(text)


def test_override_values_parsed_as_yaml():
  assert parse_override("a.b=[1, 2]") == {"a": {"b": [1, 2]}}
  assert parse_override("a=true") == {"a": True}
  assert parse_override("a=x=y") == {"a": "x=y"}


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_shipped_train_configs_load(path):
  cfg = load_config(path, [])
  assert isinstance(cfg, Config)


@pytest.mark.parametrize("path", SIM_CONFIGS, ids=lambda p: p.name)
def test_shipped_sim_configs_load(path):
  from distca_jax.sim.config import load_sim_config

  load_sim_config(path, [])


def test_expected_train_configs_exist():
  names = {p.name for p in TRAIN_CONFIGS}
  assert {"tiny.yaml", "llama_1b.yaml", "llama3_8b.yaml", "llama_34b.yaml"} <= names


def _launch_main():
  return launch_script("train").main


@pytest.mark.parametrize("argv, field", [
    (["attention.impl=foo"], "attention.impl"),
    (["train.steps"], "override"),
    (["--config", "/nonexistent/x.yaml"], "does not exist"),
])
def test_launch_train_bad_config_exits_2(capsys, argv, field):
  assert _launch_main()(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith("config error:") and field in err


def test_min_imbalance_default_per_path():
  """Unset, the ratio gate is off for unpipelined steps (the predicted-saving gate decides) and
  1.25 for a pipeline's ticks (their only gate, as before the predicted-saving gate); a set value
  holds for both."""
  a = load_config(None, []).attention
  assert a.min_imbalance is None
  assert (a.min_imbalance_for(pipelined=False), a.min_imbalance_for(pipelined=True)) == (1.0, 1.25)
  a = load_config(None, ["attention.min_imbalance=1.5"]).attention
  assert (a.min_imbalance_for(pipelined=False), a.min_imbalance_for(pipelined=True)) == (1.5, 1.5)
