"""RoPE frequencies: the plain ones and Hugging Face's scaled variants (`linear`, `llama3`, `yarn`).

The frequencies are computed on the host in float64 from the formulas of Hugging Face's
`modeling_rope_utils` (the field names are theirs, so a checkpoint's `rope_scaling` reads as
is) and enter the step as constants. YaRN also scales cos and sin by its attention factor, as
Hugging Face does: q.k grows by the factor squared before the softmax, in the model, so every
attention backend and CAD's servers see the same scaled q and k.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import numpy as np

from distca_jax.schema import ConfigError, PositiveFloat, PositiveInt

SCALING_TYPES = ("none", "linear", "llama3", "yarn")
# Fields each scaling type requires, and the ones it may take (Hugging Face's names).
_REQUIRED = {"none": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings")}
_OPTIONAL = {"none": (), "linear": (), "llama3": (),
             "yarn": ("beta_fast", "beta_slow", "attention_factor", "truncate")}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE scaling for context extension, with Hugging Face's `rope_scaling` names."""

  # none, linear, llama3 or yarn; unset: none, or with model.init_from the checkpoint's.
  type: Literal["none", "linear", "llama3", "yarn"] | None = None
  # How much longer the context becomes (all three types).
  factor: PositiveFloat | None = None
  # The pretrained context length (llama3, yarn).
  original_max_position_embeddings: PositiveInt | None = None
  # llama3: wavelengths above original / low_freq_factor are divided by factor, those below
  # original / high_freq_factor kept, the band between interpolated.
  low_freq_factor: PositiveFloat | None = None
  high_freq_factor: PositiveFloat | None = None
  # yarn: the rotation counts bounding the interpolated band (unset: 32 and 1).
  beta_fast: PositiveFloat | None = None
  beta_slow: PositiveFloat | None = None
  # yarn: the factor cos and sin are multiplied by (unset: 0.1 ln(factor) + 1).
  attention_factor: PositiveFloat | None = None
  # yarn: round the band's bounds to whole dimensions (Hugging Face's default).
  truncate: bool | None = None

  @property
  def active(self) -> bool:
    return self.type not in (None, "none")


def check_scaling(s: RopeScaling, where: str = "model.rope_scaling") -> None:
  """Raises ConfigError naming the field when `s` lacks a field its type needs or sets one it
  does not use."""
  kind = s.type or "none"
  for name in _REQUIRED[kind]:
    if getattr(s, name) is None:
      raise ConfigError(f"{where}.{name}: required with {where}.type={kind}")
  for f in dataclasses.fields(s):
    if f.name != "type" and getattr(s, f.name) is not None and \
        f.name not in _REQUIRED[kind] + _OPTIONAL[kind]:
      raise ConfigError(f"{where}.{f.name}: not used by {where}.type={kind}")
  if kind == "llama3" and s.high_freq_factor <= s.low_freq_factor:
    raise ConfigError(f"{where}.high_freq_factor: must exceed low_freq_factor "
                      f"({s.high_freq_factor} <= {s.low_freq_factor})")
  if kind == "yarn" and (s.beta_fast or 32) < (s.beta_slow or 1):
    raise ConfigError(f"{where}.beta_fast: must be at least beta_slow")


def inv_freq(head_dim: int, theta: float, s: RopeScaling | None) -> np.ndarray:
  """[head_dim / 2] float32 inverse frequencies of `theta`, scaled as `s` says."""
  base = theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  inv = 1.0 / base
  kind = "none" if s is None else (s.type or "none")
  if kind == "linear":
    inv = inv / s.factor
  elif kind == "llama3":
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv = np.where(medium, smoothed, scaled)
  elif kind == "yarn":
    low, high = _yarn_band(head_dim, theta, s)
    if low == high:
      high += 0.001  # as Hugging Face: no zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    inv = (inv / s.factor) * (1 - extrapolate) + inv * extrapolate
  return inv.astype(np.float32)


def _yarn_band(head_dim: int, theta: float, s: RopeScaling) -> tuple[float, float]:
  """YaRN's [low, high] dimension band between extrapolation and interpolation."""
  def dim_of(rotations):
    return (head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta)))

  low, high = dim_of(s.beta_fast or 32), dim_of(s.beta_slow or 1)
  if s.truncate is None or s.truncate:
    low, high = math.floor(low), math.ceil(high)
  return max(low, 0), min(high, head_dim - 1)


def attention_factor(s: RopeScaling | None) -> float:
  """The factor cos and sin are multiplied by: YaRN's (set, or 0.1 ln(factor) + 1), else 1."""
  if s is None or s.type != "yarn":
    return 1.0
  if s.attention_factor is not None:
    return float(s.attention_factor)
  return 1.0 if s.factor <= 1 else 0.1 * math.log(s.factor) + 1.0
