"""The step gate: whether CAD is worth running on a step, its cost model, and the model's fit.

Numpy only (no JAX): the trainer's host thread, the launchers and the tests all price steps with
it. The cost model, in matmul-FLOP units (`attention.gate_*` in the config):

  colocated step = matmul FLOPs + gate_attention_cost x attention FLOPs   (the slowest device)
  CAD's saving   = attention time colocated - the slowest server's after planning
                   - gate_exchange_fixed x matmul FLOPs - gate_exchange_flops_per_byte x bytes

where the bytes are the busiest device's over one step's exchanges (`exchange_bytes`: the tiled
exchange's padded blocks at the step's capacities, or the ragged one's moved rows; bytes between nodes priced higher). `predicted_cad_saving` is that as a
fraction of the colocated step; the trainer runs colocated attention on a step predicted to save
less than `attention.min_gain` (`dispatch.host.plan_step`).

The fit. `fit_step_costs` fits the three costs to measured step times (least squares; the
measurements ship as data, `gate_fit.json`, `measured_batches`); `fit_kernel_cost` fits one
kernel's attention time per FLOP from training-step logs; `launch/fit_gate.py` is the command
that plans the measured batches and prints both. The attention cost unset is the one measured
for the kernel the run takes (`GATE_ATTENTION_COST`, from `gate_fit.json`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path

import numpy as np

from distca_jax.config import AttentionConfig
from distca_jax.data.packing import Layout
from distca_jax.models.presets import ModelShape
from distca_jax.schedule.capacities import Capacities
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.relay import relay_for

FIT_DATA = Path(__file__).with_name("gate_fit.json")


@functools.cache
def fit_data() -> dict:
  """`gate_fit.json`: the fit's setup, its measured batches, and the shipped attention costs."""
  return json.loads(FIT_DATA.read_text())


# The kernel the step-time fit ran, and the shipped attention cost per kernel (the fit's, and
# the fit's scaled by each kernel's attention time per FLOP in training steps).
GATE_FIT_KERNEL: str = fit_data()["fit_kernel"]
GATE_ATTENTION_COST: dict[str, float] = dict(fit_data()["attention_cost"])
KERNEL_COST_RATIO: dict[str, float] = dict(fit_data()["kernel_cost_ratio"])
FIT_DEVICES: int = fit_data()["setup"]["devices"]
FIT_SETUP: tuple[str, ...] = tuple(fit_data()["setup"]["overrides"])


def measured_batches() -> dict[tuple[str, int], tuple[float, float]]:
  """(distribution, sampler step) -> (colocated ms, distca ms with CAD running) of the fit's
  setup (`FIT_DEVICES` devices, `FIT_SETUP`)."""
  return {(m["distribution"], m["step"]): (m["colocated_ms"], m["distca_ms"])
          for m in fit_data()["measured"]}


# ----------------------------------------------------------------------------- attention load


def shard_attention_area(layout: Layout) -> np.ndarray:
  """Causal query-key pairs of each shard (queries = the shard, keys = its document prefix)."""
  q = layout.length.astype(np.float64)
  kv = (layout.doc_offset + layout.length).astype(np.float64)
  return q * kv - q * (q - 1) / 2


def attention_load_per_device(layout: Layout) -> np.ndarray:
  """Causal attention area (query-key pairs) each buffer computes when attention is colocated."""
  return np.bincount(layout.buffer, weights=shard_attention_area(layout), minlength=layout.num_buffers)


def imbalance(load: np.ndarray) -> float:
  """max / mean; 1.0 is perfect balance."""
  mean = float(np.mean(load))
  return float(np.max(load)) / mean if mean > 0 else 1.0


# ----------------------------------------------------------------------------- the cost model


def gate_attention_cost(attention_config, kernel: str | None = None) -> float:
  """The gate's attention cost: `attention_config.gate_attention_cost` if set, else the one
  measured for `kernel` (a resolved backend, not `auto`), else the fit's kernel's."""
  if attention_config.gate_attention_cost is not None:
    return attention_config.gate_attention_cost
  return GATE_ATTENTION_COST.get(kernel, GATE_ATTENTION_COST[GATE_FIT_KERNEL])


def describe_gate_cost(attention_config, kernel: str) -> str:
  """Where the gate's attention cost for `kernel` comes from, for the run's log: the config, the
  kernel's measurement, or (a kernel not measured in steps) the fit's kernel's."""
  cost = gate_attention_cost(attention_config, kernel)
  if attention_config.gate_attention_cost is not None:
    return f"{cost:.3g} (attention.gate_attention_cost)"
  if kernel in GATE_ATTENTION_COST:
    return f"{cost:.3g} ({kernel} kernel, measured)"
  return f"{cost:.3g} ({GATE_FIT_KERNEL}'s: the {kernel} kernel is not measured in training steps)"


def describe_gate_nodes(attention_config) -> str:
  """The data ranks' nodes for the run's log, when there are several: "; 2 nodes (8, 8 data
  ranks), a byte between them 4 NVLink bytes"; "" on one node."""
  nodes = attention_config.gate_nodes or ()
  counts = np.bincount(nodes) if len(nodes) else np.zeros(0, int)
  counts = counts[counts > 0]
  if counts.size < 2:
    return ""
  fanout = attention_config.kv_relay_fanout
  relay = relay_for(fanout, attention_config.exchange, nodes)
  return (f"; {counts.size} nodes ({', '.join(map(str, counts))} data ranks), a byte between "
          f"them {attention_config.gate_network_byte_cost:g} NVLink bytes; K/V relay "
          + (f"fanout {relay.fanout}" if relay else "off")
          + (" (kv_relay_fanout=auto)" if fanout == "auto" else ""))


# Beyond one node's data ranks the tiled exchange's padding outgrows what balancing gains.
TILED_DATA_RANKS = 8


def describe_exchange(attention_config, data_ranks: int) -> str:
  """A line for the run's log when the exchange's transport will keep most steps colocated: the
  tiled all_to_all on more than one node's data ranks ("" otherwise)."""
  if attention_config.exchange != "tiled" or data_ranks <= TILED_DATA_RANKS:
    return ""
  return (f"attention.exchange=tiled on {data_ranks} data ranks: every (device, server) pair is "
          "padded to the largest one's rows, bytes that grow with the data ranks, and the gate "
          "keeps a step colocated where they cost more than balancing gains; "
          "attention.exchange=ragged (GPU) sends only the rows that move (docs/PERFORMANCE.md, \"Dispatch at scale\")")


def _costs(attention_config):
  """`attention_config` (default: `AttentionConfig()`) with its attention cost resolved."""
  if attention_config is None:
    attention_config = AttentionConfig()
  if attention_config.gate_attention_cost is None:  # callers that resolve no kernel: the fit's
    cost = gate_attention_cost(attention_config)
    attention_config = dataclasses.replace(attention_config, gate_attention_cost=cost)
  return attention_config


def attention_flops_per_area(shape: ModelShape) -> float:
  """Training FLOPs of core attention per query-key pair, all layers and heads (forward and
  backward: 3.5 x the forward's 4 x head_dim per pair and head)."""
  return 3.5 * 4.0 * shape.head_dim * shape.heads * shape.layers


def colocated_flops(shape: ModelShape, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
  """Per device, the colocated step's matmul FLOPs (3 x forward, every real token) and core
  attention FLOPs: the two terms the gate's cost model weighs."""
  tokens = np.bincount(layout.buffer, weights=layout.length, minlength=layout.num_buffers)
  return (3.0 * shape.matmul_flops_per_token() * tokens,
          attention_flops_per_area(shape) * attention_load_per_device(layout))


def _colocated_step(shape: ModelShape, layout: Layout, costs) -> tuple[np.ndarray, np.ndarray, float]:
  """Per device, in matmul FLOPs: the colocated step's matmul time and attention time; and the
  attention time per unit of causal area."""
  linear, attn = colocated_flops(shape, layout)
  return (linear, costs.gate_attention_cost * attn,
          costs.gate_attention_cost * attention_flops_per_area(shape))


def predicted_cad_gain(shape: ModelShape, layout: Layout, exchange: bool = False,
                       attention_config=None) -> float:
  """The most balancing core attention can save, as a fraction of the colocated step: (max −
  mean of the devices' attention time) / (the slowest device's step time), times from FLOPs
  (the gate's cost model, `attention_config.gate_*`, default: `AttentionConfig()`'s); balancing
  at best brings every device to the mean. `exchange`: less the exchange's fixed cost, an upper
  bound on `predicted_cad_saving` (up to the few query-key pairs a ping-pong cut drops: the
  suffix of the one document split between the halves does not attend to its prefix)."""
  costs = _costs(attention_config)
  linear, attn, _ = _colocated_step(shape, layout, costs)
  step = (linear + attn).max()
  if step <= 0:
    return 0.0
  fixed = costs.gate_exchange_fixed * linear.max() if exchange else 0.0
  return float((attn.max() - attn.mean() - fixed) / step)


def predicted_cad_saving(shape: ModelShape, layout: Layout, plans, attention_config=None,
                         exchange_bytes: np.ndarray | None = None) -> float:
  """Fraction of the colocated step CAD is predicted to save with these plans (the step's
  nano-batches, balanced), net of the exchange: (the slowest device's attention time colocated −
  the slowest server's after planning − the exchange's cost) / the colocated step. Times from
  FLOPs (the gate's cost model, `attention_config.gate_*`); the same on every process (global
  plans only). `exchange_bytes`: per device, the bytes one layer's exchange sends plus receives
  over the step (`exchange_bytes`: the tiled exchange's padded blocks); default: the rows the
  plans move. Every term is the whole model's (all heads' bytes, all matmuls): with
  mesh.tensor > 1 each device does 1/tensor of each, so the fraction is the same."""
  costs = _costs(attention_config)
  linear, attn, per_area = _colocated_step(shape, layout, costs)
  step = (linear + attn).max()
  if step <= 0:
    return 0.0
  planned = per_area * sum(p.stats.load_after for p in plans)
  if exchange_bytes is None:
    exchange_bytes = sum(p.traffic.send + p.traffic.recv for p in plans)
  moved = np.max(exchange_bytes) * shape.layers
  net = (attn.max() - planned.max() - costs.gate_exchange_fixed * linear.max()
         - costs.gate_exchange_flops_per_byte * moved)
  return float(net / step)


def worth_planning(attention_config, shape: ModelShape, layout: Layout) -> bool:
  """Whether a batch may gain from CAD at all, before it is planned: its colocated attention
  imbalance reaches `attention.min_imbalance`, and (with the gate on) even perfect balance, less
  the exchange's fixed part, could save `attention.min_gain` (`predicted_cad_gain`)."""
  min_imbalance = attention_config.min_imbalance_for(pipelined=False)
  if imbalance(attention_load_per_device(layout)) < min_imbalance:
    return False
  return not (attention_config.gate and predicted_cad_gain(
      shape, layout, exchange=True, attention_config=attention_config) < attention_config.min_gain)


def gate_refuses(attention_config, predicted_saving: float) -> bool:
  """Whether the gate (`attention.gate`) runs colocated attention on a step predicted to save
  `predicted_saving` of the colocated step: below `attention.min_gain`."""
  return bool(attention_config.gate) and predicted_saving < attention_config.min_gain


# ----------------------------------------------------------------------------- the exchange's bytes


def comm_model(shape: ModelShape, attention_config) -> CommModel:
  """The scheduler's byte model of the exchange for `shape` (`resend`: the backward sends Q, K, V
  again)."""
  return CommModel.for_model(shape, resend=attention_config.memory_mode == "resend")


def exchange_bytes(attention_config, shape: ModelShape, plans, capacities: Capacities) -> np.ndarray:
  """Per device, the bytes one layer's exchange sends plus receives over the step's plans, in
  NVLink bytes. Tiled (`attention.exchange`): every off-diagonal (device, server) block travels
  whole, padded to the largest pair's (`c` query rows, `ckv` K/V rows, `ckv2` relayed K/V rows),
  whatever the plan moves; ragged: the rows that move (the plans' traffic, relays included,
  spread evenly over the device's peers). With data ranks on
  several nodes (`attention.gate_nodes`) a device's bytes within its node and across nodes move
  at once over different links: the busier link counts, bytes across nodes at
  `attention.gate_network_byte_cost` NVLink bytes each (as the simulator's exchange model)."""
  n = plans[0].stats.load_after.size
  same = same_node(attention_config, n)
  if attention_config.exchange == "ragged":
    moved = sum(p.traffic.send + p.traffic.recv for p in plans)
    if same.all():
      return moved
    off = (~same).sum(axis=1) / (n - 1)  # the share of the device's peers on other nodes
    return np.maximum(moved * (1 - off), attention_config.gate_network_byte_cost * moved * off)
  comm = comm_model(shape, attention_config)
  pair = np.zeros((n, n))  # one layer's bytes per plan, [sender, receiver]
  pair[:] = (capacities.c * comm.q_row_bytes
             + (capacities.ckv + (capacities.ckv2 or 0)) * comm.kv_row_bytes)
  np.fill_diagonal(pair, 0.0)
  pair *= len(plans)
  within = np.where(same, pair, 0.0)
  across = pair - within
  return np.maximum(within.sum(1) + within.sum(0),
                    attention_config.gate_network_byte_cost * (across.sum(1) + across.sum(0)))


def same_node(attention_config, n: int) -> np.ndarray:
  """[n, n] bool: whether data ranks i and j share a node (`attention.gate_nodes`; unset: one
  node)."""
  nodes = attention_config.gate_nodes
  if nodes is None:
    return np.ones((n, n), bool)
  if len(nodes) != n:
    raise ValueError(f"attention.gate_nodes: {len(nodes)} node numbers for {n} data ranks")
  nodes = np.asarray(nodes)
  return nodes[:, None] == nodes[None, :]


# ----------------------------------------------------------------------------- the fit


@dataclasses.dataclass(frozen=True)
class FitBatch:
  """One measured batch, as the fit reads it: the two measured step times (ms) and, for the
  slowest device, its matmul FLOPs (3 x forward), its attention FLOPs colocated, the slowest
  server's attention FLOPs after planning, and the busiest device's exchange bytes over the
  step's layers."""

  colocated_ms: float
  distca_ms: float
  linear_flops: float
  attention_flops: float
  planned_flops: float
  exchange_bytes: float


@dataclasses.dataclass(frozen=True)
class StepCostFit:
  """`fit_step_costs`'s result: ms per matmul FLOP and per (effective) attention FLOP, the
  exchange's overhead (a fraction of the matmul time, and ms per byte), and per batch the
  fitted colocated step, the measured saving and the net saving predicted by a fit of the
  other batches (leave-one-out), all in ms."""

  ms_per_linear_flop: float
  ms_per_attention_flop: float
  exchange_fixed: float
  exchange_ms_per_byte: float
  max_residual_ms: float
  fitted_colocated_ms: np.ndarray
  measured_saving_ms: np.ndarray
  leave_one_out_saving_ms: np.ndarray

  @property
  def costs(self) -> dict[str, float]:
    """The three `attention.gate_*` costs, in matmul-FLOP units."""
    c_lin = self.ms_per_linear_flop
    return dict(gate_attention_cost=self.ms_per_attention_flop / c_lin,
                gate_exchange_fixed=self.exchange_fixed,
                gate_exchange_flops_per_byte=self.exchange_ms_per_byte / c_lin)


def fit_step_costs(batches: list[FitBatch]) -> StepCostFit:
  """The gate's cost model fit to measured batches (least squares, in FLOP units, so batches of
  different model shapes and token counts fit together on one machine kind): colocated ms =
  L x c_lin + A x c_att, L the slowest device's matmul FLOPs and A its attention FLOPs; then the
  exchange's overhead, what balancing would ideally save (c_att x (A - planned)) less what was
  measured, = fixed x the matmul ms + b x bytes."""
  col = np.array([b.colocated_ms for b in batches])
  c_lin, c_att = np.linalg.lstsq(np.array([[b.linear_flops, b.attention_flops] for b in batches]),
                                 col, rcond=None)[0]
  ideal = np.array([c_att * (b.attention_flops - b.planned_flops) for b in batches])
  saved = np.array([b.colocated_ms - b.distca_ms for b in batches])
  lin_ms = np.array([c_lin * b.linear_flops for b in batches])
  X = np.stack([lin_ms, [b.exchange_bytes for b in batches]], axis=1)
  overhead = ideal - saved
  fixed, per_byte = np.linalg.lstsq(X, overhead, rcond=None)[0]
  resid = overhead - X @ np.array([fixed, per_byte])
  loo = np.empty(len(batches))
  for i in range(len(batches)):
    keep = np.arange(len(batches)) != i
    fi, bi = np.linalg.lstsq(X[keep], overhead[keep], rcond=None)[0]
    loo[i] = ideal[i] - fi * lin_ms[i] - bi * batches[i].exchange_bytes
  return StepCostFit(
      ms_per_linear_flop=float(c_lin), ms_per_attention_flop=float(c_att),
      exchange_fixed=float(fixed), exchange_ms_per_byte=float(per_byte),
      max_residual_ms=float(np.abs(resid).max()),
      fitted_colocated_ms=lin_ms + c_att * np.array([b.attention_flops for b in batches]),
      measured_saving_ms=saved, leave_one_out_saving_ms=loo)


def fit_kernel_cost(flops_Sx2: np.ndarray, ms_S: np.ndarray) -> tuple[float, float, float]:
  """One kernel's training steps fit as ms = c_lin x matmul FLOPs + c_att x attention FLOPs
  (least squares over S steps, `flops_Sx2` their slowest device's two terms): (c_lin, c_att,
  RMS error in ms). Raises ValueError when the time does not grow with attention FLOPs."""
  coef, *_ = np.linalg.lstsq(flops_Sx2, ms_S, rcond=None)
  if coef[1] <= 0:
    raise ValueError(f"the step time does not grow with attention FLOPs ({coef[1]:.3g} ms per "
                     "FLOP): too few or too alike batches to fit")
  return float(coef[0]), float(coef[1]), float(np.sqrt(np.mean((flops_Sx2 @ coef - ms_S) ** 2)))


# ----------------------------------------------------------------------------- training logs

_LOG_LINE = re.compile(r"^step (\d+): (.*)$")


def read_step_log(path) -> dict[int, dict[str, float]]:
  """A `launch/train.py` log's steps (`step N: key=value ...`, written with
  `train.progress=false`): step -> its logged values; `compiled`: whether the step's compile
  count went up (its time is mostly compilation)."""
  steps, last = {}, 0.0
  for line in open(path):
    m = _LOG_LINE.match(line.strip())
    if not m:
      continue
    values = {k: float(v) for k, v in (kv.split("=", 1) for kv in m.group(2).split())}
    values["compiled"] = float(values.get("compile_count", 0) > last)
    last = values.get("compile_count", last)
    steps[int(m.group(1))] = values
  return steps
