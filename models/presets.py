"""Model shapes: presets and the resolution of a `ModelConfig` into a concrete `ModelShape`."""

from __future__ import annotations

import dataclasses


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

  def param_count(self) -> int:
    """Parameters, embedding and LM head included (they are not tied)."""
    attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
    mlp = 3 * self.hidden * self.ffn
    norms = 2 * self.hidden
    return self.layers * (attn + mlp + norms) + 2 * self.vocab_size * self.hidden + self.hidden

  def matmul_flops_per_token(self) -> float:
    """Forward FLOPs per token of every matrix product (projections, MLP, LM head)."""
    return 2.0 * (self.param_count() - self.vocab_size * self.hidden - (2 * self.layers + 1) * self.hidden)

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


def resolve(model_config) -> ModelShape:
  """Preset shape with every explicitly set field of `model_config` applied; validated."""
  from distca_jax.schema import ConfigError  # the schema module: no cycle with config.py

  if model_config.preset == "custom":
    base = {}
  else:
    base = dataclasses.asdict(PRESETS[model_config.preset])
  for field in dataclasses.fields(ModelShape):
    value = getattr(model_config, field.name)
    if value is not None:
      base[field.name] = value
  missing = [f.name for f in dataclasses.fields(ModelShape) if f.name not in base]
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
