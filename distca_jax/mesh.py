"""Device mesh, the logical-axis table, and multi-host start-up.

Model code names logical axes (`embed`, `heads`, ...); `LogicalRules` maps them to mesh axes. This
is the only place that decides how parameters and activations are partitioned.

Mesh axes: `data` (data parallel; with FSDP it also shards parameters and optimizer state; it is
the attention-server pool of CAD), `tensor` (heads and MLP columns), `pipe` (pipeline stages,
`distca_jax/train/pipeline.py`). Which node each data rank sits on (`data_rank_nodes`) tells the CAD
gate which exchanged bytes cross the network.
"""

from __future__ import annotations

import dataclasses
import math
import socket
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distca_jax.config import ConfigError, MeshConfig

AXES = ("data", "pipe", "tensor")
# Rows of activations (one buffer of packed tokens each) are spread over (pipe, data), pipe-major:
# row r is stage r // data, data rank r % data. Without pipelining pipe has size 1. Core attention
# runs over these rows (the CAD server pool is every device of one tensor rank).
ROW_AXES = ("pipe", "data")


def local_rows(mesh: Mesh) -> np.ndarray | None:
  """Rows (over ROW_AXES: pipe-major, see above) whose buffers this process's devices hold, or
  None when it holds every row (one process)."""
  data, pipe, _ = mesh.devices.shape
  mine = np.vectorize(lambda d: d.process_index == jax.process_index())(mesh.devices).any(-1)
  if mine.all():
    return None
  d_idx, p_idx = np.nonzero(mine)
  return np.sort(p_idx * data + d_idx)


def data_rank_nodes(mesh: Mesh, devices_per_node: int | None = None) -> tuple[int, ...]:
  """The node (host) of each `data` rank: the node of its first device (pipe 0, tensor 0), nodes
  numbered in order of first appearance. With `devices_per_node`, consecutive devices of the
  mesh (its (data, pipe, tensor) order, the device list's) share a node. Else hosts are told
  apart by host name, gathered from every process (one process per host or one per GPU alike):
  a collective when there are several processes, so every process calls it; one process is one
  node."""
  if devices_per_node:
    per_rank = mesh.shape["pipe"] * mesh.shape["tensor"]
    node = [r * per_rank // devices_per_node for r in range(mesh.shape["data"])]
    return nodes_of(node, {n: n for n in node})
  process = [int(d.process_index) for d in mesh.devices[:, 0, 0]]
  if jax.process_count() == 1:
    return (0,) * len(process)
  from jax.experimental import multihost_utils

  name = np.zeros(256, np.uint8)
  raw = socket.gethostname().encode()[:256]
  name[:len(raw)] = np.frombuffer(raw, np.uint8)
  hosts = [bytes(row).rstrip(b"\0").decode(errors="replace")
           for row in np.asarray(multihost_utils.process_allgather(name))]
  return nodes_of(process, hosts)


def nodes_of(process_of_rank, host_of_process) -> tuple[int, ...]:
  """Node numbers per rank from each rank's process and each process's host name, numbered in
  order of first appearance (`data_rank_nodes`)."""
  ids: dict[str, int] = {}
  return tuple(ids.setdefault(host_of_process[p], len(ids)) for p in process_of_rank)


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


class DistributedInitError(RuntimeError):
  """jax.distributed could not start: the coordinator is unreachable or a process is missing."""


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, timeout_s: int = 300,
                           heartbeat_s: int = 20) -> None:
  """Starts `jax.distributed` when running on several hosts or processes.

  Explicit: `coordinator` ("host:port", served by process 0), `num_processes` and `process_id`.
  Automatic: under SLURM with several tasks (SLURM_NTASKS > 1) and nothing given, JAX reads the
  job's environment itself (coordinator = first node, one process per task; with one task per
  GPU, each process takes the GPU of its SLURM_LOCALID). Does nothing for a single process with
  no coordinator.

  `timeout_s` bounds the start-up: a process other than 0 first waits up to `timeout_s` for the
  coordinator's port to accept connections and raises DistributedInitError naming it if it never
  does; then every process waits up to `timeout_s` for all `num_processes` to register. (XLA
  ends a process that misses that second deadline with a fatal DEADLINE_EXCEEDED error rather
  than an exception; the line printed before the call says what it was waiting for.)
  `heartbeat_s`: a process silent that long is declared dead and the others end with an error,
  rather than waiting on it.
  """
  import sys

  if coordinator is None and num_processes in (None, 1) and not _under_cluster():
    return
  if coordinator is not None and (num_processes is None or process_id is None):
    raise DistributedInitError(
        f"--coordinator {coordinator} needs --num-processes and --process-id as well")
  if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
    raise DistributedInitError(f"--process-id {process_id} is outside [0, {num_processes})")
  if coordinator is not None and process_id != 0:
    _wait_for_port(coordinator, timeout_s, process_id, num_processes)
  print(f"jax.distributed: process {process_id if process_id is not None else '(auto)'} of "
        f"{num_processes if num_processes is not None else '(auto)'}, coordinator "
        f"{coordinator or '(from the cluster environment)'}; waiting up to {timeout_s} s for all "
        f"processes to join", file=sys.stderr, flush=True)
  try:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, local_device_ids=_slurm_local_device_ids(),
                               initialization_timeout=int(timeout_s),
                               heartbeat_timeout_seconds=int(heartbeat_s))
  except Exception as e:  # jaxlib raises XlaRuntimeError / ValueError / RuntimeError
    raise DistributedInitError(
        f"jax.distributed.initialize failed (coordinator {coordinator or 'auto'}, process "
        f"{process_id} of {num_processes}, timeout {timeout_s} s): {e}") from e


def shutdown_distributed() -> None:
  """Ends `jax.distributed` if it was started: every process waits at the shutdown barrier, so
  the coordinator (process 0) does not tear its service down while another process still talks
  to it (an exit without this sometimes aborted process 0 inside gRPC's server destructor)."""
  if jax.distributed.is_initialized():
    jax.distributed.shutdown()


def _slurm_local_device_ids() -> list[int] | None:
  """Under SLURM JAX gives each process only the GPU of its SLURM_LOCALID (one task per GPU).
  With one task per node, hand it every GPU of the node instead."""
  import os

  gpus = os.environ.get("SLURM_GPUS_ON_NODE")
  if os.environ.get("SLURM_NTASKS_PER_NODE") == "1" and gpus and gpus.isdigit() and _under_cluster():
    return list(range(int(gpus)))
  return None


def _wait_for_port(address: str, timeout_s: float, process_id, num_processes) -> None:
  """Polls until `host:port` accepts a TCP connection; DistributedInitError after `timeout_s`."""
  import socket
  import time

  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise DistributedInitError(f"coordinator address {address!r}: expected host:port")
  deadline = time.monotonic() + timeout_s
  last = None
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)):
        return
    except OSError as e:
      last = e
    if time.monotonic() >= deadline:
      break
    time.sleep(0.25)
  raise DistributedInitError(
      f"coordinator {address} unreachable after {timeout_s:g} s (process {process_id} of "
      f"{num_processes}; last error: {last}). Is process 0 running on that host and port, and "
      f"does the firewall let it through? Raise the wait with train.init_timeout_s.")


def _under_cluster() -> bool:
  import os

  return int(os.environ.get("SLURM_NTASKS", "1")) > 1
