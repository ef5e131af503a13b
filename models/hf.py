"""Hugging Face Llama-family checkpoints (`LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen2ForCausalLM`) <-> this model's parameters, with numpy and safetensors only.

Layouts. Hugging Face stores every projection as an `nn.Linear` weight `[out, in]`: q_proj is
`[H*E, D]`, o_proj `[D, H*E]`, gate/up `[F, D]`, down `[D, F]`, lm_head `[V, D]`. Here the
projections are `[in, out]` with heads split out (`wq [D, H, E]`, `wo [H, E, D]`), so each
tensor is a reshape and a transpose of the other side's (`TensorSpec`). Both sides apply RoPE in
the rotate-half form (the first half of a head's dimensions paired with the second), so q and k
need no permutation (Hugging Face's conversion from Meta's interleaved form permuted them once).

Two kinds of checkpoint directory are read, each tensor lazily by slices (safetensors maps the
files; a process reads only the slices its devices hold):
- a Hugging Face directory: `config.json` and `model.safetensors` or shards with
  `model.safetensors.index.json`;
- an imported one (`launch/convert.py import`): our names and layouts in `params*.safetensors`,
  the tensors' dtype unchanged, and `distca_params.json` (the shape, the original config.json).

Anything this model cannot represent (another architecture, a sliding window, experts, biases
other than q/k/v, a missing or extra tensor, a shape that disagrees with config.json) is refused
with a `CheckpointFormatError` naming it, before anything is read or written.

Param names are the model's parameter paths with dots: `blocks.0.attn.wq`, `embed`, `lm_head`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from .rope import RopeScaling

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2"}
IMPORTED_META = "distca_params.json"
HF_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")
# Tensors Hugging Face checkpoints may carry that are not parameters (older Llama saves).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointFormatError(ValueError):
  """A checkpoint this model cannot represent, or a directory that is not a checkpoint."""


# ----------------------------------------------------------------------------- config.json


def shape_fields(cfg: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
  """The `ModelShape` fields of a Hugging Face config (a dict of config.json); refuses what the
  model cannot represent."""
  arch = cfg.get("architectures") or []
  if len(arch) != 1 or arch[0] not in ARCHITECTURES:
    raise CheckpointFormatError(f"{where}: architectures {arch} is not one of {list(ARCHITECTURES)}")
  kind = ARCHITECTURES[arch[0]]
  for key in ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size"):
    if cfg.get(key):
      raise CheckpointFormatError(f"{where}: {key}={cfg[key]}: mixture-of-experts models are not supported")
  if cfg.get("use_sliding_window", kind == "mistral") and cfg.get("sliding_window") is not None:
    raise CheckpointFormatError(f"{where}: sliding_window={cfg['sliding_window']}: sliding-window "
                                f"attention is not supported")
  if any(t != "full_attention" for t in cfg.get("layer_types") or ()):
    raise CheckpointFormatError(f"{where}: layer_types {sorted(set(cfg['layer_types']))}: "
                                f"sliding-window attention is not supported")
  if cfg.get("hidden_act", "silu") != "silu":
    raise CheckpointFormatError(f"{where}: hidden_act={cfg['hidden_act']!r}: only silu (SwiGLU)")
  if kind != "qwen2" and cfg.get("attention_bias"):
    raise CheckpointFormatError(f"{where}: attention_bias=true: an output-projection bias is not supported")
  if cfg.get("mlp_bias"):
    raise CheckpointFormatError(f"{where}: mlp_bias=true: MLP biases are not supported")
  if cfg.get("partial_rotary_factor", 1.0) != 1.0:
    raise CheckpointFormatError(f"{where}: partial_rotary_factor={cfg['partial_rotary_factor']}: "
                                f"only full rotary embeddings")
  try:
    heads = int(cfg["num_attention_heads"])
    fields = dict(vocab_size=int(cfg["vocab_size"]), hidden=int(cfg["hidden_size"]),
                  layers=int(cfg["num_hidden_layers"]), heads=heads,
                  kv_heads=int(cfg.get("num_key_value_heads") or heads),
                  head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                  ffn=int(cfg["intermediate_size"]))
  except KeyError as e:
    raise CheckpointFormatError(f"{where}: no {e.args[0]}") from None
  rope = cfg.get("rope_parameters") or {}  # transformers 5 keeps theta and scaling together
  theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10_000.0)))
  scaling = _scaling_from_hf(cfg.get("rope_scaling") or rope, cfg, where)
  return dict(fields, rope_theta=theta, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
              qkv_bias=kind == "qwen2", rope_scaling=scaling,
              norm_eps=float(cfg.get("rms_norm_eps", 1e-6)))


def _scaling_from_hf(rs: dict[str, Any], cfg: dict[str, Any], where: str) -> RopeScaling | None:
  kind = rs.get("rope_type", rs.get("type", "default"))
  if kind == "default":
    return None
  if kind not in ("linear", "llama3", "yarn"):
    raise CheckpointFormatError(f"{where}: rope_scaling type {kind!r} is not supported "
                                f"(linear, llama3, yarn)")
  names = {f.name for f in dataclasses.fields(RopeScaling)} - {"type"}
  unknown = sorted(set(rs) - names - {"rope_type", "type", "rope_theta"})
  if unknown:
    raise CheckpointFormatError(f"{where}: rope_scaling fields {unknown} are not supported")
  values = {k: rs[k] for k in names if rs.get(k) is not None}
  if kind == "yarn" and "original_max_position_embeddings" not in values:
    # Hugging Face's YaRN falls back to max_position_embeddings.
    values["original_max_position_embeddings"] = cfg.get("max_position_embeddings")
  scaling = RopeScaling(type=kind, **values)
  from .rope import check_scaling
  from distca_jax.schema import ConfigError
  try:
    check_scaling(scaling, "rope_scaling")
  except ConfigError as e:
    raise CheckpointFormatError(f"{where}: {e}") from None
  return scaling


def hf_config(fields: dict[str, Any], dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
  """config.json for a model of these shape fields, stored in `dtype`; `base` (the config the
  parameters were imported from) keeps its other entries (token ids, the architecture)."""
  cfg = dict(base or {})
  cfg.pop("rope_parameters", None)  # rewritten as rope_theta / rope_scaling, which both read
  if not cfg.get("architectures") or (cfg["architectures"][0] == "Qwen2ForCausalLM") != fields["qkv_bias"]:
    arch = "Qwen2ForCausalLM" if fields["qkv_bias"] else "LlamaForCausalLM"
    cfg["architectures"] = [arch]
    cfg["model_type"] = ARCHITECTURES[arch]
  cfg.setdefault("model_type", ARCHITECTURES[cfg["architectures"][0]])
  scaling = fields.get("rope_scaling")
  if isinstance(scaling, RopeScaling):
    scaling = dataclasses.asdict(scaling)
  if scaling is not None:
    scaling = {"rope_type": scaling["type"],
               **{k: v for k, v in scaling.items() if k != "type" and v is not None}}
  positions = cfg.get("max_position_embeddings", 8192)
  if scaling and scaling.get("original_max_position_embeddings"):
    # transformers versions differ on which of the two YaRN's factor follows: make them agree.
    positions = int(scaling["factor"] * scaling["original_max_position_embeddings"])
  cfg.update(
      vocab_size=fields["vocab_size"], hidden_size=fields["hidden"],
      num_hidden_layers=fields["layers"], num_attention_heads=fields["heads"],
      num_key_value_heads=fields["kv_heads"], head_dim=fields["head_dim"],
      intermediate_size=fields["ffn"], hidden_act="silu", rms_norm_eps=fields["norm_eps"],
      rope_theta=fields["rope_theta"], rope_scaling=scaling,
      tie_word_embeddings=fields["tie_embeddings"], max_position_embeddings=positions,
      torch_dtype=dtype)
  if cfg["model_type"] != "qwen2":
    cfg.update(attention_bias=False, mlp_bias=False)
  return cfg


# ----------------------------------------------------------------------------- tensor layouts


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One parameter: our name, the stored name, the stored shape, and how ours follows from it:
  `ours = stored.reshape(view).transpose(perm)`."""

  name: str
  stored: str
  stored_shape: tuple[int, ...]
  view: tuple[int, ...]
  perm: tuple[int, ...]

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.view[p] for p in self.perm)

  def to_ours(self, x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.reshape(self.view).transpose(self.perm))

  def to_stored(self, x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(np.argsort(self.perm)).reshape(self.stored_shape))

  def read(self, tensor_slice, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """Our slice `index` (slices over `shape`; None: all) of the stored tensor, reading only the
    stored rows that slice needs. `tensor_slice`: safetensors' lazy `get_slice` handle."""
    if index is None:
      index = (slice(None),) * len(self.perm)
    ranges = [None] * len(self.view)
    for i, s in enumerate(index):
      ranges[self.perm[i]] = s.indices(self.view[self.perm[i]])[:2]
    stored_index, shape_read, sub = [], [], []
    for group in _groups(self.stored_shape, self.view):
      # A stored dimension holds view dimensions `group` (major first): read whole inner ones.
      inner = math.prod(self.view[g] for g in group[1:])
      a, b = ranges[group[0]]
      stored_index.append(slice(a * inner, b * inner))
      shape_read += [b - a] + [self.view[g] for g in group[1:]]
      sub += [slice(None)] + [slice(*ranges[g]) for g in group[1:]]
    x = tensor_slice[tuple(stored_index)] if stored_index else tensor_slice[:]
    return np.ascontiguousarray(np.asarray(x).reshape(shape_read)[tuple(sub)].transpose(self.perm))


def _groups(stored: tuple[int, ...], view: tuple[int, ...]) -> list[tuple[int, ...]]:
  """Which view dimensions each stored dimension splits into."""
  out, j = [], 0
  for n in stored:
    group, size = [], 1
    while size < n or (not group and j < len(view)):
      group.append(j)
      size *= view[j]
      j += 1
    if size != n:
      raise ValueError(f"view {view} does not split stored shape {stored}")
    out.append(tuple(group))
  return out


def hf_specs(fields: dict[str, Any]) -> list[TensorSpec]:
  """Every parameter of a model of these shape fields, as stored in a Hugging Face checkpoint."""
  V, D, F = fields["vocab_size"], fields["hidden"], fields["ffn"]
  H, K, E = fields["heads"], fields["kv_heads"], fields["head_dim"]
  specs = [TensorSpec("embed", "model.embed_tokens.weight", (V, D), (V, D), (0, 1))]
  for i in range(fields["layers"]):
    hf, us = f"model.layers.{i}.", f"blocks.{i}."
    specs += [
        TensorSpec(us + "attn_norm.scale", hf + "input_layernorm.weight", (D,), (D,), (0,)),
        TensorSpec(us + "attn.wq", hf + "self_attn.q_proj.weight", (H * E, D), (H, E, D), (2, 0, 1)),
        TensorSpec(us + "attn.wk", hf + "self_attn.k_proj.weight", (K * E, D), (K, E, D), (2, 0, 1)),
        TensorSpec(us + "attn.wv", hf + "self_attn.v_proj.weight", (K * E, D), (K, E, D), (2, 0, 1)),
        TensorSpec(us + "attn.wo", hf + "self_attn.o_proj.weight", (D, H * E), (D, H, E), (1, 2, 0)),
        TensorSpec(us + "mlp_norm.scale", hf + "post_attention_layernorm.weight", (D,), (D,), (0,)),
        TensorSpec(us + "mlp.w_gate", hf + "mlp.gate_proj.weight", (F, D), (F, D), (1, 0)),
        TensorSpec(us + "mlp.w_up", hf + "mlp.up_proj.weight", (F, D), (F, D), (1, 0)),
        TensorSpec(us + "mlp.w_down", hf + "mlp.down_proj.weight", (D, F), (D, F), (1, 0)),
    ]
    if fields["qkv_bias"]:
      specs += [TensorSpec(us + f"attn.b{x}", hf + f"self_attn.{x}_proj.bias", (n * E,), (n, E), (0, 1))
                for x, n in (("q", H), ("k", K), ("v", K))]
  specs.append(TensorSpec("final_norm.scale", "model.norm.weight", (D,), (D,), (0,)))
  if not fields["tie_embeddings"]:
    specs.append(TensorSpec("lm_head", "lm_head.weight", (V, D), (V, D), (1, 0)))
  return specs


def our_specs(fields: dict[str, Any]) -> list[TensorSpec]:
  """The same parameters as an imported checkpoint stores them: our names and layouts."""
  return [TensorSpec(s.name, s.name, s.shape, s.shape, tuple(range(len(s.shape))))
          for s in hf_specs(fields)]


# ----------------------------------------------------------------------------- reading


class Checkpoint:
  """An opened checkpoint directory (Hugging Face's or an imported one): its shape fields, the
  dtype its tensors are stored in, the Hugging Face config it came with, and lazy reads of our
  parameters by name. Opening checks every tensor's name and shape (headers only)."""

  def __init__(self, path: str | Path):
    from safetensors import safe_open

    self.path = Path(path)
    if (self.path / IMPORTED_META).is_file():
      meta = _read_json(self.path / IMPORTED_META)
      self.fields = dict(meta["model"])
      if self.fields.get("rope_scaling") is not None:
        self.fields["rope_scaling"] = RopeScaling(**self.fields["rope_scaling"])
      self.hf = meta.get("hf_config")
      specs, stem, self.imported = our_specs(self.fields), "params", True
    elif (self.path / "config.json").is_file():
      self.hf = _read_json(self.path / "config.json")
      self.fields = shape_fields(self.hf, str(self.path / "config.json"))
      specs, stem, self.imported = hf_specs(self.fields), "model", False
    else:
      raise CheckpointFormatError(f"{self.path}: neither a Hugging Face checkpoint (config.json) "
                                  f"nor an imported one ({IMPORTED_META})")
    self.specs = {s.name: s for s in specs}
    files = _tensor_files(self.path, stem)
    self._handles = {}
    for f in sorted(set(files.values())):
      try:
        self._handles[f] = safe_open(str(f), framework="np")
      except Exception as e:  # safetensors' own error type for a damaged header
        raise CheckpointFormatError(f"{f}: not a readable safetensors file ({e})") from None
    self._file = {}
    dtypes = set()
    for s in specs:
      if s.stored not in files:
        raise CheckpointFormatError(f"{self.path}: tensor {s.stored} is missing")
      handle = self._handles[files[s.stored]]
      shape = tuple(handle.get_slice(s.stored).get_shape())
      if shape != s.stored_shape:
        raise CheckpointFormatError(f"{self.path}: tensor {s.stored} has shape {list(shape)}, "
                                    f"config.json implies {list(s.stored_shape)}")
      dtypes.add(handle.get_slice(s.stored).get_dtype())
      self._file[s.name] = files[s.stored]
    expected = {s.stored for s in specs}
    if self.fields["tie_embeddings"]:
      expected.add("lm_head.weight")  # some tied checkpoints store the shared matrix twice
    extra = sorted(n for n in files if n not in expected and not n.endswith(_IGNORED_SUFFIXES))
    if extra:
      raise CheckpointFormatError(f"{self.path}: tensors the model has no place for: "
                                  f"{extra[:5]}{' ...' if len(extra) > 5 else ''}")
    self.dtype = _DTYPE_NAMES.get(dtypes.pop(), "float32") if len(dtypes) == 1 else "float32"

  def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """Parameter `name` in our layout, its slice `index` only (None: whole), as stored (dtype)."""
    spec = self.specs[name]
    return spec.read(self._handles[self._file[name]].get_slice(spec.stored), index)


_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _read_json(path: Path) -> dict[str, Any]:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise CheckpointFormatError(f"{path}: cannot be read as JSON ({e})") from None


def _tensor_files(path: Path, stem: str) -> dict[str, Path]:
  """Stored tensor name -> its file: from `<stem>.safetensors.index.json`, or one file's header."""
  from safetensors import safe_open

  index = path / f"{stem}.safetensors.index.json"
  if index.is_file():
    weight_map = _read_json(index).get("weight_map") or {}
    files = {name: path / f for name, f in weight_map.items()}
    absent = sorted({str(f.name) for f in files.values() if not f.is_file()})
    if absent:
      raise CheckpointFormatError(f"{index}: names files that are not there: {absent[:3]}")
    return files
  single = path / f"{stem}.safetensors"
  if not single.is_file():
    raise CheckpointFormatError(f"{path}: no {single.name} and no {index.name}")
  try:
    with safe_open(str(single), framework="np") as f:
      return {name: single for name in f.keys()}
  except Exception as e:  # safetensors' own error type for a damaged header
    raise CheckpointFormatError(f"{single}: not a readable safetensors file ({e})") from None


def checkpoint_shape(path: str | Path) -> dict[str, Any]:
  """The `ModelShape` fields of the checkpoint directory at `path` (config and headers only)."""
  return Checkpoint(path).fields


# ----------------------------------------------------------------------------- writing


def write_tensors(out: Path, stem: str, tensors: Iterable[tuple[str, tuple[int, ...], str,
                                                                Callable[[], np.ndarray]]],
                  max_shard_bytes: int) -> None:
  """Writes (name, shape, dtype, make) tensors into `out/<stem>.safetensors`, or into shards of
  at most `max_shard_bytes` with `<stem>.safetensors.index.json` (Hugging Face's names). Each
  shard's tensors are made only while it is written."""
  from safetensors.numpy import save_file

  shards, size, total = [[]], 0, 0
  for item in tensors:
    nbytes = math.prod(item[1]) * np.dtype(_np_dtype(item[2])).itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(item)
    size += nbytes
    total += nbytes
  names = ([f"{stem}.safetensors"] if len(shards) == 1 else
           [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  weight_map = {}
  for file, shard in zip(names, shards):
    arrays = {}
    for name, shape, dtype, make in shard:
      x = np.asarray(make()).astype(_np_dtype(dtype))
      assert x.shape == tuple(shape), (name, x.shape, shape)
      arrays[name] = x
      weight_map[name] = file
    save_file(arrays, str(out / file), metadata={"format": "pt"})
  if len(shards) > 1:
    (out / f"{stem}.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def _np_dtype(name: str):
  import ml_dtypes

  return {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[name]


def fresh_output(out: str | Path) -> Path:
  """`out` checked to be writable as a new directory (absent or empty), for `publish`."""
  out = Path(out)
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise CheckpointFormatError(f"{out}: exists and is not an empty directory")
  return out


def publish(out: Path, write: Callable[[Path], None]) -> None:
  """Runs `write(tmp)` into a sibling directory and renames it to `out`: a failure leaves no
  half-written `out`."""
  tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  try:
    write(tmp)
    if out.exists():
      out.rmdir()
    tmp.rename(out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def record(fields: dict[str, Any]) -> dict[str, Any]:
  """Shape fields JSON-ready (the scaling as a dict)."""
  out = dict(fields)
  if isinstance(out.get("rope_scaling"), RopeScaling):
    out["rope_scaling"] = dataclasses.asdict(out["rope_scaling"])
  return out


def import_hf(hf_dir: str | Path, out: str | Path, max_shard_bytes: int = HF_SHARD_BYTES) -> Checkpoint:
  """Hugging Face checkpoint `hf_dir` -> an imported checkpoint at `out` (our names and
  layouts, the stored dtype kept). Everything is checked before anything is written."""
  source = Checkpoint(hf_dir)
  if source.imported:
    raise CheckpointFormatError(f"{hf_dir}: already an imported checkpoint")
  out = fresh_output(out)

  def write(tmp: Path):
    write_tensors(tmp, "params", [(s.name, s.shape, source.dtype, lambda s=s: source.read(s.name))
                                  for s in source.specs.values()], max_shard_bytes)
    meta = {"format": 1, "model": record(source.fields), "dtype": source.dtype,
            "hf_config": source.hf, "imported_from": str(Path(hf_dir).absolute())}
    (tmp / IMPORTED_META).write_text(json.dumps(meta, indent=2) + "\n")

  publish(out, write)
  return source


def export_hf(fields: dict[str, Any], read: Callable[[str], np.ndarray], out: str | Path,
              dtype: str, base_config: dict[str, Any] | None = None,
              max_shard_bytes: int = HF_SHARD_BYTES) -> None:
  """Parameters (`read(name)` in our layout, any float dtype) -> a Hugging Face directory at
  `out`: config.json and `model*.safetensors` in `dtype`, transformers' names and layouts."""
  out = fresh_output(out)
  cfg = hf_config(fields, dtype, base_config)
  specs = hf_specs(fields)

  def write(tmp: Path):
    write_tensors(tmp, "model", [(s.stored, s.stored_shape, dtype,
                                  lambda s=s: s.to_stored(np.asarray(read(s.name))))
                                 for s in specs], max_shard_bytes)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

  publish(out, write)
