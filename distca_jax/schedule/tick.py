"""A pipelined tick's plan: how much of the active stages' attention the idle stages take.

In a warm-up or drain tick of the lock-step 1F1B only some stages hold a micro-batch; the
others are idle and can serve attention (docs/METHOD.md, "4D parallelism"). Spreading the active
stages' attention evenly over every rank balances best, but it moves the most bytes of the step,
and they have little compute to hide under: an idle rank has no linear work of its own, and an
active rank sends what it gives away beside only its linear work and the attention it keeps.
`plan_tick` plans such a tick over every rank first; where the cost model predicts that the
exchange lengthens the tick, it also plans it over the active ranks and only some of the idle
ones (`HELPERS_PER_ACTIVE`, `planner.balance(servers=...)`), and keeps the plans whose predicted
tick is shortest. The trainer's tick planning (`dispatch.plan_ticks`) and the simulator's 4D model
(`sim/pipeline.py`) both plan ticks here, so they run and price the same plans.

A tick is planned as one node: the trainer's node map is per data rank, not per (stage, data
rank) row. At the simulator's TP 8 on 8-GPU nodes every rank is its own node, which plans the
same moves as one node (`planner._node_ids`).

Numpy only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distca_jax.data.packing import Layout
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.plan import Plan, make_plan
from distca_jax.schedule.relay import Relay

# An unpipelined step plans every batch whose colocated attention imbalance reaches 1.0 (the step
# gate then weighs the plan against its exchange); a pipelined tick has no gate, so it keeps
# balanced-enough ticks colocated by this threshold instead.
TICK_MIN_IMBALANCE = 1.25

# How many idle ranks may take attention, as multiples of the active ranks (capped at the idle
# ranks there are): helpers h of a active ranks take h / (a + h) of the tick's attention. Fewer
# helpers take larger pieces, so a long document is cut, and its K/V prefix sent, fewer times;
# giving every idle rank a fraction of an active rank's load instead moved more bytes than the
# even spread on the 34B warm-up tick it was tried on (smaller deficits, smaller pieces).
HELPERS_PER_ACTIVE = (2.0, 1.0, 0.5, 0.25, 0.0)


def default_min_imbalance(pipelined: bool) -> float:
  """The colocated attention imbalance below which a plan moves nothing, when the run sets none
  (the trainer's `attention.min_imbalance`, the simulator's `min_imbalance`)."""
  return TICK_MIN_IMBALANCE if pipelined else 1.0


@dataclasses.dataclass(frozen=True)
class TickCosts:
  """Per layer, in any one unit (ms, or matmul FLOPs): a token's linear work (forward and
  backward), a query-key pair's core attention (forward and backward), and a byte of the busier
  direction of a rank's exchange (the plan's `CommModel` bytes)."""

  linear_per_token: float
  attention_per_area: float
  per_byte: float


def _tokens(layout: Layout) -> np.ndarray:
  """Each buffer's real tokens (an idle stage's rows: 0)."""
  return np.bincount(layout.buffer, weights=layout.length, minlength=layout.num_buffers)


def tick_time(plans, layouts, costs: TickCosts) -> float:
  """The predicted time of one layer of a tick whose streams (Ping and Pong, or one) run
  `plans` on `layouts`: the slowest rank's compute (its own tokens' linear work and the
  attention it serves) plus its exchange (the busier of what it sends and receives) where the
  exchange does not hide. With two streams each one's exchange hides under the other's compute,
  as the ping-pong step runs them; one stream's is exposed whole (the tick's core attention
  waits for its dispatch)."""
  compute, exchange = [], []
  for plan, lay in zip(plans, layouts):
    compute.append(costs.linear_per_token * _tokens(lay) + costs.attention_per_area * plan.stats.load_after)
    exchange.append(costs.per_byte * np.maximum(plan.traffic.send, plan.traffic.recv))
  if len(plans) == 2:
    exposed = sum(np.maximum(0.0, exchange[i] - compute[1 - i]) for i in (0, 1))
  else:
    exposed = sum(exchange)
  return float((sum(compute) + exposed).max())


def plan_tick(layouts, comm: CommModel, costs: TickCosts, *, epsilon: float,
              min_imbalance: float = TICK_MIN_IMBALANCE,
              relay: Relay | None = None) -> tuple[Plan, ...]:
  """The plans of one pipelined tick, one per stream (`layouts`: Ping's and Pong's, or the
  tick's one), each layout holding every (stage, data rank) row, an idle stage's rows empty.
  A tick without idle rows, or whose even spread over every rank the cost model predicts to hide
  its exchange (`tick_time` no longer than with free bytes), gets `make_plan`'s plans; otherwise
  the plans with the shortest `tick_time` among the even spread and spreads over only the first
  idle rows (`HELPERS_PER_ACTIVE`; the same rows for all the tick's streams, so each stream's
  exchange keeps the other's compute beside it), ties to the wider spread."""
  layouts = tuple(layouts)
  tokens = sum(_tokens(l) for l in layouts)
  idle = np.flatnonzero(tokens == 0)
  active = tokens.size - idle.size

  def plans_over(helpers: int):
    servers = None
    if helpers < idle.size:
      servers = tokens > 0
      servers[idle[:helpers]] = True
    return tuple(make_plan(l, comm, epsilon, min_imbalance=min_imbalance, relay=relay,
                           servers=servers) for l in layouts)

  best = plans_over(idle.size)
  if not idle.size or not active or not any(p.stats.moves for p in best):
    return best
  best_time = tick_time(best, layouts, costs)
  if best_time <= tick_time(best, layouts, dataclasses.replace(costs, per_byte=0.0)):
    return best  # the exchange hides: fewer helpers would only unbalance the compute
  tried = {idle.size}
  for per_active in HELPERS_PER_ACTIVE:
    helpers = min(idle.size, int(round(per_active * active)))
    if helpers in tried:
      continue
    tried.add(helpers)
    plans = plans_over(helpers)
    t = tick_time(plans, layouts, costs)
    if t < best_time:
      best, best_time = plans, t
  return best
