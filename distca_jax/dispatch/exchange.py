"""The device side of CAD: the exchange over the server pool, the row movers, `core_attention`.

Per layer, inside one `shard_map` over (pipe, data, tensor), a device (plan arrays without their
leading N, `format.DispatchPlan`):

  1. gathers the Q rows and the deduplicated K/V rows each server needs into per-server send
     blocks of fixed capacity (`_rows_to_servers`, `_kv_to_servers`),
  2. exchanges them over the pool (`transport`: the one place that moves blocks between
     devices),
  3. as a server, gathers its K/V rows so every document prefix is contiguous and runs the
     kernel over its fused task batch (`kernels.attention`),
  4. returns O by the reverse exchange, and each home row picks its output (`_rows_to_home`).

The transport seam. `transport(blocks_NxCx..., send_count_N, recv_count_N, mode, shifts)` takes
a device's N send blocks (block s for server s, rows past a block's count zero) and returns the
N blocks it receives (block s from device s). Every mode gives the same result; they differ in
what travels. A new transport is one more function of that signature in `TRANSPORTS` (and a
value of `attention.exchange`); the movers, their transposes and the gradients need nothing
else, because each transport is its own transpose with the counts swapped (`send_count_N` <->
`recv_count_N`) and the shifts reversed.

Gradients: the row movements are linear maps with explicit transposes (custom VJPs): the Q
dispatch and the O return are each other's transpose (gathers and the reverse exchange); the
K/V gradients gather back by the inverse of the server's K/V gather, return by the reverse
exchange and are summed onto their home rows, which is exactly the summing of the gradients
of K/V rows that several servers received. Memory modes: `keep` lets autodiff keep what the
server received for the backward; `resend` wraps the exchange and the kernel in `jax.checkpoint`
so the server keeps nothing and the backward sends Q, K, V again (and recomputes the server's
forward: one more attention forward per layer, traded for the memory).

Shapes: T home rows, H query heads, K K/V heads, D head dim, N devices of the pool, C rows per
block, R = T + N * C server-side query rows, S = Skv gathered K/V rows per server.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from distca_jax import kernels
from distca_jax.colocated import make_colocated_attention
from distca_jax.dispatch.format import DispatchPlan
from distca_jax.kernels import TaskTable
from distca_jax.mesh import ROW_AXES

log = logging.getLogger("distca_jax.dispatch")

# ----------------------------------------------------------------------------- transports


def _tiled(blocks_NxCx, send_count_N, recv_count_N, shifts):
  """One all_to_all of the whole padded blocks (CPU and GPU)."""
  return jax.lax.all_to_all(blocks_NxCx, ROW_AXES, 0, 0, tiled=True)


def _shifted(blocks_NxCx, send_count_N, recv_count_N, shifts):
  """One `ppermute` per shift k = 1 .. N-1: block d + k mod N goes to that device with its first
  `shifts[k - 1]` rows (CPU and GPU). Over `data` alone (config refuses shifted with
  mesh.pipe > 1): over two axes, ppermute numbers devices in the mesh's axis order while
  all_to_all and axis_index follow the axis tuple's, and the mesh is (data, pipe, tensor) where
  rows are (pipe, data)."""
  N, C = blocks_NxCx.shape[:2]
  me = jax.lax.axis_index("data")
  out = jnp.zeros_like(blocks_NxCx)
  for k, rows in enumerate(shifts, 1):
    if rows == 0:
      continue
    block = jax.lax.dynamic_index_in_dim(blocks_NxCx, (me + k) % N, 0, keepdims=False)[:rows]
    got = jax.lax.ppermute(block, "data", perm=[(i, (i + k) % N) for i in range(N)])
    got = jnp.pad(got, [(0, C - rows)] + [(0, 0)] * (got.ndim - 1))
    out = jax.lax.dynamic_update_index_in_dim(out, got, (me - k) % N, 0)
  return out


def _ragged(blocks_NxCx, send_count_N, recv_count_N, shifts):
  """Only the first `send_count_N[s]` rows of block s travel and `recv_count_N[s]` rows land in
  block s (`jax.lax.ragged_all_to_all`, GPU only)."""
  N, C = blocks_NxCx.shape[:2]
  flat = blocks_NxCx.reshape((N * C,) + blocks_NxCx.shape[2:])
  block_start = jnp.arange(N, dtype=jnp.int32) * C
  here = jnp.full((N,), jax.lax.axis_index(ROW_AXES) * C, jnp.int32)  # my block on every peer
  out = jax.lax.ragged_all_to_all(flat, jnp.zeros_like(flat), block_start,
                                  send_count_N.astype(jnp.int32), here,
                                  recv_count_N.astype(jnp.int32), axis_name=ROW_AXES)
  return out.reshape(blocks_NxCx.shape)


# `attention.exchange` -> transport(blocks_NxCx, send_count_N, recv_count_N, shifts).
TRANSPORTS = {"tiled": _tiled, "shifted": _shifted, "ragged": _ragged}


def transport(blocks_NxCx, send_count_N, recv_count_N, mode: str, shifts: tuple = ()):
  """One exchange over the server pool: block s goes to device s, the block from device s lands
  at s (`TRANSPORTS[mode]`). All modes give the same result when the rows past a block's count
  are zero, as the movers make them (and `validate_plan` checks every count fits its shift).
  Each is its own transpose with the counts swapped, or the shifts reversed (what went out on
  shift k comes back on shift N - k)."""
  return TRANSPORTS[mode](blocks_NxCx, send_count_N, recv_count_N, shifts)


# ----------------------------------------------------------------------------- row movers


def _masked(valid, x):
  return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - valid.ndim)), x, 0)


# The exchange's row movements are linear maps whose transposes are each other's or simple
# gathers; they are given explicitly (custom VJPs) rather than derived by autodiff, whose
# transpose of a gather is a scatter-add into a fresh zero buffer: slow on GPU for rows of
# 32 heads x 128, and XLA merged those zero buffers across layers and pipeline ticks into one
# allocation made at the start of the step (tens of GiB).


def _with_transpose(linear, transpose):
  """`linear(x, plan)`, a linear map of rows, with `transpose(g, plan)` as its VJP."""
  f = jax.custom_vjp(linear)
  f.defvjp(lambda x, p: (linear(x, p), p), lambda p, g: (transpose(g, p), None))
  return f


def _send(x_TxKxD, idx_NxC, valid_NxC, send_count, recv_count, mode, shifts):
  """The rows `idx_NxC[s]` of `x` to server s, one exchange: the [N * C] rows received."""
  blocks = jnp.take(x_TxKxD, idx_NxC.reshape(-1), axis=0).reshape(idx_NxC.shape + x_TxKxD.shape[1:])
  with jax.named_scope("dispatch"):
    recv = transport(_masked(valid_NxC, blocks), send_count, recv_count, mode, shifts)
  return recv.reshape((-1,) + x_TxKxD.shape[1:])


def _rows_to_servers(x_TxHxD, p: DispatchPlan, mode="tiled"):
  """Home rows -> server-side rows [local T | received N*C] (Q forward, dO backward)."""
  local = _masked(p.local_q_valid, jnp.take(x_TxHxD, p.local_q_idx, axis=0))
  if p.send_q_idx.shape[-1] == 0:
    return local
  return jnp.concatenate([local, _send(x_TxHxD, p.send_q_idx, p.send_q_valid, p.send_q_count,
                                       p.recv_q_count, mode, p.shift_q)])


def _rows_to_home(y_RxHxD, p: DispatchPlan, mode="tiled"):
  """Server-side rows -> home rows (O forward, dQ backward): the transpose of `_rows_to_servers`
  (every real token sits in exactly one server slot; `validate_plan` checks it). Rows past a
  block's count are never read at home, so the reverse exchange may leave them out."""
  N, C = p.send_q_idx.shape
  T = p.return_idx.shape[0]
  if C:
    with jax.named_scope("return"):
      back = transport(y_RxHxD[T:].reshape((N, C) + y_RxHxD.shape[1:]), p.recv_q_count,
                       p.send_q_count, mode, p.shift_q[::-1])
    y_RxHxD = jnp.concatenate([y_RxHxD[:T], back.reshape((-1,) + y_RxHxD.shape[1:])])
  return _masked(p.return_valid, jnp.take(y_RxHxD, p.return_idx, axis=0))


def _kv_to_servers(x_TxKxD, p: DispatchPlan, mode="tiled"):
  """Home K/V rows -> the server's gathered K/V buffer [S] (each document prefix contiguous)."""
  rows = x_TxKxD
  if p.send_kv_idx.shape[-1]:
    rows = jnp.concatenate([x_TxKxD, _send(x_TxKxD, p.send_kv_idx, p.send_kv_valid,
                                           p.send_kv_count, p.recv_kv_count, mode, p.shift_kv)])
  return _masked(p.server_kv_valid, jnp.take(rows, p.server_kv_idx, axis=0))


def _kv_grads_to_home(g_SxKxD, p: DispatchPlan, mode="tiled"):
  """The transpose of `_kv_to_servers`: a gather by the inverse slot map, the reverse exchange,
  and a scatter-add of the returned rows onto the local ones (a row sent to several servers
  sums their gradients), in place."""
  N, C = p.send_kv_idx.shape
  T = p.server_kv_inv.shape[0] - N * C
  rows = _masked(p.server_kv_inv_valid, jnp.take(g_SxKxD, p.server_kv_inv, axis=0))
  if C == 0:
    return rows
  with jax.named_scope("return"):
    back = transport(rows[T:].reshape((N, C) + rows.shape[1:]), p.recv_kv_count, p.send_kv_count,
                     mode, p.shift_kv[::-1])
  back = back.reshape((-1,) + rows.shape[1:])
  return rows[:T].at[kv_return_index(p.send_kv_idx, p.send_kv_valid, T)].add(back, mode="drop")


def kv_return_index(send_kv_idx, send_kv_valid, T: int):
  """The local row each returned K/V gradient row adds onto, and T (past the end: the scatter
  drops it) for every slot that carried no row: the diagonal block and the padding past each
  block's count, whose index is 0. Added as zeros there, every one of them was an update of row
  0: on the GPU a scatter-add of duplicate indices is atomic, so all of them contended for one
  row, and their number grows with the blocks' capacity."""
  return jnp.where(send_kv_valid.reshape(-1), send_kv_idx.reshape(-1), T)


@functools.cache
def _movers(mode: str):
  """(rows_to_servers, rows_to_home, kv_to_servers) with explicit transposes, over the exchange
  `mode` (a key of `TRANSPORTS`)."""
  fs = {f: functools.partial(f, mode=mode)
        for f in (_rows_to_servers, _rows_to_home, _kv_to_servers, _kv_grads_to_home)}
  return (_with_transpose(fs[_rows_to_servers], fs[_rows_to_home]),
          _with_transpose(fs[_rows_to_home], fs[_rows_to_servers]),
          _with_transpose(fs[_kv_to_servers], fs[_kv_grads_to_home]))


def _server_exchange(q_TxHxD, k_TxKxD, v_TxKxD, p: DispatchPlan, backend: str, mode: str):
  """Steps 1-4 for one device (inside shard_map; plan arrays without their leading N)."""
  to_servers, to_home, kv_to_srv = _movers(mode)
  q_rows = to_servers(q_TxHxD, p)
  k_srv, v_srv = kv_to_srv(k_TxKxD, p), kv_to_srv(v_TxKxD, p)
  tasks = TaskTable(p.q_start, p.q_len, p.kv_start, p.kv_len)
  with jax.named_scope("core_attention"):
    o_rows, _ = kernels.attention(q_rows, k_srv, v_srv, tasks, backend=backend)
  return to_home(o_rows, p)


# ----------------------------------------------------------------------------- core_attention


def resolve_exchange(exchange: str) -> str:
  """`tiled`, `shifted` or `ragged` (`ragged_all_to_all` runs on GPU only; refused elsewhere)."""
  if exchange not in TRANSPORTS:
    raise ValueError(f"attention.exchange={exchange}: not one of {sorted(TRANSPORTS)}")
  if exchange == "ragged" and jax.default_backend() != "gpu":
    raise ValueError(f"attention.exchange=ragged needs GPUs (jax.lax.ragged_all_to_all), this "
                     f"backend is {jax.default_backend()}; use attention.exchange=tiled")
  if exchange == "ragged":
    log.warning("attention.exchange=ragged: XLA's GPU ragged_all_to_all waits on the host before "
                "each call, which made the step slower than the tiled exchange "
                "(docs/PERFORMANCE.md, the ragged exchange)")
  return exchange


# Pool size from which the tiled exchange's padding stops hiding under compute (docs/SIMULATOR.md:
# hidden at 8 ranks, exposed at 32; docs/PERFORMANCE.md "Dispatch at scale": 14x the rows at 8).
TILED_POOL_LIMIT = 8


def make_distca_attention(attention_config, mesh: Mesh):
  """The model's `core_attention` for `attention.impl: distca` under `mesh`: CAD for a step's
  `DispatchPlan`, colocated attention for a step the gate stopped (its `ColocatedContext`)."""
  pool = mesh.shape["pipe"] * mesh.shape["data"]
  if attention_config.exchange == "tiled" and pool > TILED_POOL_LIMIT:
    log.warning("attention.exchange=tiled over %d attention servers: every block of the "
                "all_to_all is padded to the largest one, which costs more than it balances beyond "
                "about %d servers (docs/SIMULATOR.md); attention.exchange=ragged sends only the "
                "moving rows but XLA 0.11 blocks the host on each one (docs/PERFORMANCE.md)",
                pool, TILED_POOL_LIMIT)
  backend = attention_config.kernel
  kernels.resolve_backend(backend)  # a bad name or platform fails here; `auto` resolves per call
  qkv_spec = P(ROW_AXES, None, "tensor", None)
  plan_spec = P(ROW_AXES)
  exchange = functools.partial(_server_exchange, backend=backend,
                               mode=resolve_exchange(attention_config.exchange))
  if attention_config.memory_mode == "resend":
    exchange = jax.checkpoint(exchange, policy=jax.checkpoint_policies.nothing_saveable)

  def local(q, k, v, plan):
    plan = jax.tree.map(lambda x: x[0], plan)
    return exchange(q[0], k[0], v[0], plan)[None]

  sharded = jax.shard_map(local, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, plan_spec),
                          out_specs=qkv_spec, check_vma=False)
  colocated = make_colocated_attention(mesh, attention_config.kernel)

  def core_attention(q, k, v, ctx, prior_kv=None):
    if ctx.KIND == "colocated":  # a step the gate stopped (`host.plan_step`)
      return colocated(q, k, v, ctx)
    # Ping-pong's Pong reads K/V rows of Ping too (the prefix of the document the split cut):
    # its plan's local K/V rows are [its own T | Ping's T] (`Layout.prior`), static per plan.
    N, T = ctx.return_idx.shape
    kv_rows = ctx.server_kv_inv.shape[-1] - N * ctx.send_kv_idx.shape[-1]
    if kv_rows != T:
      if prior_kv is None or kv_rows != 2 * T:
        have = T if prior_kv is None else 2 * T
        raise ValueError(f"distca attention: the plan reads {kv_rows} K/V rows per device, the "
                         f"stream (with an earlier stream's, if given) has {have}")
      k = jnp.concatenate([k, prior_kv[0]], axis=1)
      v = jnp.concatenate([v, prior_kv[1]], axis=1)
    return sharded(q, k, v, ctx)

  return core_attention
