"""Model shapes: presets and the resolution of a `ModelConfig` into a concrete `ModelShape`."""

from __future__ import annotations

import dataclasses
from typing import Any

from .rope import RopeScaling, check_scaling

# Fields added to the shape after checkpoints recorded it: `record` leaves them out at these
# values, so a checkpoint written before them still matches a run that does not use them.
_LATER_FIELDS = {"tie_embeddings": False, "qkv_bias": False, "rope_scaling": None, "norm_eps": 1e-5}


@dataclasses.dataclass(frozen=True)
class ModelShape:
  vocab_size: int
  hidden: int
  layers: int
  heads: int
  kv_heads: int
  head_dim: int
  ffn: int
  rope_theta: float
  # The LM head is the embedding's transpose (no parameter of its own).
  tie_embeddings: bool = False
  # Q, K and V projections carry a bias (Qwen2); the output projection never does.
  qkv_bias: bool = False
  rope_scaling: RopeScaling | None = None  # None: unscaled
  norm_eps: float = 1e-5

  def param_count(self) -> int:
    """Parameters: embedding, blocks, final norm, and the LM head unless tied."""
    attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
    bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
    mlp = 3 * self.hidden * self.ffn
    norms = 2 * self.hidden
    heads = 1 if self.tie_embeddings else 2
    return self.layers * (attn + bias + mlp + norms) + heads * self.vocab_size * self.hidden + self.hidden

  def matmul_flops_per_token(self) -> float:
    """Forward FLOPs per token of every matrix product (projections, MLP, LM head)."""
    attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
    return 2.0 * (self.layers * (attn + 3 * self.hidden * self.ffn) + self.vocab_size * self.hidden)

  def record(self) -> dict[str, Any]:
    """The shape as checkpoints record it (JSON-ready); later fields at their defaults left out."""
    out = dataclasses.asdict(self)
    for name, default in _LATER_FIELDS.items():
      if out[name] == default:
        del out[name]
    return out

  @classmethod
  def from_record(cls, record: dict[str, Any]) -> "ModelShape":
    """The inverse of `record`."""
    record = dict(record)
    if record.get("rope_scaling") is not None:
      record["rope_scaling"] = RopeScaling(**record["rope_scaling"])
    return cls(**record)

  def attention_flops(self, q: float, kv: float) -> float:
    """Forward FLOPs of causal core attention of `q` queries over `kv` keys, all layers and heads.

    Bottom-right causal: the area is q*kv - q*(q-1)/2 query-key pairs; QK^T and PV are 2 FLOPs
    per pair and head dim each.
    """
    area = q * kv - q * (q - 1) / 2
    return 4.0 * self.head_dim * self.heads * self.layers * area


PRESETS: dict[str, ModelShape] = {
    # CPU tests and the default job.
    "tiny": ModelShape(vocab_size=512, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                       ffn=384, rope_theta=10_000.0),
    # Llama-3.2-1B shape (16 layers, hidden 2048, 32 heads, 8 KV heads, FFN 8192).
    "llama_1b": ModelShape(vocab_size=128_256, hidden=2048, layers=16, heads=32, kv_heads=8,
                           head_dim=64, ffn=8192, rope_theta=500_000.0),
    "llama3_8b": ModelShape(vocab_size=128_256, hidden=4096, layers=32, heads=32, kv_heads=8,
                            head_dim=128, ffn=14_336, rope_theta=500_000.0),
    "llama_34b": ModelShape(vocab_size=128_256, hidden=8192, layers=48, heads=64, kv_heads=16,
                            head_dim=128, ffn=22_016, rope_theta=500_000.0),
}


# Fields a run started from a checkpoint may change (context extension changes RoPE).
_FREE_WITH_INIT_FROM = ("rope_theta", "rope_scaling")


def resolve(model_config) -> ModelShape:
  """Preset shape (or, with `init_from`, the checkpoint's) with every explicitly set field of
  `model_config` applied; validated."""
  from distca_jax.schema import ConfigError  # the schema module: no cycle with config.py

  init_from = getattr(model_config, "init_from", None)
  if init_from is not None:
    base = _checkpoint_base(model_config, init_from)
  elif model_config.preset == "custom":
    base = {}
  else:
    base = dataclasses.asdict(PRESETS[model_config.preset])
    base["rope_scaling"] = None  # asdict made a dict of it
  for field in dataclasses.fields(ModelShape):
    value = getattr(model_config, field.name, None)
    if field.name == "rope_scaling":
      if value is not None:
        base[field.name] = _scaling(base.get(field.name), value)
    elif value is not None:
      base[field.name] = value
  required = [f.name for f in dataclasses.fields(ModelShape) if f.default is dataclasses.MISSING]
  missing = [name for name in required if name not in base]
  if missing:
    raise ConfigError(f"model.{missing[0]}: required when model.preset=custom (missing {missing})")
  shape = ModelShape(**base)
  for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn"):
    if getattr(shape, name) <= 0:
      raise ConfigError(f"model.{name}: must be positive, got {getattr(shape, name)}")
  if shape.heads % shape.kv_heads:
    raise ConfigError(f"model.kv_heads: {shape.kv_heads} must divide model.heads ({shape.heads})")
  if shape.head_dim % 2:
    raise ConfigError(f"model.head_dim: must be even for RoPE, got {shape.head_dim}")
  return shape


def _checkpoint_base(model_config, path: str) -> dict[str, Any]:
  """The shape of the checkpoint at `path` as `resolve`'s base; an explicitly set field that
  disagrees with it (RoPE fields excepted) is an error naming the field."""
  from distca_jax.schema import ConfigError

  from .hf import CheckpointFormatError, checkpoint_shape

  try:
    base = checkpoint_shape(path)
  except CheckpointFormatError as e:
    raise ConfigError(f"model.init_from: {e}") from None
  for name, value in base.items():
    given = getattr(model_config, name, None)
    if name in _FREE_WITH_INIT_FROM or given is None:
      continue
    if given != value:
      raise ConfigError(f"model.{name}: {given!r} disagrees with model.init_from's {value!r} "
                        f"({path}); leave it unset to take the checkpoint's")
  if model_config.preset not in ("tiny", "custom"):
    preset = PRESETS[model_config.preset]
    core = ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn")
    if any(getattr(preset, n) != base[n] for n in core):
      raise ConfigError(f"model.preset: {model_config.preset} is not the shape of model.init_from "
                        f"({path}); leave it unset to take the checkpoint's")
  return base


def _scaling(base: RopeScaling | None, given: RopeScaling) -> RopeScaling | None:
  """The RoPE scaling of the run: `given`'s type and fields; with its type unset, its fields
  over the base's (the checkpoint's, when it has one). None: unscaled. Validated."""
  from distca_jax.schema import ConfigError

  changed = {f.name: getattr(given, f.name) for f in dataclasses.fields(given)
             if getattr(given, f.name) is not None}
  if given.type is None:
    if not changed:
      return base
    if base is None:
      raise ConfigError(f"model.rope_scaling.type: required when model.rope_scaling."
                        f"{next(iter(changed))} is set")
    merged = dataclasses.replace(base, **changed)
  else:
    merged = given
  check_scaling(merged)
  return merged if merged.active else None
