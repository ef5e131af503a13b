"""A pipelined tick's plan (`schedule/tick.py`): the planner's takers, and how far a warm-up tick's
attention spreads over idle stages when its bytes would not hide."""

import numpy as np
import pytest

from distca_jax.config import AttentionConfig
from distca_jax.data.packing import pack
from distca_jax.models.presets import PRESETS
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.plan import make_plan
from distca_jax.schedule.planner import balance
from distca_jax.schedule.tick import HELPERS_PER_ACTIVE, TickCosts, plan_tick, tick_time
from distca_jax.sim.config import SimConfig
from distca_jax.sim.pipeline import side_by_side

T = 8192
COMM = CommModel.for_model(PRESETS["llama3_8b"], 8, resend=True)


def warmup_tick():
  """Stage 0 of 4 active (2 data ranks, one holding a document of the whole buffer), the other
  three stages' 6 rows empty."""
  active = pack(np.r_[T, 2048, 1024, 512, 512, 1024, 1024], 2, T)
  return side_by_side([active, None, None, None], 2, T)[0]


def test_servers_outside_take_nothing_and_the_takers_balance():
  lay = warmup_tick()
  takers = np.r_[True, True, True, True, False, False, False, False]
  tasks, stats = balance(lay, COMM, 0.05, servers=takers)
  load = np.bincount(tasks.server, weights=tasks.area(), minlength=8)
  assert (load[~takers] == 0).all() and load.sum() == pytest.approx(stats.load_before.sum())
  mean = load.sum() / takers.sum()
  assert np.abs(load[takers] - mean).max() <= 0.05 * mean + 128 * T  # a granule's rounding
  with pytest.raises(ValueError, match="servers"):
    balance(lay, COMM, 0.05, servers=np.zeros(8, bool))


def test_a_warmup_tick_spreads_less_where_its_bytes_would_lengthen_it():
  lay = warmup_tick()
  even = (make_plan(lay, COMM, 0.05),)
  area = float(even[0].stats.load_before.sum())
  # An active row's attention costs twice its linear work; `k`: its exchange at the even spread
  # in units of its linear work.
  costs = lambda k: TickCosts(linear_per_token=1.0, attention_per_area=4.0 * T / area,
                              per_byte=k * T / even[0].traffic.send.max())
  free = plan_tick([lay], COMM, costs(0.0), epsilon=0.05)
  np.testing.assert_array_equal(free[0].stats.load_after, even[0].stats.load_after)

  got = plan_tick([lay], COMM, costs(3.0), epsilon=0.05)
  load = got[0].stats.load_after
  assert (load[2:] == 0).any() and (load[2:] > 0).any()  # some idle rows help, not all
  assert got[0].traffic.send.max() < even[0].traffic.send.max()
  best = tick_time(got, [lay], costs(3.0))
  assert best < tick_time(even, [lay], costs(3.0))
  for per_active in HELPERS_PER_ACTIVE:  # and no other number of helpers predicts a shorter tick
    servers = np.r_[True, True, np.arange(6) < round(per_active * 2)]
    other = (make_plan(lay, COMM, 0.05, servers=servers),)
    assert best <= tick_time(other, [lay], costs(3.0))


def test_the_trainer_and_the_simulator_gate_ticks_alike():
  for pipelined in (False, True):
    assert (SimConfig().min_imbalance_for(pipelined)
            == AttentionConfig().min_imbalance_for(pipelined=pipelined))
  assert AttentionConfig(min_imbalance=1.5).min_imbalance_for(pipelined=True) == 1.5
  assert SimConfig(min_imbalance=1.5).min_imbalance_for(True) == 1.5


def test_a_backward_tick_plans_as_its_forward_tick():
  """Backward tick t holds forward tick t's micro-batches on mirrored stages; the simulator
  prices both with the forward tick's plan, which holds while a tick's plan ignores which rows
  are which stage's (one node per tick)."""
  active = pack(np.r_[T, 2048, 1024, 512, 512, 1024, 1024], 2, T)
  other = pack(np.r_[3000, 2048, 4096, 512, 512, 4096, 2048], 2, T)
  forward = side_by_side([active, other, None, None], 2, T)[0]
  backward = side_by_side([None, None, other, active], 2, T)[0]
  area = float(make_plan(forward, COMM, 0.05).stats.load_before.sum())
  for per_byte in (0.0, 1e-3):
    costs = TickCosts(linear_per_token=1.0, attention_per_area=4.0 * T / area, per_byte=per_byte)
    f, b = (plan_tick([lay], COMM, costs, epsilon=0.05) for lay in (forward, backward))
    assert f[0].stats.moves > 0
    assert tick_time(b, [backward], costs) == pytest.approx(tick_time(f, [forward], costs))
