"""Typed configuration of the at-scale simulator (`launch/simulate.py`).

Loaded like the trainer's (`distca_jax/schema.py`): a frozen schema with defaults whose types
carry their ranges, YAML files under `configs/sim_*.yaml` that only override it, `key=value`
overrides on the command line, and validation that names the bad field. Sweep axes (`models`,
`gpus`, `tokens_per_rank`, `distributions`, `pipeline_parallel`) are lists (one value is a list of
one); the simulator runs their cartesian product, or, when `sweeps` is given, the union of one
product per entry (an entry overrides some axes and inherits the rest: "8B at 64-256 GPUs and 34B
at 128-512" is two entries).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from distca_jax.config import NETWORK_GBPS, NVLINK_GBPS
from distca_jax.schedule.tick import default_min_imbalance
from distca_jax.schema import (Axis, ConfigError, Fraction, NonNegFloat, NonNegInt, OutputDir,
                               PositiveFloat, PositiveInt, Probability, Range, Removed, Seed, check)
from distca_jax.schema_io import load

Model = Literal["llama3_8b", "llama_34b", "llama_1b"]
MODELS = typing.get_args(Model)
Tokens = Annotated[int, Range(ge=128, multiple_of=128, why="the attention tile")]


@dataclasses.dataclass(frozen=True)
class HardwareConfig:
  """Throughputs per GPU and bandwidths per GPU (docs/SIMULATOR.md for the defaults)."""

  # Sustained bf16 TFLOP/s of the linear layers (projections, MLP), below a large matmul's peak.
  linear_tflops: PositiveFloat = 450.0
  # Sustained TFLOP/s of fused varlen attention; packed cuDNN reaches about 300 (fwd and fwd+bwd).
  attention_tflops: PositiveFloat = 300.0
  # Optional profiled kernel table; overrides attention_tflops. The name of a table the package
  # ships (`NVIDIA_H100_mosaic`, `NVIDIA_H200_mosaic`, `NVIDIA_H100_triton`: the kernel each
  # card's training takes first is `mosaic`) or the path of a `launch/bench_kernels.py` table.
  time_table: str | None = None
  gpus_per_node: PositiveInt = 8
  nvlink_gbps: PositiveFloat = NVLINK_GBPS  # GB/s per GPU each way inside a node (docs/METHOD.md)
  network_gbps: PositiveFloat = NETWORK_GBPS  # GB/s per GPU across nodes (the paper's setting)


# The sweep axes: the fields a `sweeps` entry may override.
AXES = ("models", "gpus", "tokens_per_rank", "distributions", "pipeline_parallel")


@dataclasses.dataclass(frozen=True)
class Sweep:
  """One entry of `SimConfig.sweeps`: axes it sets (None: the top-level value)."""

  models: Axis[Model] | None = None
  gpus: Axis[PositiveInt] | None = None
  tokens_per_rank: Axis[Tokens] | None = None
  distributions: Axis[str] | None = None
  pipeline_parallel: Axis[PositiveInt] | None = None


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """The simulator's sweep, its model of a step, and where it writes."""

  models: Axis[Model] = ("llama3_8b",)
  gpus: Axis[PositiveInt] = (64, 128, 256)
  tensor_parallel: PositiveInt = 8
  # Decoder layers of every model (0: each preset's own). Fewer layers make the embedding and LM
  # head, which CAD does not change, a larger share of the step: set it to compare with a short
  # benchmark model (docs/log/simulator-2026-12-07.md, "Against measurements").
  layers: NonNegInt = 0
  # Pipeline stages (4D). GPUs = DP x PP x TP; every stage holds layers / PP layers. 1: the 3D
  # model, unchanged (distca_jax/sim/pipeline.py has the 4D one).
  pipeline_parallel: Axis[PositiveInt] = (1,)
  # Micro-batches per DP replica per step (each of tokens_per_rank tokens). 0: 1 without a
  # pipeline (the 3D step), 2 x PP with one.
  microbatches: NonNegInt = 0
  tokens_per_rank: Axis[Tokens] = (131072,)
  # `pretrain`, `prolong`, or a path to a JSON list of document lengths.
  distributions: Axis[str] = ("pretrain",)
  batches: PositiveInt = 5
  seed: Seed = 0
  # Length multiplier of the sampled documents; 0: tokens_per_rank / 128K (the paper's scheme).
  # Training's data.elongate_factor has no `0`: its default, 1, keeps the sampled lengths.
  elongate_factor: NonNegInt = 0
  upsample_long_factor: PositiveInt = 2
  # The scheduler's tolerance (attention.epsilon). Training's default is 0.1; the predictions in
  # docs/SIMULATOR.md were made at 0.05, so it stays here: `epsilon=0.1` prices training's.
  epsilon: Probability = 0.05
  # A batch (or pipelined tick) whose colocated attention imbalance is below this runs colocated
  # (training's attention.min_imbalance). Unset: training's defaults (`min_imbalance_for`), 1.0
  # (off) for a batch, so the 3D tables show what CAD does on every batch, 1.25 for a tick.
  min_imbalance: Annotated[float, Range(ge=1, why="a max / mean ratio")] | None = None
  # Training's step gate (attention.gate), here with the simulator's own model as the prediction:
  # a batch CAD would run slower than colocated runs colocated. Off (training: on), so the
  # tables show what CAD does on every batch.
  gate: bool = False
  # Baselines: WLB token cap (× T) and the CP sizes swept (0: every power of two up to 32). The
  # simulator prices variable-length WLB at the paper's cap; training's data.wlb_token_cap
  # (1.03125) is tighter because its compiled buffers compute every padded row.
  wlb_token_cap: Annotated[float, Range(ge=1)] = 1.5
  cp_sizes: Axis[NonNegInt] = (0,)
  # Fraction of the baselines' CP KV all-gather hidden under compute.
  cp_overlap: Fraction = 0.5
  # CAD runs Ping and Pong nano-batches, one plan each (false: one plan per micro-batch); as in
  # training (attention.pingpong_allow_single), a batch whose split cuts a document longer than
  # half the batch runs as one plan where that is faster, unless `pingpong_allow_single` is off.
  pingpong: bool = True
  pingpong_allow_single: bool = True
  # Fraction of CAD's dispatch traffic that ping-pong can hide at most (1: all of it when the
  # other nano-batch's compute is long enough).
  pingpong_overlap: Fraction = 1.0
  # CAD's transport (attention.exchange, the same default; distca_jax/schedule/transport.py):
  # auto, `tiled` while the ranks fit one node and `ragged` across nodes; `ragged`, only the rows
  # that move travel; `tiled`, every (device, server) pair padded to the largest pair's bucket.
  exchange: Annotated[Literal["auto", "tiled", "ragged"], Removed(
      shifted="it carried 7-54x the moving rows; use exchange=ragged")] = "auto"
  # Relayed K/V (schedule/relay.py, attention.kv_relay_fanout): a shard three or more servers
  # need is cut into at most this many slices, each sent once to a server that forwards it, in
  # a second exchange round after the first. 0: off (every server receives its K/V rows from
  # their holder); auto, as training: 8 when the servers span more than one node and the
  # exchange is not `tiled`.
  kv_relay_fanout: NonNegInt | Literal["auto"] = "auto"
  # CAD's costs the model otherwise leaves out, as fractions of each rank's linear time:
  # `cad_machinery`, what CAD's own device work adds with nothing to move (the row movers around
  # the exchange, the ping-pong split; one GPU measures it: bench_train.py --suite overhead), and
  # `cad_exchange_fixed`, the exchange's per-call cost, which only several GPUs measure; and
  # `cad_ms_per_gb`, ms per GB a rank sends and receives (the rows that move, per layer: laying
  # them out on the servers and the exchange ping-pong does not hide). All 0: the ideal model;
  # docs/SIMULATOR.md gives the fitted values and the tables made with each.
  cad_machinery: NonNegFloat = 0.0
  cad_exchange_fixed: NonNegFloat = 0.0
  cad_ms_per_gb: NonNegFloat = 0.0
  hardware: HardwareConfig = HardwareConfig()
  # Optional list of sub-sweeps (`Sweep`); empty: the product of the top-level axes.
  sweeps: tuple[Sweep, ...] = ()
  out_dir: OutputDir = "runs/sim"
  progress: bool = True

  RENAMED: ClassVar[dict[str, str]] = {
      "cad_fixed_overhead": "split into cad_machinery (what one GPU measures) and "
                            "cad_exchange_fixed (the exchange's calls); their sum is the old value",
  }

  def min_imbalance_for(self, pipelined: bool) -> float:
    """`min_imbalance`, or training's default for a batch or a pipelined tick."""
    return default_min_imbalance(pipelined) if self.min_imbalance is None else self.min_imbalance

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


def load_sim_config(path: str | Path | None = None, overrides=()) -> SimConfig:
  """Defaults, then the YAML file, then `key=value` overrides (lists: `gpus=[64,128]`); every
  field's range, then `validate`."""
  config = load(SimConfig(), path, overrides)
  validate(config)
  return config


def validate(c: SimConfig) -> None:
  """Checks that span fields (the mesh each sweep point needs) and the input files (length
  distributions, the kernel time table). Single fields' ranges are their types'."""
  from distca_jax.data.doclens import MAX_POOL, LengthSampler, load_lengths, pool_size
  from distca_jax.models.presets import PRESETS  # lazy: keeps the schema importable alone

  check(c)
  for k, axes in enumerate(c.sweep_axes()):
    at = f"sweeps[{k}]." if c.sweeps else ""
    for pp in axes["pipeline_parallel"]:
      for m in axes["models"]:
        layers = c.layers or PRESETS[m].layers
        if layers % pp:
          raise ConfigError(f"{at}pipeline_parallel: {pp} must divide the {layers} layers of {m}")
    for g in axes["gpus"]:
      for pp in axes["pipeline_parallel"]:
        if g % (c.tensor_parallel * pp):
          raise ConfigError(f"{at}gpus: {g} must be a positive multiple of tensor_parallel x "
                            f"pipeline_parallel ({c.tensor_parallel} x {pp})")
    for name in axes["distributions"]:
      try:
        lengths = load_lengths(name, field=f"{at}distributions")
      except ValueError as e:
        raise ConfigError(str(e)) from None
      if pool_size(lengths, LengthSampler.long_threshold, c.upsample_long_factor) > MAX_POOL:
        raise ConfigError(f"upsample_long_factor: {c.upsample_long_factor} repeats of the long "
                          f"documents of {name!r} exceed the sampler's pool of {MAX_POOL} documents")
  if c.hardware.time_table:
    _check_time_table(c.hardware.time_table, sorted({m for axes in c.sweep_axes() for m in axes["models"]}))


def _check_time_table(name_or_path: str, models) -> None:
  """The table loads, and its head dim is every simulated model's (the engine rescales heads,
  not the head dim)."""
  from distca_jax.models.presets import PRESETS
  from distca_jax.schedule.cost import TimeTable

  try:
    table = TimeTable.load(name_or_path)
  except (ValueError, OSError) as e:
    where = "" if name_or_path in str(e) else f"{name_or_path}: "
    raise ConfigError(f"hardware.time_table: {where}{e}") from None
  for m in models:
    if PRESETS[m].head_dim != table.head_dim:
      raise ConfigError(f"hardware.time_table: {name_or_path!r} was measured at head dim "
                        f"{table.head_dim}; {m} has {PRESETS[m].head_dim}")
