"""Core attention disaggregation (CAD): dispatch CA-tasks to attention servers and back.

Every device of the server pool `ROW_AXES` = (pipe, data) is both the home of a buffer of T
tokens and an attention server (without pipeline parallelism `pipe` has size 1: the pool is
`data`; with it, every stage's rows are balanced together, idle stages only serve). Which task
runs where comes from the scheduler (`distca_jax.schedule`); this package carries the tasks
there and back. Its files are its seams:

  host.py      the host's planning of one step (`plan_step`): batch -> ping/pong split -> the
               scheduler's plans -> the gate (`distca_jax.gate`) -> dispatch arrays -> check;
               `plan_ticks` for a pipelined step's ticks; `split_pingpong_batch`.
  format.py    the exchange's arrays (`DispatchPlan`, one `Round` per exchange round; their
               docstrings are the format) and
               `build_dispatch`, which lays a task placement out in them. Rows that stay home
               are copied locally rather than sent, so the exchange carries only rows that
               really move, each (device, server) block padded to a small bucket.
  checks.py    `validate_plan`: the arrays checked against the batch, as named checks.
  runs.py      what the checks read the arrays with: row ranges followed through their runs.
  exchange.py  the device side: the exchange (`transport`, one function per
               `attention.exchange` mode), the row movers with explicit transposes, and the
               model's `core_attention` (`make_distca_attention`).

Ping-pong: with `attention.pingpong`, each micro-batch is split into two nano-batches (Ping and
Pong, `schedule/pingpong.py`), each with its own plan; the model runs them as two data-independent
streams (models/llama.py), so XLA can overlap one stream's exchange with the other's compute.
"""

from distca_jax.dispatch.checks import validate_plan
from distca_jax.dispatch.exchange import (COLLECTIVES, kv_return_index,
                                          make_distca_attention, resolve_exchange, transport)
from distca_jax.dispatch.format import ROUNDS, DispatchPlan, PlanMismatchError, Round, build_dispatch
from distca_jax.dispatch.host import (StepContext, plan_step, plan_ticks,
                                      split_pingpong_batch, step_capacities, stream_options)
from distca_jax.schedule.capacities import Capacities, StepShapes

__all__ = [
    "validate_plan", "COLLECTIVES", "kv_return_index", "make_distca_attention",
    "resolve_exchange", "transport", "ROUNDS", "DispatchPlan", "PlanMismatchError", "Round",
    "build_dispatch", "StepContext", "plan_step", "plan_ticks",
    "split_pingpong_batch", "step_capacities", "stream_options", "Capacities", "StepShapes",
]
