"""The run's step gate, from its config: whether CAD is worth running on a step.

Numpy only (no JAX): the trainer's host thread, the launchers and the tests all price steps with
it. The cost model itself takes numbers and lives beside the planner
(`distca_jax/schedule/gate_cost.py`); this module reads a config into them: the fitted cost
profile (`costs`: the file `attention.gate_profile` names, `gate_profile.read_profile`, by default the shipped
`gate_fit.json`; its attention cost the one measured for the run's kernel), the model's FLOPs, the
exchange's bytes as its transport carries them (`exchange_bytes`), and the decisions
(`worth_planning`, `gate_refuses`: below `attention.min_gain` a step runs colocated,
`dispatch.host.plan_step`); and it says them in the run's log. Fitting the profile to measured
steps, and reading training logs for it, is `gate_fitting.py`'s.
"""

from __future__ import annotations

import functools
import json

import numpy as np

from distca_jax.config import AttentionConfig
from distca_jax.data.packing import Layout
from distca_jax.gate_profile import FIT_DATA, PROFILE_COSTS as _PROFILE_COSTS, read_profile
from distca_jax.models.presets import ModelShape
from distca_jax.schedule import gate_cost
from distca_jax.schedule.capacities import Capacities
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.gate_cost import GateCosts, ModelFlops, attention_load_per_device, imbalance
from distca_jax.schedule.tick import TickCosts
from distca_jax.schedule.transport import relay_for


@functools.cache
def fit_data() -> dict:
  """`gate_fit.json`: the fit's setup, its measured batches, and the shipped attention costs."""
  return json.loads(FIT_DATA.read_text())


# The kernel the shipped step-time fit ran, and the shipped attention cost per kernel (the fit's,
# and the fit's scaled by each kernel's attention time per FLOP in training steps).
GATE_FIT_KERNEL: str = fit_data()["fit_kernel"]
GATE_ATTENTION_COST: dict[str, float] = dict(fit_data()["attention_cost"])
KERNEL_COST_RATIO: dict[str, float] = dict(fit_data()["kernel_cost_ratio"])
FIT_DEVICES: int = fit_data()["setup"]["devices"]
FIT_SETUP: tuple[str, ...] = tuple(fit_data()["setup"]["overrides"])
# CAD's machinery on one GPU of the code the measured batches ran, held in their fit; a run
# charges the profile's `machinery`, the current code's.
FIT_MACHINERY: float = fit_data()["setup"]["machinery"]


def measured_batches() -> dict[tuple[str, int], tuple[float, float]]:
  """(distribution, sampler step) -> (colocated ms, distca ms with CAD running) of the fit's
  setup (`FIT_DEVICES` devices, `FIT_SETUP`)."""
  return {(m["distribution"], m["step"]): (m["colocated_ms"], m["distca_ms"])
          for m in fit_data()["measured"]}


# ----------------------------------------------------------------------------- the cost model


def gate_attention_cost(attention_config, kernel: str | None = None) -> float:
  """The gate's attention cost: `attention_config.gate_attention_cost` if set, else its cost
  profile's for `kernel` (a resolved backend, not `auto`), else the profile's fit kernel's."""
  if attention_config.gate_attention_cost is not None:
    return attention_config.gate_attention_cost
  profile = read_profile(attention_config.gate_profile)
  costs = profile["attention_cost"]
  return costs.get(kernel, costs[profile["fit_kernel"]])


def describe_gate_cost(attention_config, kernel: str) -> str:
  """Where the gate's attention cost for `kernel` comes from, for the run's log: the config, the
  kernel's measurement, or (a kernel not measured in steps) the fit's kernel's."""
  cost = gate_attention_cost(attention_config, kernel)
  if attention_config.gate_attention_cost is not None:
    return f"{cost:.3g} (attention.gate_attention_cost)"
  profile = read_profile(attention_config.gate_profile)
  source = f" from {attention_config.gate_profile}" if attention_config.gate_profile else ""
  if kernel in profile["attention_cost"]:
    return f"{cost:.3g} ({kernel} kernel, measured{source})"
  return (f"{cost:.3g} ({profile['fit_kernel']}'s{source}: the {kernel} kernel is not measured in "
          "training steps)")


def describe_nodes(attention_config) -> str:
  """The data ranks' nodes for the run's log, when there are several: "; 2 nodes (8, 8 data
  ranks), a byte between them 4 NVLink bytes"; "" on one node."""
  nodes = attention_config.data_rank_nodes or ()
  counts = np.bincount(nodes) if len(nodes) else np.zeros(0, int)
  counts = counts[counts > 0]
  if counts.size < 2:
    return ""
  fanout = attention_config.kv_relay_fanout
  relay = relay_for(fanout, attention_config.transport(), nodes)
  return (f"; {counts.size} nodes ({', '.join(map(str, counts))} data ranks), a byte between "
          f"them {costs(attention_config).network_byte_cost:g} NVLink bytes; K/V relay "
          + (f"fanout {relay.fanout}" if relay else "off")
          + (" (kv_relay_fanout=auto)" if fanout == "auto" else ""))


def costs(attention_config=None) -> GateCosts:
  """The cost profile `attention_config` (default: `AttentionConfig()`) loads
  (`attention.gate_profile`), its attention cost resolved (unset: the profile's fit kernel's;
  the trainer sets the run's kernel's)."""
  a = AttentionConfig() if attention_config is None else attention_config
  profile = read_profile(a.gate_profile)
  return GateCosts(attention_cost=gate_attention_cost(a),
                   **{k: float(profile[k]) for k in _PROFILE_COSTS})


def model_flops(shape: ModelShape) -> ModelFlops:
  """The model's FLOPs as the cost model weighs them: matmuls per token, and core attention per
  query-key pair (forward and backward: 3.5 x the forward's 4 x head_dim per pair and head)."""
  return ModelFlops(matmul_per_token=shape.matmul_flops_per_token(),
                    attention_per_area=3.5 * 4.0 * shape.head_dim * shape.heads * shape.layers,
                    layers=shape.layers)


def tick_costs(shape: ModelShape, attention_config) -> TickCosts:
  """What a pipelined tick's plan weighs (`schedule.tick.plan_tick`), per layer in matmul FLOPs
  from the config's cost profile. The profile prices a byte a device sends plus receives; a
  full-duplex link's time is the busier direction, about half of that sum when the two are
  equal, so a byte of the busier direction costs twice. The mesh orders devices (data, pipe,
  tensor), so a node holds whole data ranks with all their stages, and a tick's bytes cross nodes
  once the data ranks span more than one (`attention.data_rank_nodes`): the network's cost then."""
  m, c = model_flops(shape), costs(attention_config)
  across = len(set(attention_config.data_rank_nodes or ())) > 1
  return TickCosts(linear_per_token=3.0 * m.matmul_per_token / m.layers,
                   attention_per_area=c.attention_cost * m.attention_per_area / m.layers,
                   per_byte=2.0 * c.exchange_flops_per_byte * (c.network_byte_cost if across else 1.0))


def colocated_flops(shape: ModelShape, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
  """Per device, the colocated step's matmul and core attention FLOPs (`gate_cost.colocated_flops`)."""
  return gate_cost.colocated_flops(model_flops(shape), layout)


def predicted_cad_gain(shape: ModelShape, layout: Layout, exchange: bool = False,
                       attention_config=None) -> float:
  """`gate_cost.predicted_cad_gain` at the config's cost profile (default: `AttentionConfig()`'s)."""
  return gate_cost.predicted_cad_gain(model_flops(shape), layout, costs(attention_config), exchange)


def predicted_cad_saving(shape: ModelShape, layout: Layout, plans, attention_config=None,
                         exchange_bytes: np.ndarray | None = None) -> float:
  """`gate_cost.predicted_cad_saving` at the config's cost profile; `exchange_bytes` as
  `exchange_bytes` gives them (default: the rows the plans move)."""
  return gate_cost.predicted_cad_saving(model_flops(shape), layout, plans, costs(attention_config),
                                        exchange_bytes)


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


def comm_model(shape: ModelShape, attention_config) -> CommModel:
  """The scheduler's byte model of the exchange for `shape` (`resend`: the backward sends Q, K, V
  again)."""
  return CommModel.for_model(shape, resend=attention_config.memory_mode == "resend")


def exchange_bytes(attention_config, shape: ModelShape, plans, capacities: Capacities) -> np.ndarray:
  """Per device, the bytes one layer's exchange sends plus receives over the step's plans, in
  NVLink bytes: as the config's transport carries them at the step's capacities
  (`Transport.carried_bytes`), the busier of a device's links within and across nodes counting
  (`attention.data_rank_nodes`, bytes across at the profile's `network_byte_cost`:
  `gate_cost.busier_link`)."""
  moved = sum(p.traffic.send + p.traffic.recv for p in plans)
  carried = attention_config.transport().carried_bytes(capacities, moved,
                                                       comm_model(shape, attention_config), len(plans))
  return gate_cost.busier_link(carried, attention_config.data_rank_nodes,
                               costs(attention_config).network_byte_cost)
