"""Typed configuration of the at-scale simulator (`launch/simulate.py`).

Same style as `distca_jax/config.py`: a frozen schema with defaults, YAML files under
`configs/sim_*.yaml` that only override it, `key=value` overrides on the command line, and
validation that names the bad field. Sweep axes (`models`, `gpus`, `tokens_per_rank`,
`distributions`, `pipeline_parallel`) are lists; the simulator runs their cartesian product, or,
when `sweeps` is given, the union of one product per entry (an entry overrides some axes and
inherits the rest: "8B at 64-256 GPUs and 34B at 128-512" is two entries).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


from distca_jax.config import NETWORK_GBPS, NVLINK_GBPS, ConfigError, layered

MODELS = ("llama3_8b", "llama_34b", "llama_1b")


@dataclasses.dataclass(frozen=True)
class HardwareConfig:
  """Throughputs per GPU and bandwidths per GPU (DESIGN.md §3 for the defaults)."""

  # Sustained bf16 TFLOP/s of the linear layers (projections, MLP). Measured matmul: 612.
  linear_tflops: float = 450.0
  # Sustained TFLOP/s of fused varlen attention; §3: packed cuDNN ≈ 300 (fwd and fwd+bwd).
  attention_tflops: float = 300.0
  # Optional profiled kernel table; overrides attention_tflops. The name of a table the package
  # ships (`NVIDIA_H100_mosaic`, `NVIDIA_H200_mosaic`, `NVIDIA_H100_triton`: the kernel each
  # card's training takes first is `mosaic`) or the path of a `launch/bench_kernels.py` table.
  time_table: str | None = None
  gpus_per_node: int = 8
  nvlink_gbps: float = NVLINK_GBPS  # GB/s per GPU each way inside a node (§3: all_to_all 180-200)
  network_gbps: float = NETWORK_GBPS  # GB/s per GPU across nodes (the paper's setting)


# The sweep axes: the fields a `sweeps` entry may override.
AXES = ("models", "gpus", "tokens_per_rank", "distributions", "pipeline_parallel")


@dataclasses.dataclass(frozen=True)
class Sweep:
  """One entry of `SimConfig.sweeps`: axes it sets (None: the top-level value)."""

  models: tuple | None = None
  gpus: tuple | None = None
  tokens_per_rank: tuple | None = None
  distributions: tuple | None = None
  pipeline_parallel: tuple | None = None


@dataclasses.dataclass(frozen=True)
class SimConfig:
  models: tuple = ("llama3_8b",)
  gpus: tuple = (64, 128, 256)
  tensor_parallel: int = 8
  # Decoder layers of every model (0: each preset's own). Fewer layers make the embedding and LM
  # head, which CAD does not change, a larger share of the step: set it to compare with a short
  # benchmark model (docs/SIMULATOR.md, "Against measurements").
  layers: int = 0
  # Pipeline stages (4D). GPUs = DP x PP x TP; every stage holds layers / PP layers. 1: the 3D
  # model, unchanged (distca_jax/sim/pipeline.py has the 4D one).
  pipeline_parallel: tuple = (1,)
  # Micro-batches per DP replica per step (each of tokens_per_rank tokens). 0: 1 without a
  # pipeline (the 3D step), 2 x PP with one.
  microbatches: int = 0
  tokens_per_rank: tuple = (131072,)
  # `pretrain`, `prolong`, or a path to a JSON list of document lengths.
  distributions: tuple = ("pretrain",)
  batches: int = 5
  seed: int = 0
  # Length multiplier of the sampled documents; 0: tokens_per_rank / 128K (the paper's scheme).
  elongate_factor: int = 0
  upsample_long_factor: int = 2
  epsilon: float = 0.05
  # A batch whose colocated attention imbalance is below this runs colocated (training's
  # attention.min_imbalance); 1: off, so the simulator shows what CAD costs on balanced batches.
  min_imbalance: float = 1.0
  # Training's step gate (attention.gate), here with the simulator's own model as the prediction:
  # a batch CAD would run slower than colocated runs colocated. Off: every batch runs CAD.
  gate: bool = False
  # Baselines: WLB token cap (× T) and the CP sizes swept (0: every power of two up to 32).
  wlb_token_cap: float = 1.5
  cp_sizes: tuple = (0,)
  # Fraction of the baselines' CP KV all-gather hidden under compute.
  cp_overlap: float = 0.5
  # CAD runs Ping and Pong nano-batches, one plan each (false: one plan per micro-batch); as in
  # training (attention.pingpong_allow_single), a batch whose split cuts a document longer than
  # half the batch runs as one plan where that is faster, unless `pingpong_allow_single` is off.
  pingpong: bool = True
  pingpong_allow_single: bool = True
  # Fraction of CAD's dispatch traffic that ping-pong can hide at most (1: all of it when the
  # other nano-batch's compute is long enough).
  pingpong_overlap: float = 1.0
  # CAD's transport: `ragged`, only the rows that move (attention.exchange=ragged), or `tiled`,
  # every (device, server) pair padded to the largest pair's capacity bucket (the default
  # attention.exchange=tiled of the dispatch).
  exchange: str = "ragged"
  # CAD's costs the model otherwise leaves out, as fit to fourteen batches on 4 x H100
  # (docs/PERFORMANCE.md "The step gate", launch/fit_gate.py): a fixed part, as a fraction of each
  # rank's linear time (the ping-pong split's smaller matmuls, the exchange's calls), and ms per GB
  # a rank sends and receives (the rows that move, per layer: laying them out on the servers and
  # the exchange ping-pong does not hide). 0 and 0: the ideal model, which the tables of
  # docs/SIMULATOR.md before "Against measurements on 4 GPUs, calibrated" use; measured: 0.0228
  # and 16.6.
  cad_fixed_overhead: float = 0.0
  cad_ms_per_gb: float = 0.0
  hardware: HardwareConfig = HardwareConfig()
  # Optional list of sub-sweeps (`Sweep`); empty: the product of the top-level axes.
  sweeps: tuple = ()
  out_dir: str = "runs/sim"
  progress: bool = True

  def microbatches_for(self, pp: int) -> int:
    """Micro-batches per replica per step at `pp` stages (resolves the 0 = auto default)."""
    if self.microbatches:
      return self.microbatches
    return 1 if pp == 1 else 2 * pp

  def sweep_axes(self) -> list[dict]:
    """One dict of the five axes per sub-sweep (the top-level axes when `sweeps` is empty)."""
    top = {a: getattr(self, a) for a in AXES}
    if not self.sweeps:
      return [top]
    return [{a: getattr(s, a) if getattr(s, a) is not None else top[a] for a in AXES}
            for s in self.sweeps]


_LISTS = {"models": str, "gpus": int, "tokens_per_rank": int, "distributions": str, "cp_sizes": int,
          "pipeline_parallel": int}


def _coerce(path: str, kind: type, value: Any) -> Any:
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if kind is bool and isinstance(value, bool):
    return value
  if isinstance(value, kind) and not isinstance(value, bool):
    return value
  raise ConfigError(f"{path}: expected {kind.__name__}, got {value!r}")


def _merge(obj, updates: dict, prefix: str):
  names = {f.name: f for f in dataclasses.fields(obj)}
  changes = {}
  for key, value in updates.items():
    path = f"{prefix}{key}"
    if key not in names:
      raise ConfigError(f"{path}: unknown field; known fields are {sorted(names)}")
    current = getattr(obj, key)
    if dataclasses.is_dataclass(current):
      if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping")
      changes[key] = _merge(current, value, f"{path}.")
    elif key == "sweeps" and not prefix:
      changes[key] = _sweeps(path, value)
    elif key in _LISTS and (not prefix or prefix.startswith("sweeps[")):
      items = value if isinstance(value, (list, tuple)) else [value]
      changes[key] = tuple(_coerce(f"{path}[{i}]", _LISTS[key], v) for i, v in enumerate(items))
    elif key == "time_table":
      changes[key] = None if value is None else _coerce(path, str, value)
    else:
      changes[key] = _coerce(path, type(current), value)
  return dataclasses.replace(obj, **changes)


def _sweeps(path: str, value: Any) -> tuple:
  if not isinstance(value, (list, tuple)):
    raise ConfigError(f"{path}: expected a list of mappings of {list(AXES)}")
  out = []
  for i, entry in enumerate(value):
    if not isinstance(entry, dict):
      raise ConfigError(f"{path}[{i}]: expected a mapping of {list(AXES)}")
    out.append(_merge(Sweep(), entry, f"{path}[{i}]."))
  return tuple(out)


def load_sim_config(path: str | Path | None = None, overrides=()) -> SimConfig:
  """Defaults, then the YAML file, then `key=value` overrides (lists: `gpus=[64,128]`)."""
  config = layered(SimConfig(), path, overrides, _merge)
  validate(config)
  return config


def validate(c: SimConfig) -> None:
  from distca_jax.models.presets import PRESETS  # lazy: keeps the schema importable alone

  if c.layers < 0:
    raise ConfigError(f"layers: must be >= 0 (0: each model's own), got {c.layers}")
  if c.tensor_parallel < 1:
    raise ConfigError(f"tensor_parallel: must be >= 1, got {c.tensor_parallel}")
  if c.microbatches < 0:
    raise ConfigError(f"microbatches: must be >= 1, or 0 for 2 x pipeline_parallel, got {c.microbatches}")
  for k, axes in enumerate(c.sweep_axes()):
    at = f"sweeps[{k}]." if c.sweeps else ""
    for name in AXES:
      if not axes[name]:
        raise ConfigError(f"{at}{name}: must not be empty")
    for m in axes["models"]:
      if m not in MODELS:
        raise ConfigError(f"{at}models: {m!r} is not allowed; choose from {list(MODELS)}")
    for pp in axes["pipeline_parallel"]:
      if pp < 1:
        raise ConfigError(f"{at}pipeline_parallel: {pp} must be >= 1")
      for m in axes["models"]:
        layers = c.layers or PRESETS[m].layers
        if layers % pp:
          raise ConfigError(f"{at}pipeline_parallel: {pp} must divide the {layers} layers of {m}")
    for g in axes["gpus"]:
      for pp in axes["pipeline_parallel"]:
        if g < 1 or g % (c.tensor_parallel * pp):
          raise ConfigError(f"{at}gpus: {g} must be a positive multiple of tensor_parallel x "
                            f"pipeline_parallel ({c.tensor_parallel} x {pp})")
    for t in axes["tokens_per_rank"]:
      if t < 128 or t % 128:
        raise ConfigError(f"{at}tokens_per_rank: {t} must be a positive multiple of 128")
  if c.batches < 1:
    raise ConfigError(f"batches: must be >= 1, got {c.batches}")
  if not 0 <= c.epsilon < 1:
    raise ConfigError(f"epsilon: must be in [0, 1), got {c.epsilon}")
  if not c.min_imbalance >= 1:
    raise ConfigError(f"min_imbalance: a max / mean ratio, must be >= 1, got {c.min_imbalance}")
  if c.wlb_token_cap < 1:
    raise ConfigError(f"wlb_token_cap: must be >= 1, got {c.wlb_token_cap}")
  if c.exchange not in ("ragged", "tiled"):
    raise ConfigError(f"exchange: 'ragged' or 'tiled', got {c.exchange!r}")
  for name in ("cad_fixed_overhead", "cad_ms_per_gb"):
    if getattr(c, name) < 0:
      raise ConfigError(f"{name}: must be >= 0, got {getattr(c, name)}")
  for name in ("cp_overlap", "pingpong_overlap"):
    if not 0 <= getattr(c, name) <= 1:
      raise ConfigError(f"{name}: must be in [0, 1], got {getattr(c, name)}")
  h = c.hardware
  for name in ("linear_tflops", "attention_tflops", "nvlink_gbps", "network_gbps"):
    if getattr(h, name) <= 0:
      raise ConfigError(f"hardware.{name}: must be positive, got {getattr(h, name)}")
  if h.gpus_per_node < 1:
    raise ConfigError(f"hardware.gpus_per_node: must be >= 1, got {h.gpus_per_node}")
  if h.time_table:
    _check_time_table(h.time_table, sorted({m for axes in c.sweep_axes() for m in axes["models"]}))


def _check_time_table(name_or_path: str, models) -> None:
  """The table loads, and its head dim is every simulated model's (the engine rescales heads,
  not the head dim)."""
  from distca_jax.models.presets import PRESETS
  from distca_jax.schedule.cost import TimeTable

  try:
    table = TimeTable.load(name_or_path)
  except ValueError as e:
    raise ConfigError(f"hardware.time_table: {e}") from None
  for m in models:
    if PRESETS[m].head_dim != table.head_dim:
      raise ConfigError(f"hardware.time_table: {name_or_path!r} was measured at head dim "
                        f"{table.head_dim}; {m} has {PRESETS[m].head_dim}")
