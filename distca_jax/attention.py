"""The `core_attention` seam: where softmax(QK^T)V of packed documents runs, and the step
context the trainer hands it.

`make_core_attention(config, mesh)` returns the function the model calls for every layer,
`core_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, ctx) -> o_BxTxHxD`, and `host_context(...)`
builds the per-step context on the host. Two implementations:

- colocated (the baseline, `colocated.py`): each device computes attention for its own tokens,
  gathering the K/V of a document that started on earlier devices.
- distca: core attention disaggregation (`dispatch/`): the scheduler's CA-tasks run on
  attention servers, and a step the gate stops runs colocated.

Every host context follows one protocol (`StepContext`), so the trainer never asks which kind
it holds.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from jax.sharding import Mesh

from distca_jax import dispatch
from distca_jax.colocated import (ColocatedContext, colocated_context, colocated_contexts,
                                  colocated_window, make_colocated_attention)
from distca_jax.data.packing import Layout
from distca_jax.data.sources import Batch

__all__ = ["StepContext", "ColocatedContext", "colocated_context", "colocated_contexts",
           "colocated_window", "make_colocated_attention", "make_core_attention", "host_context"]


class StepContext(Protocol):
  """What the trainer reads of a step's host context: `colocated.ColocatedContext`,
  `dispatch.StepContext` (CAD) or `pipeline_host.StepContext` (a pipelined step's ticks).

  cad            whether the step runs CAD's exchange (False: colocated, or stopped by the gate)
  plans          the scheduler's plans (empty: none; their loads are the step's "after")
  device_inputs(batch) -> ((arrays, spec), (context, spec)): the host arrays the jitted step
                 reads and the context pytree `core_attention` gets, each with its
                 `PartitionSpec` (or, for arrays, a dict of them by key)

A CAD context also carries `predicted_saving`, `batches` (its streams) and `capacities`
(`schedule.Capacities`), which the trainer logs when `cad` is true. The device-side pytree a
`core_attention` receives names its kind in `KIND` ("colocated" or "distca")."""

  cad: bool
  plans: tuple

  def device_inputs(self, batch: Batch) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    ...


def make_core_attention(attention_config, mesh: Mesh) -> Callable:
  """The model's `core_attention` for `attention.impl` under `mesh`."""
  if attention_config.impl == "colocated":
    return make_colocated_attention(mesh, attention_config.kernel)
  return dispatch.make_distca_attention(attention_config, mesh)


def host_context(attention_config, batch: "Batch | Layout", model_shape=None, devices=None,
                 shapes=None) -> StepContext:
  """The per-step context for the configured attention, computed on the host: a
  `ColocatedContext` (colocated), or `dispatch.plan_step`'s (distca: nano-batches and plans, or
  colocated's where the gate stops the step; `devices`: the rows this process checks,
  `mesh.local_rows`). `shapes`: the run's `schedule.StepShapes`, so steps compile only when a
  capacity grows."""
  layout = batch if isinstance(batch, Layout) else batch.layout
  if attention_config.impl == "colocated":
    return colocated_contexts([layout], shapes=shapes)[0]
  if isinstance(batch, Layout):
    raise TypeError("distca attention plans from the whole batch (ping-pong re-packs its tokens)")
  return dispatch.plan_step(attention_config, batch, model_shape, devices, shapes)
