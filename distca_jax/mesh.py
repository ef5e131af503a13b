"""Device mesh, the logical-axis table, and multi-host start-up.

Model code names logical axes (`embed`, `heads`, ...); `LogicalRules` maps them to mesh axes. This
is the only place that decides how parameters and activations are partitioned.

Mesh axes: `data` (data parallel; with FSDP it also shards parameters and optimizer state; it is
the attention-server pool of CAD), `tensor` (heads and MLP columns), `pipe` (reserved).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distca_jax.config import ConfigError, MeshConfig

AXES = ("data", "pipe", "tensor")


def make_mesh(mesh_config: MeshConfig, devices=None) -> Mesh:
  """A (data, pipe, tensor) mesh over `devices` (default: all devices), validated.

  Raises ConfigError naming the mesh field when the device count does not fit.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  tensor, pipe = mesh_config.tensor, mesh_config.pipe
  if n % (tensor * pipe):
    raise ConfigError(
        f"mesh.tensor x mesh.pipe = {tensor * pipe} does not divide the {n} available devices")
  data = n // (tensor * pipe) if mesh_config.data == -1 else mesh_config.data
  if data * tensor * pipe != n:
    raise ConfigError(
        f"mesh.data x mesh.pipe x mesh.tensor = {data}x{pipe}x{tensor} = {data * pipe * tensor} "
        f"does not match the {n} available devices")
  # tensor innermost: heads split across the devices of one node (fastest links).
  grid = np.asarray(devices, dtype=object).reshape(data, pipe, tensor)
  return Mesh(grid, AXES)


@dataclasses.dataclass(frozen=True)
class LogicalRules:
  """Logical axis name -> mesh axis (or None: replicated)."""

  table: dict[str, str | None]

  @classmethod
  def default(cls, fsdp: bool) -> "LogicalRules":
    return cls({
        "batch": "data",        # one buffer of packed documents per data rank
        "seq": None,
        "act_embed": None,
        "embed": "data" if fsdp else None,  # FSDP: parameters sharded over data ranks
        "vocab": "tensor",
        "heads": "tensor",
        "kv_heads": "tensor",
        "head_dim": None,
        "mlp": "tensor",
        "norm": None,
    })

  def spec(self, axes: tuple[str | None, ...]) -> P:
    out = []
    for name in axes:
      if name is not None and name not in self.table:
        raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(self.table)}")
      out.append(None if name is None else self.table[name])
    return P(*out)


def param_shardings(abstract_params: Any, mesh: Mesh, rules: LogicalRules) -> Any:
  """NamedSharding for every `nnx.Param` of a state tree, from its `logical_axes` metadata.

  A dimension whose size the mesh axis does not divide is replicated instead (e.g. a small
  vocabulary on many tensor ranks).
  """
  from flax import nnx

  def one(var):
    axes = var.get_metadata().get("logical_axes")
    if axes is None:
      return NamedSharding(mesh, P())
    spec = list(rules.spec(axes))
    shape = var.get_value().shape
    for i, axis in enumerate(spec):
      if axis is not None and shape[i] % mesh.shape[axis]:
        spec[i] = None
    return NamedSharding(mesh, P(*spec))

  return jax.tree.map(one, abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def activation_constrainer(mesh: Mesh, rules: LogicalRules):
  """The model's `constrain` seam: with_sharding_constraint by logical names."""

  def constrain(x, axes):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.spec(axes)))

  return constrain


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Host batches are [num_buffers, buffer_len]: buffer b lives on data rank b."""
  return NamedSharding(mesh, P("data"))


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
  """Starts `jax.distributed` when running on several hosts (SLURM is detected by JAX itself).

  Does nothing for a single process with no coordinator given.
  """
  if coordinator is None and num_processes in (None, 1) and not _under_cluster():
    return
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id)


def _under_cluster() -> bool:
  import os

  return int(os.environ.get("SLURM_NTASKS", "1")) > 1
