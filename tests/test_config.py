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
    ("attention.kernel=flash", "attention.kernel", ["auto", "reference", "pallas", "triton", "mosaic"]),
    ("model.preset=gpt2", "model.preset", ["tiny", "llama_1b", "llama3_8b", "llama_34b", "custom"]),
    ("model.remat=some", "model.remat", ["none", "full", "save_attn"]),
    ("data.source=web", "data.source", ["synthetic", "corpus"]),
    ("attention.memory_mode=drop", "attention.memory_mode", ["keep", "resend"]),
])
def test_bad_literal_lists_allowed_values(override, field, allowed):
  msg = _error(override)
  assert msg.startswith(f"{field}:")
  for value in allowed:
    assert repr(value) in msg


@pytest.mark.parametrize("override, instead", [
    ("attention.exchange=shifted", "attention.exchange=ragged"),
    ("attention.kernel=cudnn", "attention.kernel=auto"),
    ("model.remat=save_dots", "model.remat=save_attn"),
])
def test_a_removed_value_names_what_to_use_instead(override, instead):
  field, value = override.split("=")
  msg = _error(override)
  assert msg.startswith(f"{field}: {value!r} was removed") and instead in msg


@pytest.mark.parametrize("override, instead", [
    ("attention.gate_nodes=[0,1]", "mesh.devices_per_node"),
    ("attention.gate_exchange_fixed=0.1", "attention.gate_profile"),
    ("attention.gate_exchange_flops_per_byte=1", "attention.gate_profile"),
    ("attention.gate_network_byte_cost=4", "attention.gate_profile"),
])
def test_a_removed_field_names_the_new_one(override, instead):
  field = override.split("=")[0]
  msg = _error(override)
  assert msg.startswith(f"{field}: removed") and instead in msg


def test_the_gate_profile_is_a_file_the_run_loads(tmp_path):
  """`attention.gate_profile`: a readable profile loads; an unreadable or incomplete one is a
  config error naming the field."""
  import json

  from distca_jax import gate

  good = tmp_path / "profile.json"
  good.write_text(json.dumps({**gate.read_profile(), "exchange_fixed": 0.5}))
  cfg = load_config(None, [f"attention.gate_profile={good}"])
  assert gate.costs(cfg.attention).exchange_fixed == 0.5
  assert gate.costs(load_config(None, []).attention).exchange_fixed == (
      gate.read_profile()["exchange_fixed"])  # unset: the shipped profile
  # A profile written before CAD's fixed cost was split: its machinery was inside exchange_fixed.
  older = tmp_path / "older.json"
  older.write_text(json.dumps({k: v for k, v in gate.read_profile().items() if k != "machinery"}))
  assert gate.costs(load_config(None, [f"attention.gate_profile={older}"]).attention).machinery == 0.0
  for bad in ({"fit_kernel": "triton"}, {**gate.read_profile(), "exchange_fixed": -1},
              {**gate.read_profile(), "machinery": "0.01"}):
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert _error(f"attention.gate_profile={tmp_path / 'bad.json'}").startswith(
        "attention.gate_profile:")
  assert "not a readable" in _error(f"attention.gate_profile={tmp_path / 'missing.json'}")


@pytest.mark.parametrize("override, field", [
    ("train.steps=abc", "train.steps"),
    ("train.steps=1.5", "train.steps"),
    ("train.steps=true", "train.steps"),  # a bool is not an int here
    ("optim.lr=fast", "optim.lr"),
    ("mesh.fsdp=3", "mesh.fsdp"),
    ("data.distribution=3", "data.distribution"),
    ("model.hidden=wide", "model.hidden"),  # int | None
    ("train.peak_tflops=[1]", "train.peak_tflops"),
    ("attention.data_rank_nodes=3", "attention.data_rank_nodes"),  # a list of node numbers
    ("attention.data_rank_nodes=[0,a]", "attention.data_rank_nodes[1]"),
])
def test_wrong_type_named(override, field):
  assert _error(override).startswith(f"{field}:")


def test_section_must_be_a_mapping():
  assert _error("train=3").startswith("train:")


def test_list_field_becomes_a_tuple_and_matches_the_mesh():
  assert load_config(None, ["attention.data_rank_nodes=[0, 0, 1]"]).attention.data_rank_nodes == (0, 0, 1)
  assert _error("mesh.data=4", "attention.data_rank_nodes=[0,1]").startswith("attention.data_rank_nodes:")


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
    ("attention.gate_attention_cost=-0.5", "attention.gate_attention_cost"),
    ("mesh.devices_per_node=0", "mesh.devices_per_node"),
    ("attention.data_rank_nodes=[0,-1]", "attention.data_rank_nodes"),
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


# ----------------------------------------------------------------------------- every field's range


def _leaf_fields(schema, prefix=""):
  """(dotted path, annotation) of every leaf field of a schema (sections walked, not listed)."""
  import dataclasses

  from distca_jax.schema import field_hints, split_annotation

  hints = field_hints(schema)
  for f in dataclasses.fields(schema):
    kind = split_annotation(hints[f.name])[0]
    if dataclasses.is_dataclass(kind):
      yield from _leaf_fields(kind, f"{prefix}{f.name}.")
    else:
      yield f"{prefix}{f.name}", hints[f.name]


def _numeric(annotation) -> bool:
  import typing

  from distca_jax.schema import split_annotation

  kind = split_annotation(annotation)[0]
  args = [a for a in typing.get_args(kind) if a is not type(None)]
  if typing.get_origin(kind) is tuple:
    return _numeric(args[0])
  if args and typing.get_origin(kind) is not typing.Literal:  # X | None
    return any(_numeric(a) for a in args)
  return kind in (int, float)


def _has_range(annotation) -> bool:
  import typing

  from distca_jax.schema import Range, split_annotation

  kind, rules = split_annotation(annotation)
  if any(isinstance(r, Range) for r in rules) or typing.get_origin(kind) is typing.Literal:
    return True  # a Literal is a closed set (e.g. the `auto` of `int >= 1 | auto`)
  args = [a for a in typing.get_args(kind) if a is not type(None)]
  if typing.get_origin(kind) is tuple:
    return _has_range(args[0])
  return bool(args) and typing.get_origin(kind) is not typing.Literal and all(_has_range(a) for a in args)


def _schemas():
  from distca_jax.sim.config import SimConfig, Sweep

  return [Config, SimConfig, Sweep]


@pytest.mark.parametrize("schema", _schemas(), ids=lambda s: s.__name__)
def test_every_numeric_field_declares_its_range(schema):
  """A new int or float field must say its range in its type (schema.PositiveInt, Range(...)):
  an unchecked count is how `train.log_every=0` once crashed after compiling."""
  unchecked = [path for path, ann in _leaf_fields(schema) if _numeric(ann) and not _has_range(ann)]
  assert not unchecked


@pytest.mark.parametrize("override, field, phrase", [
    ("optim.lr=.nan", "optim.lr", "finite"),
    ("optim.lr=.inf", "optim.lr", "finite"),
    ("optim.lr=nan", "optim.lr", "finite"),
    ("optim.lr=1e400", "optim.lr", "finite"),
    ("optim.lr=0", "optim.lr", "in (0, 1e+30]"),
    ("optim.lr=1e38", "optim.lr", "an AdamW learning rate"),
    ("optim.b1=2", "optim.b1", "[0, 1)"),
    ("optim.b1=1", "optim.b1", "[0, 1)"),
    ("optim.b2=1.5", "optim.b2", "[0, 1)"),
    ("optim.b2=-0.1", "optim.b2", "[0, 1)"),
    ("optim.clip_norm=-1", "optim.clip_norm", "> 0"),
    ("optim.clip_norm=0", "optim.clip_norm", "> 0"),
    ("optim.weight_decay=-5", "optim.weight_decay", ">= 0"),
    ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio", "[0, 1]"),
    ("optim.warmup_steps=-1", "optim.warmup_steps", "[0, 2**31)"),
    ("optim.decay_steps=0", "optim.decay_steps", "[1, 2**31)"),
    ("optim.warmup_steps=2147483648", "optim.warmup_steps", "an int32 step count"),
    ("train.log_every=0", "train.log_every", ">= 1"),
    ("train.cpu_devices=-3", "train.cpu_devices", ">= 0"),
    ("train.stop_at_step=0", "train.stop_at_step", "[1, 2**31)"),
    ("train.max_seconds=-1", "train.max_seconds", ">= 0"),
    ("train.max_seconds=.nan", "train.max_seconds", "finite"),
    ("train.init_timeout_s=0", "train.init_timeout_s", ">= 1"),
    ("train.seed=-1", "train.seed", "[0, 2**32)"),
    ("train.seed=4294967296", "train.seed", "[0, 2**32)"),
    ("train.peak_tflops=0", "train.peak_tflops", "> 0"),
    ("train.profile_start=0", "train.profile_start", "[1, 2**31)"),
    ("train.profile_steps=0", "train.profile_steps", "[1, 2**31)"),
    ("train.profile_warmup=-1", "train.profile_warmup", ">= 0"),
    ("data.seed=-1", "data.seed", "[0, 2**32)"),
    ("data.length_scale=.nan", "data.length_scale", "finite"),
    ("data.length_scale=-2", "data.length_scale", "> 0"),
    ("data.long_threshold=0", "data.long_threshold", ">= 1"),
    ("data.upsample_long_factor=0", "data.upsample_long_factor", ">= 1"),
    ("model.norm_eps=-1", "model.norm_eps", "> 0"),
    ("model.norm_eps=0", "model.norm_eps", "> 0"),
    ("model.rope_theta=0", "model.rope_theta", "> 0"),
    ("model.hidden=0", "model.hidden", ">= 1"),
    ("mesh.data=-2", "mesh.data", "-1"),
    ("checkpoint.every=-1", "checkpoint.every", "[0, 2**31)"),
    ("checkpoint.keep=0", "checkpoint.keep", ">= 1"),
    ("attention.epsilon=.nan", "attention.epsilon", "finite"),
    ("train.steps=99999999999999999999", "train.steps", "64 bits"),
])
def test_range_refused_at_load(override, field, phrase):
  msg = _error(override)
  assert msg.startswith(f"{field}:") and phrase in msg


def test_range_checked_after_every_override():
  """Ranges apply to the merged config: a later override may fix an earlier bad value."""
  assert load_config(None, ["optim.lr=-1", "optim.lr=0.5"]).optim.lr == 0.5


def test_tiny_yaml_is_the_default_job(capsys):
  """`python launch/train.py` without --config runs configs/tiny.yaml: CAD on the tiny model,
  evaluated; the schema's defaults stay those a GPU config builds on (colocated, gate on)."""
  tiny = load_config(ROOT / "configs" / "tiny.yaml", [])
  assert _print_config("train", [], capsys) == _print_config("train", ["--config", str(ROOT / "configs" / "tiny.yaml")], capsys)
  assert (tiny.attention.impl, tiny.attention.gate, tiny.eval.batches) == ("distca", False, 2)
  assert (Config().attention.impl, Config().attention.gate, Config().eval.batches) == ("colocated", True, 0)


# ----------------------------------------------------------------------------- input files


def _write(tmp_path, name, data) -> Path:
  path = tmp_path / name
  path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
  return path


@pytest.mark.parametrize("data, phrase", [
    ("train:\n  steps: [1\n", "not valid YAML"),
    ("train:\n  steps: 3\n   lr: 2\n", "not valid YAML"),
    ("a: b: c\n", "not valid YAML"),
    ("train:\n  steps: 3\ntrain:\n  seed: 1\n", "duplicate key 'train'"),
    ("train:\n  steps: 3\n  steps: 4\n", "duplicate key 'steps'"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "not a text"),
    (b"train:\n  steps: 3\x00\n", "NUL"),
])
def test_bad_yaml_file_names_the_file(tmp_path, data, phrase):
  path = _write(tmp_path, "bad.yaml", data)
  msg = _error(path=path)
  assert msg.startswith(f"config file {path}") and phrase in msg and "\n" not in msg


def test_config_file_that_is_a_directory(tmp_path):
  msg = _error(path=tmp_path)
  assert msg.startswith(f"config file {tmp_path}") and "directory" in msg


def test_duplicate_key_inside_an_override_value():
  from distca_jax.sim.config import load_sim_config

  with pytest.raises(ConfigError, match="override .*duplicate key 'gpus'"):
    load_sim_config(None, ["sweeps=[{gpus: 64, gpus: 128}]"])


@pytest.mark.parametrize("override", ["train.steps=[1,", "train.steps={a", "model.preset=@x"])
def test_override_value_not_yaml(override):
  msg = _error(override)
  assert msg.startswith("override") and "not valid YAML" in msg


@pytest.mark.parametrize("content, phrase", [
    ("not json", "not valid JSON"),
    ("{}", "non-empty JSON list"),
    ("[]", "non-empty JSON list"),
    ("[1, 2.5]", "integer"),
    ("[3, -2]", ">= 1"),
    ("[0]", ">= 1"),
    ("[1, 99999999999999999999]", "< 2**53"),
    ("[1, 1, 1]", "one token long"),
    (b"\xff\xfe\x00binary", "not a JSON text file"),
])
def test_distribution_file_refused_at_load(tmp_path, content, phrase):
  path = _write(tmp_path, "lens.json", content)
  msg = _error(f"data.distribution={path}")
  assert msg.startswith("data.distribution:") and phrase in msg


@pytest.mark.parametrize("value, phrase", [
    ("nope", "neither one of ['pretrain', 'prolong']"),
    ("/nonexistent/lens.json", "nor an existing file"),
])
def test_distribution_name_refused_at_load(value, phrase):
  msg = _error(f"data.distribution={value}")
  assert msg.startswith("data.distribution:") and phrase in msg


def test_distribution_directory_refused(tmp_path):
  assert "directory" in _error(f"data.distribution={tmp_path}")


def test_distribution_without_targets_refused():
  """Scaled down far enough every document is one token long: no token has a target."""
  msg = _error("data.length_scale=1e9")
  assert msg.startswith("data.distribution:") and "next-token target" in msg
  # ProLong's 64K full-context documents survive a scale that flattens Pretrain.
  load_config(None, ["data.distribution=prolong", "data.length_scale=20000"])
  assert _error("data.elongate_factor=1000000000000000000").startswith("data.elongate_factor:")


def test_sampling_pool_too_large_refused():
  """The fuzz found it: a huge upsample_long_factor asked numpy for terabytes at the first batch."""
  from distca_jax.sim.config import load_sim_config

  assert _error("data.upsample_long_factor=2147483648").startswith("data.upsample_long_factor:")
  with pytest.raises(ConfigError, match="^upsample_long_factor: .*pool"):
    load_sim_config(None, ["upsample_long_factor=100000000"])


@pytest.mark.parametrize("field", ["train.out_dir", "checkpoint.dir", "train.compile_cache_dir"])
def test_output_directory_that_is_a_file(tmp_path, field):
  path = _write(tmp_path, "file", "x")
  assert "not a directory" in _error(f"{field}={path}")
  assert "which is a file" in _error(f"{field}={path}/run")


def test_output_directory_not_writable(tmp_path):
  # /proc takes no new files, even from root (whom permission bits do not stop).
  msg = _error("train.out_dir=/proc/distca_run")
  assert msg.startswith("train.out_dir:") and "not writable" in msg
  assert _error("train.out_dir=''").startswith("train.out_dir:")
  load_config(None, [f"train.out_dir={tmp_path / 'new' / 'run'}"])  # made later, by the run
  assert not (tmp_path / "new").exists() and not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- the launchers


def _help(script) -> str:
  import contextlib
  import io

  out = io.StringIO()
  with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
    launch_script(script).main(["--help"])
  assert info.value.code == 0
  return out.getvalue()


@pytest.mark.parametrize("script, schema", [("train", Config), ("simulate", None)])
def test_help_lists_every_field(script, schema):
  """--help is generated from the schema: every field with its type and default, closed sets
  spelled out."""
  from distca_jax.sim.config import SimConfig, Sweep

  text = _help(script)
  if schema is None:
    fields = list(_leaf_fields(SimConfig)) + [(f"sweeps[i].{p}", a) for p, a in _leaf_fields(Sweep)]
  else:
    fields = list(_leaf_fields(schema))
  lines = {line.split(":")[0].strip(): line for line in text.splitlines() if line.startswith("  ")}
  for path, _ in fields:
    assert path in lines, path
  if script == "train":
    assert "one of colocated, distca" in lines["attention.impl"]
    assert "[30]" in lines["train.steps"] and "int in [1, 2**31)" in lines["train.steps"]
    assert "checkpoint.every" in text and "resume" in text


def _print_config(script, argv, capsys) -> str:
  assert launch_script(script).main(["--print-config", *argv]) == 0
  return capsys.readouterr().out


def test_print_config_round_trips(tmp_path, capsys):
  argv = ["attention.impl=distca", "attention.data_rank_nodes=[0, 0, 1, 1]", "mesh.data=4",
          "optim.lr=1e-4", "train.out_dir=runs/x y", "data.full_context_replacement=true"]
  printed = _print_config("train", argv, capsys)
  path = _write(tmp_path, "printed.yaml", printed)
  assert load_config(path, []) == load_config(ROOT / "configs" / "tiny.yaml", argv)
  assert load_config(path, []).attention.data_rank_nodes == (0, 0, 1, 1)


def test_sim_print_config_round_trips(tmp_path, capsys):
  from distca_jax.sim.config import load_sim_config

  argv = ["gpus=64", "sweeps=[{models: llama_34b, gpus: [128, 256]}]", "hardware.network_gbps=25"]
  printed = _print_config("simulate", argv, capsys)
  path = _write(tmp_path, "printed.yaml", printed)
  assert load_sim_config(path, []) == load_sim_config(None, argv)


def test_print_config_runs_nothing(tmp_path, capsys):
  out = tmp_path / "run"
  _print_config("train", [f"train.out_dir={out}"], capsys)
  _print_config("simulate", [f"out_dir={out}"], capsys)
  assert not out.exists()


@pytest.mark.parametrize("script, argv, field", [
    ("train", ["optim.lr=.nan"], "optim.lr"),
    ("train", ["data.distribution=/nonexistent/lens.json"], "data.distribution"),
    ("simulate", ["epsilon=2"], "epsilon"),
])
def test_refused_value_exits_2_before_jax(script, argv, field, tmp_path):
  """The user's view: exit status 2, one `config error:` line, no traceback, JAX never started."""
  import subprocess
  import sys

  code = ("import runpy, sys; rc = runpy.run_path(sys.argv[1])['main'](sys.argv[2:]); "
          "print('jax' in sys.modules); sys.exit(rc)")
  proc = subprocess.run([sys.executable, "-c", code, str(ROOT / "launch" / f"{script}.py"), *argv],
                        cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert proc.stderr.startswith(f"config error: {field}:") and proc.stderr.count("\n") == 1
  assert "Traceback" not in proc.stderr and proc.stdout.strip() == "False"


# ----------------------------------------------------------------------------- fuzz


def _fuzz_value(annotation, default):
  import typing

  from hypothesis import strategies as st

  from distca_jax.schema import split_annotation

  kind = split_annotation(annotation)[0]
  args = typing.get_args(kind)
  special = st.sampled_from(list(args)) if typing.get_origin(kind) is typing.Literal else st.nothing()
  # Strings stay relative and inside the test's directory: some fields are output directories.
  text = st.text(max_size=12).filter(lambda s: not s.startswith(("/", "~")) and ".." not in s)
  scalar = st.one_of(
      st.integers(-3, 10), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
      st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63, 10**30, 0.5, 1e-300, 1e300]),
      st.booleans(), st.none(), text, special, st.just(default))
  return st.one_of(scalar, st.lists(scalar, max_size=4), st.dictionaries(text, scalar, max_size=2))


def _fuzz_overrides(schema):
  from hypothesis import strategies as st

  from distca_jax.schema_io import to_dict

  defaults = to_dict(schema())

  def default(path):
    value = defaults
    for key in path.split("."):
      value = value[key]
    return value

  fields = list(_leaf_fields(schema))
  pick = st.sampled_from(fields).flatmap(
      lambda f: st.tuples(st.just(f[0]), _fuzz_value(f[1], default(f[0]))))
  return st.lists(pick, min_size=1, max_size=3)


def _override_text(path, value) -> str:
  import yaml

  dumped = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
  return f"{path}={dumped.removesuffix('...').strip()}"


def _fuzz(loader, pairs, tmp_path, raw):
  import contextlib

  overrides = [_override_text(p, v) for p, v in pairs] + ([raw] if raw is not None else [])
  with contextlib.chdir(tmp_path):
    try:
      return loader(None, overrides)
    except ConfigError as e:
      assert str(e) and "\n" not in str(e)  # one line for the user
      return None


def _host_side_start(config):
  """What a run does first with its config on the host, where the values the loader once let
  through crashed late: the learning-rate schedule, and the first batches of the data source
  (at a small buffer length: the fuzz may ask for a huge one)."""
  import dataclasses

  import numpy as np

  from distca_jax.data.sources import synthetic_from_config
  from distca_jax.models.presets import resolve
  from distca_jax.train.optimizer import lr_schedule

  schedule = lr_schedule(config.optim, config.train.steps)
  for step in (0, config.optim.warmup_steps, config.train.steps):
    assert np.isfinite(float(schedule(step)))
  if config.data.source == "synthetic":
    data = dataclasses.replace(config.data, tokens_per_device=min(config.data.tokens_per_device, 512))
    source = synthetic_from_config(data, resolve(config.model).vocab_size, num_buffers=2)
    for step in (0, 1):
      assert source.batch(step).tokens.shape == (2, data.tokens_per_device)


def _fuzz_targets():
  from distca_jax import config
  from distca_jax.sim import config as sim_config

  return [(Config, load_config, lambda c: (config.validate(c), _host_side_start(c)), 300),
          (sim_config.SimConfig, sim_config.load_sim_config, sim_config.validate, 200)]


@pytest.mark.parametrize("schema, loader, accepted, examples", _fuzz_targets(),
                         ids=["trainer", "simulator"])
def test_fuzz_config_values(tmp_path, schema, loader, accepted, examples):
  """Random values (NaN, inf, negative, huge, wrong types, lists, mappings) for random fields:
  the loader returns a config that passes every check (and, for the trainer, starts on the
  host), or raises ConfigError; never anything else."""
  from hypothesis import HealthCheck, given, settings
  from hypothesis import strategies as st

  @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
  @given(_fuzz_overrides(schema), st.none() | st.none() | st.text(max_size=20))
  def run(pairs, raw):
    config = _fuzz(loader, pairs, tmp_path, raw)
    if config is not None:
      accepted(config)

  run()
