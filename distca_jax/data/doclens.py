"""The shipped document-length distributions and the paper's batch sampling scheme.

`doclens/` holds copies of the two distributions (see its README for provenance, Apache-2.0).
Sampling follows the paper's scheme (docs/METHOD.md; the README in doclens/): split at
`long_threshold`, repeat long documents `upsample_long_factor` times, optionally replace long
documents by full-context ones (ProLong), draw without replacement, multiply by `elongate_factor`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources
from pathlib import Path

import numpy as np

BUILTIN = ("pretrain", "prolong")
# ProLong's full-context documents are 64K tokens before elongation.
FULL_CONTEXT_TOKENS = 65_536


def load_lengths(name_or_path: str, field: str = "data.distribution") -> np.ndarray:
  """Document lengths (int64, all >= 1) of a built-in distribution or a JSON list file. A
  ValueError whose message starts with `field` (the config field that named it) otherwise."""
  if name_or_path in BUILTIN:
    return _builtin(name_or_path)
  path = Path(name_or_path)
  try:
    if not path.is_file():
      what = ("a directory" if path.is_dir()
              else f"neither one of {list(BUILTIN)} nor an existing file")
      raise ValueError(f"{field}: {name_or_path!r} is {what}")
    text = path.read_bytes().decode("utf-8")
  except UnicodeDecodeError:
    raise ValueError(f"{field}: {path}: not a JSON text file") from None
  except OSError as e:
    raise ValueError(f"{field}: {path}: cannot be read ({e.strerror or e})") from None
  return _parse(text, f"{field}: {path}")


@functools.lru_cache(maxsize=None)
def _builtin(name: str) -> np.ndarray:
  text = resources.files("distca_jax.data").joinpath(f"doclens/{name}.json").read_text()
  lengths = _parse(text, f"built-in distribution {name!r}")
  lengths.flags.writeable = False  # shared by every caller
  return lengths


def _parse(text: str, source: str) -> np.ndarray:
  try:
    values = json.loads(text)
  except (json.JSONDecodeError, RecursionError) as e:
    raise ValueError(f"{source}: not valid JSON ({e})") from None
  if not isinstance(values, list) or not values:
    raise ValueError(f"{source}: expected a non-empty JSON list of document lengths")
  if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
    raise ValueError(f"{source}: every document length must be an integer")
  if not all(1 <= v < 2**53 for v in values):
    bad = next(v for v in values if not 1 <= v < 2**53)
    raise ValueError(f"{source}: document lengths must be >= 1 and < 2**53 (found {bad})")
  return np.asarray(values, dtype=np.int64)


# `LengthSampler` holds its pool (every document, the long ones `upsample_long_factor` times) in
# memory as int64 and permutes it each step: past this many documents that is no longer cheap.
MAX_POOL = 1 << 26


def pool_size(lengths: np.ndarray, long_threshold: int, upsample_long_factor: int) -> int:
  """Documents in `LengthSampler`'s pool: the short ones once, the long ones repeated."""
  long = int((lengths >= long_threshold).sum())
  return int(lengths.size) - long + long * int(upsample_long_factor)


def longest_sampled(lengths: np.ndarray, long_threshold: int, full_context_replacement: bool,
                    elongate_factor: int, length_scale: float) -> float:
  """The longest document `LengthSampler` can draw from `lengths` with these settings, in
  tokens (a float: huge factors must not overflow int64 here)."""
  longest = float(lengths.max())
  if full_context_replacement and (lengths >= long_threshold).any():
    longest = max(longest, float(FULL_CONTEXT_TOKENS))
  return max(1.0, float(np.round(longest * float(elongate_factor) / float(length_scale))))


@dataclasses.dataclass(frozen=True)
class LengthSampler:
  """Draws batches of document lengths, deterministically per (seed, step)."""

  lengths: np.ndarray
  long_threshold: int = 10_000
  upsample_long_factor: int = 2
  elongate_factor: int = 1
  full_context_replacement: bool = False
  length_scale: float = 1.0
  seed: int = 0

  def _pool(self, rng: np.random.Generator) -> np.ndarray:
    short = self.lengths[self.lengths < self.long_threshold]
    long = self.lengths[self.lengths >= self.long_threshold]
    if self.full_context_replacement and long.size:
      replace = rng.random(long.size) < 0.5
      long = np.where(replace, FULL_CONTEXT_TOKENS, long)
    return np.concatenate([short, np.tile(long, self.upsample_long_factor)])

  def sample(self, total_tokens: int, step: int) -> np.ndarray:
    """Lengths that sum to exactly `total_tokens` (the last one is cut to fit)."""
    rng = np.random.default_rng([self.seed, step])
    pool = self._pool(rng)
    order = rng.permutation(pool.size)
    scaled = np.maximum(1, np.round(pool[order] * self.elongate_factor / self.length_scale)).astype(np.int64)
    ends = np.cumsum(scaled)
    n = int(np.searchsorted(ends, total_tokens)) + 1
    if n > scaled.size:  # the whole pool is smaller than the batch: draw again
      reps = -(-total_tokens // int(ends[-1])) + 1
      return LengthSampler.sample(
          dataclasses.replace(self, lengths=np.tile(self.lengths, reps)), total_tokens, step)
    out = scaled[:n].copy()
    out[-1] -= int(ends[n - 1]) - total_tokens
    return out


STRESS_DISTS = ("pretrain", "prolong", "short", "long")


def stress_lengths(dist: str, n: int, t: int, step: int) -> np.ndarray:
  """Document lengths of one batch of n x t tokens, for the benchmarks that stress the planner and
  the exchange: Pretrain and ProLong as the trainer samples them (elongated x t / 64K), `short`
  (short-document-heavy: lognormal, median 500 tokens) or `long` (six documents of 64K-512K
  tokens, then Pretrain). Seeded by `step`."""
  total = n * t
  if dist in ("pretrain", "prolong"):
    sampler = LengthSampler(load_lengths(dist), full_context_replacement=(dist == "prolong"),
                            elongate_factor=max(1, t // 65536))
    return sampler.sample(total, step)
  rng = np.random.default_rng([7, step])
  if dist == "short":
    lens = np.maximum(1, rng.lognormal(np.log(500), 1.0, size=total // 200)).astype(np.int64)
  elif dist == "long":
    lens = np.concatenate([rng.integers(65536, 524288, size=6),
                           LengthSampler(load_lengths("pretrain")).sample(total, step)])
  else:
    raise ValueError(f"unknown distribution {dist!r} (one of {STRESS_DISTS})")
  ends = np.cumsum(lens)
  k = int(np.searchsorted(ends, total)) + 1
  lens = lens[:k].copy()
  lens[-1] -= int(ends[k - 1] - total)
  return lens[lens > 0]
