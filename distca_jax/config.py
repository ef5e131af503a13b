"""The trainer's typed configuration schema, YAML files that override it, and `key.sub=value`
overrides.

Every experiment is a `Config`. YAML files under `configs/` only override its defaults; command
line overrides (`model.preset=llama_1b train.steps=10`) are applied last. Values on the command line
are parsed as YAML (`true`, `3`, `1e-4`, `[1, 2]`). Each field's type carries its range
(`distca_jax/schema.py` checks it); `validate` (`distca_jax/config_checks.py`) adds the checks
that span fields and the input files (the length distribution, the corpus). Every error is a
`ConfigError` whose message starts with the dotted field and, for a closed set, lists the allowed
values.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from distca_jax.config_checks import validate
from distca_jax.models.rope import RopeScaling
from distca_jax.schedule.tick import default_min_imbalance
from distca_jax.schema import (NON_EMPTY, ConfigError, Fraction, NonNegFloat, NonNegInt,
                               NonNegStepCount, OutputDir, PositiveFloat, PositiveInt, Probability,
                               Range, Removed, Seed, StepCount)
from distca_jax.schema_io import load, parse_override, read_yaml_mapping, to_yaml
from distca_jax.schema_io import to_dict as _to_dict

__all__ = ["Config", "ConfigError", "load_config", "parse_override", "read_yaml_mapping", "to_dict",
           "to_yaml", "validate"]


# Per-GPU bandwidth each way, GB/s: within a node over NVLink (what a tiled all_to_all reached,
# docs/METHOD.md, "Reference measurements") and across nodes (the paper's network setting).
# The simulator's links (the gate's shipped price of a byte between nodes is their ratio).
NVLINK_GBPS = 200.0
NETWORK_GBPS = 50.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Llama-style decoder. `preset` fills shapes; explicitly set fields override the preset."""

  preset: Literal["tiny", "llama_1b", "llama3_8b", "llama_34b", "custom"] = "tiny"
  vocab_size: PositiveInt | None = None
  hidden: PositiveInt | None = None
  layers: PositiveInt | None = None
  heads: PositiveInt | None = None
  kv_heads: PositiveInt | None = None
  head_dim: PositiveInt | None = None
  ffn: PositiveInt | None = None
  rope_theta: PositiveFloat | None = None
  # RMSNorm's epsilon; unset: 1e-5, or with model.init_from the checkpoint's.
  norm_eps: PositiveFloat | None = None
  # The LM head is the embedding's transpose (Llama-3.2-1B/3B); unset: false, or the checkpoint's.
  tie_embeddings: bool | None = None
  # Q, K and V projections with a bias (Qwen2); unset: false, or the checkpoint's.
  qkv_bias: bool | None = None
  # Start from these parameters (fresh optimizer, step 0): a directory `launch/convert.py import`
  # wrote, or a Hugging Face checkpoint directory (config.json and *.safetensors). The model's
  # shape is the checkpoint's (an explicit field that disagrees is an error); rope_theta and
  # rope_scaling may change. A run that has checkpoints of its own resumes them instead.
  init_from: str | None = None
  # Rematerialisation of each decoder block in the backward pass.
  # auto: on GPU the first of none / save_proj / save_attn / full whose compiled step fits the
  # device's memory (models/llama.py REMAT_POLICIES, train/remat.py); full on CPU and with
  # mesh.pipe > 1.
  remat: Annotated[Literal["auto", "none", "save_proj", "save_attn", "full"], Removed(
      save_dots="no measurement favoured it; use model.remat=save_attn or full")] = "auto"
  dtype: Literal["bfloat16", "float32"] = "bfloat16"
  # RoPE scaling for context extension (Hugging Face's `rope_scaling` fields).
  rope_scaling: RopeScaling = RopeScaling()


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh. `data=-1` takes every device not used by the other axes."""

  data: Annotated[int, Range(ge=1, also=(-1,), why="-1: all remaining devices")] = -1
  tensor: PositiveInt = 1
  pipe: PositiveInt = 1
  # Devices per node (a SLURM job: GPUs per node): consecutive devices of the mesh share a node.
  # Unset: the trainer groups the devices by their processes' host names. The nodes decide the
  # exchange's transport (attention.exchange=auto), relays and the gate's price of a byte.
  devices_per_node: PositiveInt | None = None
  # Shard parameters and optimizer state over `data` (FSDP); replicate them when off.
  fsdp: bool = True


@dataclasses.dataclass(frozen=True)
class MixtureSource:
  """One source of `data.mixture`: a corpus, or a synthetic length distribution, and its weight."""

  # Names the source in the step log, the summary and the checkpoint's token counts.
  name: Annotated[str, NON_EMPTY] = "source"
  # Its share of every step's tokens: weight / the sum of the mixture's weights.
  weight: PositiveFloat = 1.0
  # A corpus built by `launch/build_corpus.py` (both files), or else synthetic documents whose
  # lengths follow `distribution` (`pretrain`, `prolong`, or a JSON list of lengths).
  corpus_tokens: str | None = None
  corpus_offsets: str | None = None
  distribution: str = "pretrain"


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where documents come from and how they are packed into per-device buffers."""

  source: Literal["synthetic", "corpus"] = "synthetic"
  # `pretrain`, `prolong`, or a path to a JSON list of document lengths.
  distribution: str = "pretrain"
  # The defaults are the built-in CPU job (8 simulated devices, tiny model, under a minute on
  # 2 cores); configs/*.yaml set real sizes.
  tokens_per_device: Annotated[int, Range(ge=128, multiple_of=128, why="the attention tile")] = 256
  long_threshold: PositiveInt = 10_000
  upsample_long_factor: PositiveInt = 2
  elongate_factor: PositiveInt = 1
  # ProLong's full-context replacement; `None` turns it on for `prolong` only.
  full_context_replacement: bool | None = None
  # Divides every sampled length (after elongation) so small test runs keep the distribution's
  # shape at a fraction of its size. 1 = the paper's lengths.
  length_scale: PositiveFloat = 32.0
  seed: Seed = 0
  # For `source: corpus`: token file and document-offsets file built by `launch/build_corpus.py`.
  corpus_tokens: str | None = None
  corpus_offsets: str | None = None
  # How a step's documents are laid out on the data ranks: `in_order` fills each rank's
  # tokens_per_device in order (a document that overflows continues on the next rank), the
  # layout CAD balances; `wlb`, the WLB-LLM-style baseline (`distca_jax/schedule/wlb.py`):
  # re-packed by attention + linear work into buffers of `wlb_token_cap` x tokens_per_device
  # tokens (the compiled buffers' length), a document longer than a rank's share split
  # head+tail over a context-parallel group of `wlb_cp` ranks (or `auto`: per step the size the
  # simulator's cost model prices fastest); colocated attention, no pipeline. The compiled step
  # computes every buffer row, padding too, so a tight cap is the strong baseline here: priced
  # on the simulator's Llama-3-8B batches (16-256 GPUs), 1.03125 is 2-6% slower than
  # variable-length WLB (which the simulator's rows price, at its cap 1.5), a cap of 1.5 26-30%.
  packing: Literal["in_order", "wlb"] = "in_order"
  wlb_token_cap: Annotated[float, Range(ge=1, why="a rank holds at least its share")] = 1.03125
  wlb_cp: PositiveInt | Literal["auto"] = "auto"
  # A weighted mixture of sources instead of `source` (each entry: name, weight, and a corpus or
  # a synthetic distribution). Every batch gives each source its weight's share of the tokens,
  # to the token, and draws its documents from (seed, batch), so a resume continues exactly.
  # The synthetic length settings above (long_threshold, length_scale, ...) apply to its
  # synthetic sources.
  mixture: tuple[MixtureSource, ...] = ()
  # Cut documents longer than this into pieces of at most this many tokens, each a document of
  # its own (positions restart): a training length, so no position goes past the model's
  # context. None: documents stay whole.
  max_doc_len: PositiveInt | None = None
  # A run resumed with another data layout (mesh.data, train.microbatches, tokens_per_device,
  # the sources or max_doc_len) is refused, since its batches would not continue the saved
  # run's; true continues with the new layout from the saved step.
  resume_new_layout: bool = False


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """How core attention runs: where the tokens are (`colocated`) or on attention servers."""

  # Fields removed or renamed, and what to set instead (a config that sets one is told so).
  RENAMED: ClassVar[dict[str, str]] = {
      "gate_nodes": "renamed attention.data_rank_nodes; to say how many devices a node holds, set "
                    "mesh.devices_per_node",
      "gate_exchange_fixed": "it is part of the gate's cost profile now: set attention.gate_profile to a file launch/fit_gate.py --write-profile writes",
      "gate_exchange_flops_per_byte": "it is part of the gate's cost profile now: set attention.gate_profile to a file launch/fit_gate.py --write-profile writes",
      "gate_network_byte_cost": "it is part of the gate's cost profile now: set attention.gate_profile to a file launch/fit_gate.py --write-profile writes",
  }

  impl: Literal["colocated", "distca"] = "colocated"
  kernel: Annotated[Literal["auto", "reference", "pallas", "triton", "mosaic"], Removed(
      cudnn="no measurement favoured it; use attention.kernel=auto (triton or mosaic on a GPU)")] = "auto"
  # CAD scheduler tolerance: servers within epsilon * mean load count as balanced.
  epsilon: Probability = 0.1
  # The step gate: the trainer plans the step, predicts the fraction of the colocated step CAD
  # saves with that plan net of the exchange's cost (`gate.predicted_cad_saving`; its fit and
  # accuracy: docs/PERFORMANCE.md), and runs colocated attention that step if the prediction is
  # below `min_gain` (a fraction of the step, may be negative). `gate: false` runs CAD on every
  # step. Pipelined runs (mesh.pipe > 1) gate their ticks with min_imbalance only.
  gate: bool = True
  min_gain: Annotated[float, Range(gt=-1, lt=1, why="a fraction of the step; attention.gate=false "
                                                   "turns the gate off")] = 0.0
  # The gate's fitted cost profile: a JSON file `python launch/fit_gate.py --write-profile PATH`
  # writes from measured step times (attention's time per FLOP relative to the matmuls', per
  # kernel; the exchange's fixed cost and its cost per byte the busiest device moves; a byte
  # between nodes in NVLink bytes), and the run loads. Unset: the shipped
  # distca_jax/gate_fit.json, a fit to one NVLink host's step times (docs/PERFORMANCE.md): refit
  # it for other GPUs or multi-node exchanges.
  gate_profile: str | None = None
  # Overrides the profile's attention cost (unset: the profile's for the kernel the run's
  # attention takes; the trainer records the one it took).
  gate_attention_cost: NonNegFloat | None = None
  # A second, cruder gate: a batch whose colocated attention load (max / mean over devices) is
  # below this runs colocated, and a nano-batch (with mesh.pipe > 1: a tick) below it moves
  # nothing. The ratio alone does not say what balancing buys (a batch may gain at a lower ratio
  # than another loses at; docs/PERFORMANCE.md). Unset: off (1.0) for unpipelined steps, which
  # the gate above decides; 1.25 for a pipeline's ticks, which have no other gate
  # (`min_imbalance_for`).
  min_imbalance: Annotated[float, Range(ge=1, why="a max / mean ratio; 1 turns the gate off")] | None = None
  # Ping-pong: two nano-batches of half the tokens each, so one's exchange overlaps the other's
  # compute. Equal halves cut at most one document per step in two; the second half's attention
  # reads the first half's K/V rows of its prefix, so the step computes exactly what one stream
  # would. A step whose split cuts a document longer than half the step runs whichever of one
  # or two streams the gate's model predicts saves more (unequal halves balance worse), unless
  # `pingpong_allow_single` is false: one stream holds twice the rows per exchange and kernel
  # call (several GiB more XLA temporaries at 8B-model sizes), which a run sized to two streams'
  # memory may not have. `false`: every step one stream (the single-stream ablation).
  pingpong: bool = True
  pingpong_allow_single: bool = True
  memory_mode: Literal["keep", "resend"] = "keep"
  # The node of each data rank: the gate prices bytes between nodes by it, the planner prefers
  # sources on a server's own node, and `exchange=auto` and relays follow it. Unset, the trainer
  # finds it (mesh.devices_per_node, else the processes' hosts) and records it in the run's
  # config.json; set it (a list of mesh.data node numbers) to plan as another topology would.
  data_rank_nodes: tuple[NonNegInt, ...] | None = None
  # The exchange's transport (`distca_jax/schedule/transport.py`). auto: `tiled` while the data
  # ranks fit one node (`data_rank_nodes`), `ragged` across nodes (on GPUs; the run's log says which
  # and why). `tiled`: an all_to_all of padded blocks (CPU and GPU), whose padding grows with the
  # pool; `ragged` (GPU only): only the rows that move travel, but XLA 0.11 waits on the host
  # before each call, which makes it slower than `tiled` on one node (docs/PERFORMANCE.md).
  exchange: Annotated[Literal["auto", "tiled", "ragged"], Removed(
      shifted="it carried 7-54x the moving rows; use attention.exchange=ragged")] = "auto"
  # Relayed K/V (`schedule/relay.py`): a layout shard that three or more other servers need is
  # cut into at most this many slices, each sent once by its holder to one of those servers,
  # which forwards it to the others in a second K/V exchange round, so no device sends one long
  # document's K/V prefix to most of the pool. 0: off, every piece sent by its holder. auto: 8
  # when the servers span more than one node (`data_rank_nodes`) and the exchange is not `tiled`
  # (whose second round pads every pair to its largest forward), off otherwise.
  kv_relay_fanout: NonNegInt | Literal["auto"] = "auto"

  def transport(self):
    """The exchange's `schedule.transport.Transport`: `exchange`, or for `auto` the one the data
    ranks' nodes (`data_rank_nodes`) call for (`transport.choose`; the trainer resolves `auto` once,
    with its platform, and records it)."""
    from distca_jax.schedule.transport import choose  # lazy: keeps config importable alone

    return choose(self.exchange, self.data_rank_nodes)[0]

  def min_imbalance_for(self, pipelined: bool) -> float:
    """`min_imbalance`, or its default for unpipelined steps (1.0) or a pipeline's ticks (1.25,
    `schedule.tick.default_min_imbalance`, which the simulator asks too)."""
    if self.min_imbalance is not None:
      return self.min_imbalance
    return default_min_imbalance(pipelined)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with linear warm-up and cosine decay, global-norm clipping."""

  # Bounded: near float32's maximum the schedule's float32 arithmetic overflows to NaN.
  lr: Annotated[float, Range(gt=0, le=1e30, why="an AdamW learning rate")] = 3e-3
  min_lr_ratio: Fraction = 0.1
  warmup_steps: NonNegStepCount = 5
  decay_steps: StepCount | None = None  # None: the run's length
  b1: Probability = 0.9
  b2: Probability = 0.95
  weight_decay: NonNegFloat = 0.1
  # Global-norm clipping threshold: 0 would zero every update, so it must be positive.
  clip_norm: PositiveFloat = 1.0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The run: its length, logging, outputs, simulated CPU devices, time limits and profiling."""

  steps: StepCount = 30
  seed: Seed = 0
  # Micro-batches per step per data rank, each one buffer of data.tokens_per_device tokens.
  # With mesh.pipe > 1 they flow through the pipeline (distca_jax/train/pipeline.py); otherwise
  # they run one after another, each planned (and gated) as a step, their gradients summed, with
  # one optimizer update per step (gradient accumulation: a step of K x data x tokens_per_device).
  microbatches: PositiveInt = 1
  log_every: PositiveInt = 1
  # The run's directory (config.json, summary.json, tb/, checkpoints/). None: a new one per run,
  # runs/<config file's name, or default>-<YYYYmmdd-HHMMSS>, linked as runs/latest. Set it to an
  # earlier run's directory to resume that run (train/rundir.py).
  out_dir: OutputDir | None = None
  tensorboard: bool = True
  progress: bool = True
  # Simulated host devices when no accelerator is present (0: leave XLA's default).
  cpu_devices: NonNegInt = 8
  # Peak dense bf16 TFLOP/s per device for MFU; None: known GPUs by name, else MFU is not shown.
  peak_tflops: PositiveFloat | None = None
  # Stop after this many seconds even if train.steps is not reached (None: no limit).
  max_seconds: NonNegFloat | None = None
  # Stop once this many steps are done in total (a planned interruption; the learning-rate
  # schedule still spans train.steps, so a resumed run continues exactly). None: no stop.
  stop_at_step: StepCount | None = None
  # Seconds to wait for the jax.distributed coordinator and the other processes at start-up.
  init_timeout_s: PositiveInt = 300
  # Seconds without a heartbeat after which jax.distributed declares a process dead and ends the
  # others (JAX's default is 100: survivors of a crashed peer would idle that long).
  heartbeat_timeout_s: PositiveInt = 20
  # Profiling (distca_jax/train/profile.py): an xprof trace of `profile_steps` steps starting
  # at step `profile_start` (1-based, after warm-up) into <out_dir>/trace, a per-phase breakdown
  # and per-device attention load in <out_dir>/profile.json and attention_load.png.
  profile: bool = False
  profile_start: StepCount = 3
  profile_steps: StepCount = 2
  # Steady-state steps (after compilation) left out of the profile's step-time statistics.
  profile_warmup: NonNegInt = 1
  # Plan each colocated step with the CAD scheduler on the host (prefetch thread) to report the
  # attention imbalance it would reach ("after"); distca steps report their own plan's.
  imbalance_after: bool = True
  # Before the first step, the host plans this many of the run's steps ahead (their batches,
  # CAD's plans and gate, colocated attention's windows) and sizes the step's capacities to the
  # largest they need, so the step compiles once per kind of context instead of once more each
  # time a step needs a larger capacity (later steps can still grow them). 0: grow step by step.
  shape_steps: NonNegInt = 32
  # JAX persistent compilation cache directory (None: off). A resumed run loads its compiled
  # step from here instead of compiling again.
  compile_cache_dir: OutputDir | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints, every `every` steps and where the run ends. `every=0` turns them off."""

  every: NonNegStepCount = 500
  keep: PositiveInt = 3
  dir: OutputDir | None = None  # None: <train.out_dir>/checkpoints
  # Resume from the directory's newest good checkpoint (unreadable or non-finite ones skipped).
  resume: bool = True
  # Resume from this step's checkpoint instead (an error if it has none).
  step: StepCount | None = None
  # Check a restored checkpoint against the checksums saved with it (a mismatch is skipped like
  # an unreadable step); false trusts the storage.
  verify: bool = True


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out evaluation (`train/evaluate.py`): loss, perplexity and loss by token position on
  the same `batches` batches every time, through the training step's mesh and attention (CAD's
  batches planned as a training step's), every `every` steps and where the run ends."""

  # Evaluate every this many steps, and where the run ends (0: only where it ends).
  every: NonNegStepCount = 0
  # Held-out batches, each one global batch of the training step's shape (0: no evaluation;
  # not yet with mesh.pipe > 1 or data.packing=wlb).
  batches: NonNegInt = 0
  # Where they come from: `data`, the training source (data.source, its distribution or corpus)
  # drawn with `seed`; `synthetic`, documents of `distribution`; `corpus`, the corpus
  # `corpus_tokens` / `corpus_offsets` (built by launch/build_corpus.py from documents kept out
  # of training: the training corpus drawn with another seed repeats its documents).
  source: Literal["data", "synthetic", "corpus"] = "data"
  distribution: str | None = None  # None: data.distribution
  corpus_tokens: str | None = None
  corpus_offsets: str | None = None
  # The held-out batches' seed (None: data.seed + 1, never the training batches' seed).
  seed: Seed | None = None
  # Position buckets: the first position of each bucket after the first (the loss of a token
  # predicted at in-document position p falls in the last bucket starting at or before p).
  # None: 4K, 16K, 64K, 128K scaled down to the run's context (data ranks x tokens_per_device)
  # where that is shorter than 128K (`evaluate.default_buckets`).
  buckets: tuple[PositiveInt, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Config:
  """The trainer's configuration: one section per part of the run."""

  model: ModelConfig = ModelConfig()
  mesh: MeshConfig = MeshConfig()
  data: DataConfig = DataConfig()
  attention: AttentionConfig = AttentionConfig()
  optim: OptimConfig = OptimConfig()
  train: TrainConfig = TrainConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  eval: EvalConfig = EvalConfig()


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
  """Defaults, then the YAML file at `path`, then each `key=value` override; every field's range,
  then `validate`. Needs no devices and does not start JAX."""
  config = load(Config(), path, overrides)
  validate(config)
  return config


def to_dict(config: Config) -> dict[str, Any]:
  """The config as nested dicts and lists (the run's config.json)."""
  return _to_dict(config)
