"""The device side of CAD: the exchange over the server pool, the row movers, `core_attention`.

Per layer, inside one `shard_map` over (pipe, data, tensor), a device (plan arrays without their
leading N, `format.DispatchPlan` and its `format.Round`s):

  1. gathers the Q rows and the deduplicated K/V rows it sends into ONE packed send buffer each,
     grouped by server (`_rows_to_servers`, `_kv_to_servers`),
  2. exchanges them over the pool (`transport`: the one place that moves rows between devices)
     into ONE packed receive buffer each, grouped by home,
  3. as a server, gathers its K/V rows so every document prefix is contiguous and runs the
     kernel over its fused task batch (`kernels.attention`), whose query rows are its home rows
     in place followed by the received ones: a row that stays home is never copied,
  4. returns O by the reverse exchange into the send buffer's slots, and writes each returned
     row to its home row (`_rows_to_home`).

With relays (`attention.kv_relay_fanout`, `schedule/relay.py`) the K/V exchange of step 2 runs in
two rounds: the holders send their pieces to a few servers, which forward them, gathered from
their [local | round-1] rows, to the others; the backward runs them reversed, round 2 first.

The transport seam. `transport(x, out_rows, ex, mode)` takes a device's packed send buffer and
an `Exchange` (its counts and offsets, per peer) and returns its packed receive buffer of
`out_rows` rows; `mode` is a `schedule.transport.Transport`, which says what each carries and
costs. Every mode gives the same result; they differ in what travels:
  ragged   one `jax.lax.ragged_all_to_all` (GPU): only the rows that move, buffers sized by the
           busiest device's rows; the transport for clusters.
  tiled    every (device, server) block padded to the largest pair's, one `all_to_all` (CPU and
           GPU; `ragged`'s CPU stand-in: the same result with padded traffic).
A transport is its own transpose with the exchange reversed (`Exchange.reversed`: counts and
offsets of the two sides swapped), which the movers use for their VJPs.

Gradients: the row movements are linear maps with explicit transposes (custom VJPs): the Q
dispatch and the O return are each other's transpose (gathers and the reverse exchange); the
K/V gradients gather back by the inverse of the server's K/V gather, return by the reverse
exchange and are summed onto their home rows, which is exactly the summing of the gradients
of K/V rows that several servers received. Memory modes: `keep` lets autodiff keep what the
server received for the backward; `resend` wraps the exchange and the kernel in `jax.checkpoint`
so the server keeps nothing and the backward sends Q, K, V again (and recomputes the server's
forward: one more attention forward per layer, traded for the memory).

Shapes: T home rows, H query heads, K K/V heads, D head dim, N devices of the pool, Sq / Rq the
packed query send / receive rows, R = T + Rq server-side query rows, S = Skv gathered K/V rows
per server.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from distca_jax import kernels
from distca_jax.schema import ConfigError
from distca_jax.colocated import make_colocated_attention
from distca_jax.dispatch.format import DispatchPlan, Round
from distca_jax.kernels import TaskTable
from distca_jax.mesh import ROW_AXES
from distca_jax.schedule.transport import RAGGED, TILED, Transport

log = logging.getLogger("distca_jax.dispatch")

# ----------------------------------------------------------------------------- transports


@dataclasses.dataclass(frozen=True)
class Exchange:
  """One packed exchange as a device sees it (inside shard_map), [N] int32 per peer j:
  send_count / send_off: its rows for j and where they start in its send buffer; recv_count /
  recv_off: j's rows for it and where they land in its receive buffer; peer_off: where its rows
  land in j's receive buffer. `block`: the tiled exchange's rows per padded block."""

  send_count: Any
  send_off: Any
  recv_count: Any
  recv_off: Any
  peer_off: Any
  back_off: Any
  block: int = 0

  def reversed(self) -> "Exchange":
    """The exchange back: what was received is sent back to the slots it was sent from."""
    return Exchange(send_count=self.recv_count, send_off=self.recv_off, recv_count=self.send_count,
                    recv_off=self.send_off, peer_off=self.back_off, back_off=self.peer_off,
                    block=self.block)

  @classmethod
  def of(cls, r: Round) -> "Exchange":
    """The exchange of one round of a device's plan (`DispatchPlan.q`, `.kv`, `.kv2`)."""
    return cls(send_count=r.send_count, send_off=r.send_off, recv_count=r.recv_count,
               recv_off=r.recv_off, peer_off=r.peer_off, back_off=r.back_off, block=r.block)


def _take_rows(x_SxE, idx, valid):
  """Rows `idx` of `x`, zero where not `valid` (indices there may lie past the end)."""
  return _masked(valid, jnp.take(x_SxE, idx, axis=0, mode="clip"))


def _place_rows(out_RxE, rows_CxE, dst, valid):
  """`out` with `rows` written at `dst` where `valid`; the others go past the end, where the
  scatter drops them (no two writes to one row, so no atomics on a GPU)."""
  dst = jnp.where(valid, dst, out_RxE.shape[0])
  return out_RxE.at[dst.reshape(-1)].set(rows_CxE.reshape((-1,) + rows_CxE.shape[valid.ndim:]),
                                         mode="drop")


def _ragged(x_SxE, out_rows: int, ex: Exchange):
  """Only the rows that move travel (`jax.lax.ragged_all_to_all`, GPU only)."""
  return jax.lax.ragged_all_to_all(
      x_SxE, jnp.zeros((out_rows,) + x_SxE.shape[1:], x_SxE.dtype), ex.send_off.astype(jnp.int32),
      ex.send_count.astype(jnp.int32), ex.peer_off.astype(jnp.int32),
      ex.recv_count.astype(jnp.int32), axis_name=ROW_AXES)


def _tiled(x_SxE, out_rows: int, ex: Exchange):
  """Blocks of `ex.block` rows per peer, one all_to_all of them all (CPU and GPU)."""
  j = jnp.arange(ex.block, dtype=jnp.int32)[None, :]
  blocks = _take_rows(x_SxE, ex.send_off[:, None] + j, j < ex.send_count[:, None])
  got = jax.lax.all_to_all(blocks, ROW_AXES, 0, 0, tiled=True)
  out = jnp.zeros((out_rows,) + x_SxE.shape[1:], x_SxE.dtype)
  return _place_rows(out, got, ex.recv_off[:, None] + j, j < ex.recv_count[:, None])


# Each transport's collective: transport(x_SxE, out_rows, ex).
COLLECTIVES = {TILED: _tiled, RAGGED: _ragged}


def transport(x_SxE, out_rows: int, ex: Exchange, mode: Transport):
  """One packed exchange over the server pool (`COLLECTIVES[mode]`): the rows of this device's
  send buffer `x_SxE` for each peer land in that peer's receive buffer of `out_rows` rows.
  Rows past a buffer's counts are zero. Its transpose is `transport(g, S, ex.reversed(), mode)`."""
  with jax.named_scope("exchange"):
    return COLLECTIVES[mode](x_SxE, out_rows, ex)


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


def _rows_to_servers(x_TxHxD, p: DispatchPlan, mode: Transport = TILED):
  """Home rows -> server-side rows [home T, in place | received Rq] (Q forward, dO backward):
  the rows local tasks read stay where they are, the sent ones travel."""
  if p.q.recv_rows == 0:
    return x_TxHxD
  send = _masked(p.q.send_valid, jnp.take(x_TxHxD, p.q.send_idx, axis=0))
  with jax.named_scope("dispatch"):
    recv = transport(send, p.q.recv_rows, Exchange.of(p.q), mode)
  return jnp.concatenate([x_TxHxD, recv])


def _rows_to_home(y_RxHxD, p: DispatchPlan, mode: Transport = TILED):
  """Server-side rows -> home rows (O forward, dQ backward): the transpose of `_rows_to_servers`.
  A local row's output is its own server row; the reverse exchange brings the others back to the
  send slots their query rows left from, and each is written over its home row (every real token
  sits in exactly one server slot, `validate_plan` checks it, so no row is written twice).

  Nothing is masked: the kernels give every row no task covers (a row sent away, padding) an
  O and a dQ of exactly zero (tests/test_kernels.py checks each backend), and read only their
  tasks' rows, so the home rows no task reads need no zeroing on the way in either."""
  T = p.local_q_valid.shape[0]
  if p.q.recv_rows == 0:
    return y_RxHxD[:T]
  with jax.named_scope("return"):
    back = transport(y_RxHxD[T:], p.q.send_rows, Exchange.of(p.q).reversed(), mode)
  return _place_rows(y_RxHxD[:T], back, p.q.send_idx, p.q.send_valid)


def _kv_to_servers(x_TxKxD, p: DispatchPlan, mode: Transport = TILED):
  """Home K/V rows -> the server's gathered K/V buffer [S] (each document prefix contiguous).
  Round 1 brings the holders' pieces; round 2 (relays on) each relay's forwarded pieces, which
  it gathers from its [local | round-1] rows."""
  rows = x_TxKxD
  for r in (p.kv, p.kv2):
    if r.recv_rows:
      send = _masked(r.send_valid, jnp.take(rows, r.send_idx, axis=0))
      with jax.named_scope("dispatch"):
        rows = jnp.concatenate([rows, transport(send, r.recv_rows, Exchange.of(r), mode)])
  return _masked(p.server_kv_valid, jnp.take(rows, p.server_kv_idx, axis=0))


def _kv_grads_to_home(g_SxKxD, p: DispatchPlan, mode: Transport = TILED):
  """The transpose of `_kv_to_servers`: a gather by the inverse slot map, then each round
  reversed, last first: the reverse exchange and a scatter-add of the returned rows onto the
  rows they were sent from (a row sent to several servers, or forwarded by a relay, sums their
  gradients), in place."""
  rows = _masked(p.server_kv_inv_valid, jnp.take(g_SxKxD, p.server_kv_inv, axis=0))
  for r in (p.kv2, p.kv):
    if r.recv_rows:
      kept = rows.shape[0] - r.recv_rows  # the rows this round's send buffer was gathered from
      with jax.named_scope("return"):
        back = transport(rows[kept:], r.send_rows, Exchange.of(r).reversed(), mode)
      rows = rows[:kept].at[kv_return_index(r.send_idx, r.send_valid, kept)].add(back, mode="drop")
  return rows


def kv_return_index(send_kv_idx, send_kv_valid, T: int):
  """The local row each returned K/V gradient row adds onto, and T (past the end: the scatter
  drops it) for every slot of the send buffer past its rows, whose index is 0: added as zeros
  onto row 0, they would all contend for one row (a GPU scatter-add of duplicate indices is
  atomic)."""
  return jnp.where(send_kv_valid.reshape(-1), send_kv_idx.reshape(-1), T)


@functools.cache
def _movers(mode: Transport):
  """(rows_to_servers, rows_to_home, kv_to_servers) with explicit transposes, over the exchange
  `mode`."""
  fs = {f: functools.partial(f, mode=mode)
        for f in (_rows_to_servers, _rows_to_home, _kv_to_servers, _kv_grads_to_home)}
  return (_with_transpose(fs[_rows_to_servers], fs[_rows_to_home]),
          _with_transpose(fs[_rows_to_home], fs[_rows_to_servers]),
          _with_transpose(fs[_kv_to_servers], fs[_kv_grads_to_home]))


def _server_exchange(q_TxHxD, k_TxKxD, v_TxKxD, p: DispatchPlan, backend: str, mode: Transport):
  """Steps 1-4 for one device (inside shard_map; plan arrays without their leading N)."""
  to_servers, to_home, kv_to_srv = _movers(mode)
  # "movers": the profiler's step part for the gathers and scatters around the exchange.
  with jax.named_scope("movers"):
    q_rows = to_servers(q_TxHxD, p)
    k_srv, v_srv = kv_to_srv(k_TxKxD, p), kv_to_srv(v_TxKxD, p)
  tasks = TaskTable(p.q_start, p.q_len, p.kv_start, p.kv_len)
  with jax.named_scope("core_attention"):
    o_rows, _ = kernels.attention(q_rows, k_srv, v_srv, tasks, backend=backend)
  with jax.named_scope("movers"):
    return to_home(o_rows, p)


# ----------------------------------------------------------------------------- core_attention


def resolve_exchange(mode: Transport) -> Transport:
  """`mode`, if it runs on this platform (`ragged_all_to_all` runs on GPU only; refused elsewhere
  with a ConfigError, when the trainer is built: before anything is traced)."""
  if mode.needs_gpu and jax.default_backend() != "gpu":
    raise ConfigError(f"attention.exchange={mode.name} needs GPUs (jax.lax.{mode.name}_all_to_all), "
                      f"this backend is {jax.default_backend()}; use attention.exchange=tiled")
  if mode is RAGGED:
    log.warning("attention.exchange=ragged: XLA's default GPU ragged_all_to_all waits on the host "
                "before each call, which made the step slower than the tiled exchange; XLA's "
                "device-initiated kernel, which does not, needs NCCL >= 2.29 and XLA_FLAGS="
                "--xla_gpu_experimental_ragged_all_to_all_use_device_kernel=true "
                "--xla_gpu_experimental_enable_nccl_symmetric_buffers=true "
                "(docs/PERFORMANCE.md, \"Dispatch at scale\")")
  return mode


def make_distca_attention(attention_config, mesh: Mesh):
  """The model's `core_attention` for `attention.impl: distca` under `mesh`: CAD for a step's
  `DispatchPlan`, colocated attention for a step the gate stopped (its `ColocatedContext`)."""
  pool = mesh.shape["pipe"] * mesh.shape["data"]
  mode = resolve_exchange(attention_config.transport())
  note = mode.pool_note(pool)
  if note:
    log.warning(note)
  backend = attention_config.kernel
  kernels.resolve_backend(backend)  # a bad name or platform fails here; `auto` resolves per call
  qkv_spec = P(ROW_AXES, None, "tensor", None)
  plan_spec = P(ROW_AXES)
  exchange = functools.partial(_server_exchange, backend=backend, mode=mode)
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
    T = ctx.local_q_valid.shape[-1]
    kv_rows = ctx.kv_rows
    if kv_rows != T:
      if prior_kv is None or kv_rows != 2 * T:
        have = T if prior_kv is None else 2 * T
        raise ValueError(f"distca attention: the plan reads {kv_rows} K/V rows per device, the "
                         f"stream (with an earlier stream's, if given) has {have}")
      with jax.named_scope("prior_kv"):  # the profiler's step part (train/profile.py)
        k = jnp.concatenate([k, prior_kv[0]], axis=1)
        v = jnp.concatenate([v, prior_kv[1]], axis=1)
    return sharded(q, k, v, ctx)

  return core_attention
