"""One typed configuration schema, YAML files that override it, and `key.sub=value` overrides.

Every experiment is a `Config`. YAML files under `configs/` only override its defaults; command
line overrides (`model.preset=llama_1b train.steps=10`) are applied last. Values on the command line
are parsed as YAML scalars (`true`, `3`, `1e-4`, `[1, 2]`). Unknown keys and bad values raise
`ConfigError` naming the dotted field and, where there is a closed set, the allowed values.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


# Per-GPU bandwidth each way, GB/s: within a node over NVLink (DESIGN.md §3: a tiled all_to_all
# on 2 H200s ran at 180-200) and across nodes (the paper's network setting, DESIGN.md "Cost
# model"). Defaults of the CAD gate's price of a byte between nodes and of the simulator's links.
NVLINK_GBPS = 200.0
NETWORK_GBPS = 50.0


class ConfigError(ValueError):
  """A configuration value is unknown, of the wrong type, or inconsistent."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Llama-style decoder. `preset` fills shapes; explicitly set fields override the preset."""

  preset: Literal["tiny", "llama_1b", "llama3_8b", "llama_34b", "custom"] = "tiny"
  vocab_size: int | None = None
  hidden: int | None = None
  layers: int | None = None
  heads: int | None = None
  kv_heads: int | None = None
  head_dim: int | None = None
  ffn: int | None = None
  rope_theta: float | None = None
  norm_eps: float = 1e-5
  # Rematerialisation of each decoder block in the backward pass.
  remat: Literal["none", "full", "save_dots"] = "full"
  dtype: Literal["bfloat16", "float32"] = "bfloat16"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh. `data=-1` takes every device not used by the other axes."""

  data: int = -1
  tensor: int = 1
  pipe: int = 1
  # Shard parameters and optimizer state over `data` (FSDP); replicate them when off.
  fsdp: bool = True


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where documents come from and how they are packed into per-device buffers."""

  source: Literal["synthetic", "corpus"] = "synthetic"
  # `pretrain`, `prolong`, or a path to a JSON list of document lengths.
  distribution: str = "pretrain"
  # The defaults are the built-in CPU job (8 simulated devices, tiny model, under a minute on
  # 2 cores); configs/*.yaml set real sizes.
  tokens_per_device: int = 256
  long_threshold: int = 10_000
  upsample_long_factor: int = 2
  elongate_factor: int = 1
  # ProLong's full-context replacement; `None` turns it on for `prolong` only.
  full_context_replacement: bool | None = None
  # Divides every sampled length (after elongation) so small test runs keep the distribution's
  # shape at a fraction of its size. 1 = the paper's lengths.
  length_scale: float = 32.0
  seed: int = 0
  # For `source: corpus`: token file and document-offsets file built by `launch/build_corpus.py`.
  corpus_tokens: str | None = None
  corpus_offsets: str | None = None


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """How core attention runs: where the tokens are (`colocated`) or on attention servers."""

  impl: Literal["colocated", "distca"] = "colocated"
  kernel: Literal["auto", "reference", "pallas", "triton", "mosaic", "cudnn"] = "auto"
  # CAD scheduler tolerance: servers within epsilon * mean load count as balanced.
  epsilon: float = 0.1
  # The step gate: the trainer plans the step, predicts the fraction of the colocated step CAD
  # saves with that plan net of the exchange's cost (`metrics.predicted_cad_saving`, fit to 14
  # batches on 4 H100s, docs/PERFORMANCE.md "The step gate": within 1.5% of the measured saving
  # when each batch is left out of the fit), and runs colocated attention that step if the
  # prediction is below `min_gain` (a fraction of the step, may be negative). `gate: false` runs
  # CAD on every step. Pipelined runs (mesh.pipe > 1) gate their ticks with min_imbalance only.
  gate: bool = True
  min_gain: float = 0.0
  # The gate's cost model, in matmul-FLOP units: attention's time per FLOP relative to the rest
  # of the step; the exchange's fixed cost as a fraction of the matmul time; and its cost per
  # byte the busiest device sends and receives (the tiled exchange: whole padded blocks at the
  # run's capacities, `dispatch.exchange_bytes`). Fit on one NVLink host of 4 H100s with the
  # Triton kernel, checked on 2 H200s (`python launch/fit_gate.py` refits from measured step
  # times and prints these three as overrides): refit them for other GPUs or multi-node
  # exchanges. The attention cost, unset, is the one measured for the kernel the run's
  # attention takes (`metrics.GATE_ATTENTION_COST`: triton 0.75, mosaic 0.61; kernels
  # not measured in steps take triton's); `fit_gate.py --kernel-logs` measures another's.
  gate_attention_cost: float | None = None
  gate_exchange_fixed: float = 0.00936
  gate_exchange_flops_per_byte: float = 1305.0
  # Across nodes: a byte the exchange moves between data ranks on different nodes costs this many
  # NVLink bytes (the fit above is one NVLink host's), and a device's exchange takes as long as
  # its busier link, within its node or across (`dispatch.exchange_bytes`, as the simulator
  # models it). Default 4: NVLINK_GBPS / NETWORK_GBPS (above); not measured here: refit on the
  # cluster. `gate_nodes`: the node of each data rank; unset, the trainer finds it (processes
  # grouped by host name; one process is one node) and records it in the run's config.json. Set
  # it (a list of mesh.data node numbers) to plan as another topology would, or where host names
  # do not tell nodes apart (containers that share one name would all count as one node).
  gate_network_byte_cost: float = NVLINK_GBPS / NETWORK_GBPS
  gate_nodes: tuple[int, ...] | None = None
  # A second, cruder gate: a batch whose colocated attention load (max / mean over devices) is
  # below this runs colocated, and a nano-batch (with mesh.pipe > 1: a tick) below it moves
  # nothing. The ratio alone does not say what balancing buys (on 4 H100s a batch at 1.28 gained
  # 2.2% where batches at 1.32 and 1.41 lost 2%). Unset: off (1.0) for unpipelined steps, which
  # the gate above decides; 1.25 for a pipeline's ticks, which have no other gate
  # (`min_imbalance_for`).
  min_imbalance: float | None = None
  # Ping-pong: two nano-batches of half the tokens each, so one's exchange overlaps the other's
  # compute. Equal halves cut at most one document per step in two; the second half's attention
  # reads the first half's K/V rows of its prefix, so the step computes exactly what one stream
  # would. A step whose split cuts a document longer than half the step runs whichever of one
  # or two streams the gate's model predicts saves more (unequal halves balance worse), unless
  # `pingpong_allow_single` is false: one stream holds twice the rows per exchange and kernel
  # call (+4.8 GiB of XLA temporaries on the Llama-3-8B shape at 64K per device), which a run
  # sized to two streams' memory may not have. `false`: every step one stream (the
  # single-stream ablation).
  pingpong: bool = True
  pingpong_allow_single: bool = True
  memory_mode: Literal["keep", "resend"] = "keep"
  # The exchange's transport: `tiled` all_to_all of padded blocks (CPU and GPU); `shifted`, one
  # ppermute per shift k (block d -> d + k), each shift's blocks at that shift's largest rather
  # than every pair at the largest pair (CPU and GPU; on the 4-GPU batches 2.9x the moved bytes
  # instead of 5.9x, launch/exchange_padding.py; not yet timed on a GPU); or `ragged` (GPU
  # only): only the rows that move travel, but XLA 0.11 waits on the host before each call
  # (measured 0.74x colocated where tiled gives 1.09x, docs/PERFORMANCE.md).
  exchange: Literal["tiled", "shifted", "ragged"] = "tiled"

  def min_imbalance_for(self, pipelined: bool) -> float:
    """`min_imbalance`, or its default for unpipelined steps (1.0) or a pipeline's ticks (1.25)."""
    if self.min_imbalance is not None:
      return self.min_imbalance
    return 1.25 if pipelined else 1.0


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with linear warm-up and cosine decay, global-norm clipping."""

  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  warmup_steps: int = 5
  decay_steps: int | None = None  # None: the run's length
  b1: float = 0.9
  b2: float = 0.95
  weight_decay: float = 0.1
  clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 30
  seed: int = 0
  # Micro-batches per step per data rank, each one buffer of data.tokens_per_device tokens.
  # With mesh.pipe > 1 they flow through the pipeline (distca_jax/pipeline.py); must be 1 otherwise.
  microbatches: int = 1
  log_every: int = 1
  out_dir: str = "runs/default"
  tensorboard: bool = True
  progress: bool = True
  # Simulated host devices when no accelerator is present (0: leave XLA's default).
  cpu_devices: int = 8
  # Peak dense bf16 TFLOP/s per device for MFU; None: known GPUs by name, else MFU is not shown.
  peak_tflops: float | None = None
  # Stop after this many seconds even if train.steps is not reached (None: no limit).
  max_seconds: float | None = None
  # Stop once this many steps are done in total (a planned interruption; the learning-rate
  # schedule still spans train.steps, so a resumed run continues exactly). None: no stop.
  stop_at_step: int | None = None
  # Seconds to wait for the jax.distributed coordinator and the other processes at start-up.
  init_timeout_s: int = 300
  # Profiling (distca_jax/train/profile.py): an xprof trace of `profile_steps` steps starting
  # at step `profile_start` (1-based, after warm-up) into <out_dir>/trace, a per-phase breakdown
  # and per-device attention load in <out_dir>/profile.json and attention_load.png.
  profile: bool = False
  profile_start: int = 3
  profile_steps: int = 2
  # Steady-state steps (after compilation) left out of the profile's step-time statistics.
  profile_warmup: int = 1
  # Plan each colocated step with the CAD scheduler on the host (prefetch thread) to report the
  # attention imbalance it would reach ("after"); distca steps report their own plan's.
  imbalance_after: bool = True
  # JAX persistent compilation cache directory (None: off). A resumed run loads its compiled
  # step from here instead of compiling again.
  compile_cache_dir: str | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints. `every=0` turns them off."""

  every: int = 0
  keep: int = 3
  dir: str | None = None  # None: <train.out_dir>/checkpoints
  resume: bool = True


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  mesh: MeshConfig = MeshConfig()
  data: DataConfig = DataConfig()
  attention: AttentionConfig = AttentionConfig()
  optim: OptimConfig = OptimConfig()
  train: TrainConfig = TrainConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()


# ----------------------------------------------------------------------------- loading


def _check_value(path: str, annotation: Any, value: Any) -> Any:
  """Coerces `value` to `annotation` or raises ConfigError naming `path`."""
  origin = typing.get_origin(annotation)
  args = typing.get_args(annotation)
  if origin is Literal:
    if value not in args:
      raise ConfigError(f"{path}: {value!r} is not allowed; choose one of {list(args)}")
    return value
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    errors = []
    for arg in args:
      if arg is type(None):
        continue
      try:
        return _check_value(path, arg, value)
      except ConfigError as e:
        errors.append(str(e))
    raise ConfigError(errors[0] if errors else f"{path}: bad value {value!r}")
  if annotation is bool:
    if isinstance(value, bool):
      return value
    raise ConfigError(f"{path}: expected true or false, got {value!r}")
  if annotation is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    raise ConfigError(f"{path}: expected an integer, got {value!r}")
  if annotation is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    if isinstance(value, str):
      # YAML 1.1 reads `1e-4` (no dot) as a string; accept any float literal.
      try:
        return float(value)
      except ValueError:
        pass
    raise ConfigError(f"{path}: expected a number, got {value!r}")
  if annotation is str:
    if isinstance(value, str):
      return value
    raise ConfigError(f"{path}: expected a string, got {value!r}")
  if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: a YAML list
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{path}: expected a list, got {value!r}")
    return tuple(_check_value(f"{path}[{i}]", args[0], v) for i, v in enumerate(value))
  raise ConfigError(f"{path}: unsupported field type {annotation}")


def _merge(obj: Any, updates: dict[str, Any], prefix: str) -> Any:
  hints = typing.get_type_hints(type(obj))
  names = {f.name for f in dataclasses.fields(obj)}
  changes = {}
  for key, value in updates.items():
    path = f"{prefix}{key}"
    if key not in names:
      raise ConfigError(f"{path}: unknown field; known fields are {sorted(names)}")
    current = getattr(obj, key)
    if dataclasses.is_dataclass(current):
      if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping of {sorted(f.name for f in dataclasses.fields(current))}")
      changes[key] = _merge(current, value, f"{path}.")
    else:
      changes[key] = _check_value(path, hints[key], value)
  return dataclasses.replace(obj, **changes)


def _nest(dotted: str, value: Any) -> dict[str, Any]:
  keys = dotted.split(".")
  out: dict[str, Any] = {keys[-1]: value}
  for key in reversed(keys[:-1]):
    out = {key: out}
  return out


def parse_override(text: str) -> dict[str, Any]:
  """`"a.b=3"` -> `{"a": {"b": 3}}`, the value parsed as a YAML scalar."""
  if "=" not in text:
    raise ConfigError(f"override {text!r}: expected key.sub=value")
  key, raw = text.split("=", 1)
  if not key or any(not part for part in key.split(".")):
    raise ConfigError(f"override {text!r}: empty key")
  return _nest(key.strip(), yaml.safe_load(raw) if raw.strip() else None)


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
  """The top-level mapping of a YAML config file; ConfigError if missing or not a mapping."""
  path = Path(path)
  if not path.exists():
    raise ConfigError(f"config file {path} does not exist")
  data = yaml.safe_load(path.read_text()) or {}
  if not isinstance(data, dict):
    raise ConfigError(f"config file {path}: expected a mapping at the top level")
  return data


def layered(config, path, overrides, merge):
  """`config`, then the YAML file at `path` (if any), then each `key=value` override, each
  applied by `merge(config, nested_dict, prefix)`."""
  if path is not None:
    config = merge(config, read_yaml_mapping(path), "")
  for text in overrides:
    config = merge(config, parse_override(text), "")
  return config


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
  """Defaults, then the YAML file at `path`, then each `key=value` override; then validation."""
  config = layered(Config(), path, overrides, _merge)
  validate(config)
  return config


def validate(config: Config) -> None:
  """Checks that do not need devices. Mesh-vs-device checks live in `mesh.py`."""
  from distca_jax.models.presets import resolve  # lazy: keeps config importable alone

  shape = resolve(config.model)  # raises ConfigError on bad shapes
  d = config.data
  if d.tokens_per_device <= 0:
    raise ConfigError(f"data.tokens_per_device: must be positive, got {d.tokens_per_device}")
  if d.tokens_per_device % 128:
    raise ConfigError(
        f"data.tokens_per_device: must be a multiple of 128 (the attention tile), got {d.tokens_per_device}")
  for name in ("upsample_long_factor", "elongate_factor", "long_threshold"):
    if getattr(d, name) < 1:
      raise ConfigError(f"data.{name}: must be >= 1, got {getattr(d, name)}")
  if d.length_scale <= 0:
    raise ConfigError(f"data.length_scale: must be positive, got {d.length_scale}")
  if d.source == "corpus" and (d.corpus_tokens is None or d.corpus_offsets is None):
    raise ConfigError("data.corpus_tokens and data.corpus_offsets: both are required when data.source=corpus")
  m = config.mesh
  for name in ("tensor", "pipe"):
    if getattr(m, name) < 1:
      raise ConfigError(f"mesh.{name}: must be >= 1, got {getattr(m, name)}")
  if m.data == 0 or m.data < -1:
    raise ConfigError(f"mesh.data: must be -1 (all remaining devices) or >= 1, got {m.data}")
  if m.pipe > 1:
    if shape.layers % m.pipe:
      raise ConfigError(f"mesh.pipe: {m.pipe} stages must divide model.layers ({shape.layers})")
    if config.attention.impl == "distca" and config.attention.pingpong:
      raise ConfigError("attention.pingpong: not supported with mesh.pipe > 1 yet (one plan per "
                        "pipeline tick); set attention.pingpong=false")
    if config.data.tokens_per_device % m.pipe:
      raise ConfigError(f"data.tokens_per_device: {config.data.tokens_per_device} must be a multiple "
                        f"of mesh.pipe ({m.pipe}): the LM head splits each micro-batch's tokens "
                        f"over the stages")
    if config.model.remat != "full":
      raise ConfigError(f"model.remat: the pipeline keeps only block inputs between a micro-batch's "
                        f"forward and backward ticks and recomputes each block once (full remat); "
                        f"got {config.model.remat!r}, set model.remat=full with mesh.pipe > 1")
  if config.train.microbatches < 1:
    raise ConfigError(f"train.microbatches: must be >= 1, got {config.train.microbatches}")
  if config.train.microbatches > 1 and m.pipe == 1:
    raise ConfigError("train.microbatches: > 1 needs mesh.pipe > 1 (gradient accumulation "
                      "without a pipeline is not implemented)")
  if shape.heads % m.tensor or shape.kv_heads % m.tensor:
    raise ConfigError(
        f"mesh.tensor: {m.tensor} must divide model.heads ({shape.heads}) and model.kv_heads ({shape.kv_heads})")
  if shape.ffn % m.tensor:
    raise ConfigError(f"mesh.tensor: {m.tensor} must divide model.ffn ({shape.ffn})")
  a = config.attention
  if not 0 <= a.epsilon < 1:
    raise ConfigError(f"attention.epsilon: must be in [0, 1), got {a.epsilon}")
  for name in ("gate_attention_cost", "gate_exchange_fixed", "gate_exchange_flops_per_byte"):
    if getattr(a, name) is not None and not getattr(a, name) >= 0:
      raise ConfigError(f"attention.{name}: must be >= 0, got {getattr(a, name)}")
  if not a.gate_network_byte_cost > 0:
    raise ConfigError(f"attention.gate_network_byte_cost: must be > 0 (in NVLink bytes), got "
                      f"{a.gate_network_byte_cost}")
  if a.gate_nodes is not None:
    if m.data != -1 and len(a.gate_nodes) != m.data:
      raise ConfigError(f"attention.gate_nodes: one node number per data rank, got "
                        f"{len(a.gate_nodes)} for mesh.data={m.data}")
    if min(a.gate_nodes, default=0) < 0:
      raise ConfigError(f"attention.gate_nodes: node numbers must be >= 0, got {list(a.gate_nodes)}")
  if not -1 < a.min_gain < 1:
    raise ConfigError(f"attention.min_gain: a fraction of the step, must be in (-1, 1) "
                      f"(attention.gate=false turns the gate off), got {a.min_gain}")
  if a.exchange == "shifted" and m.pipe > 1:
    raise ConfigError("attention.exchange=shifted: not with mesh.pipe > 1 yet (its ppermutes run "
                      "over `data` alone); use attention.exchange=tiled")
  if a.min_imbalance is not None and not a.min_imbalance >= 1:
    raise ConfigError(f"attention.min_imbalance: a max / mean ratio, must be >= 1 (1 turns the "
                      f"gate off), got {a.min_imbalance}")
  o = config.optim
  if o.lr <= 0:
    raise ConfigError(f"optim.lr: must be positive, got {o.lr}")
  if not 0 <= o.min_lr_ratio <= 1:
    raise ConfigError(f"optim.min_lr_ratio: must be in [0, 1], got {o.min_lr_ratio}")
  if o.warmup_steps < 0:
    raise ConfigError(f"optim.warmup_steps: must be >= 0, got {o.warmup_steps}")
  if config.checkpoint.every < 0 or config.checkpoint.keep < 1:
    raise ConfigError("checkpoint.every must be >= 0 and checkpoint.keep >= 1")
  if config.train.steps < 1:
    raise ConfigError(f"train.steps: must be >= 1, got {config.train.steps}")


def to_dict(config: Config) -> dict[str, Any]:
  return dataclasses.asdict(config)
