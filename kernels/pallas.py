"""Pallas backend: block-sparse flash attention over a fused CA-task batch, forward and backward.

Runs through the Pallas Triton lowering on GPU and in Pallas interpret mode on CPU (slow: for
tests on small shapes). Three kernels, all block-sparse through `blocks.py`:

- forward, grid (query block, query head): online softmax over the key blocks the query block can
  see; the per-element mask is applied only on boundary tiles.
- dQ, grid (query block, query head): the same walk, recomputing P from the saved LSE.
- dK/dV, grid (key block, KV head): walks, per task, the query blocks of that task that see the
  key block, over the G query heads of the KV head's group, accumulating in registers. Summing
  over the group and over tasks that share key rows happens inside the kernel, so no [S, H, D]
  float32 buffer and no atomics are needed.

Softmax runs in base 2 (`exp2`, scale folded with log2(e)); the LSE returned is natural log.
Rows outside every task give O = 0, LSE = -inf, and zero gradients; no NaN can arise because
masked scores are -inf and every max/LSE that can be -inf is replaced by 0 before subtraction.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .blocks import cdiv, key_task_ranges, query_schedule, task_q_blocks
from .tasks import TaskTable

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")


class Config(NamedTuple):
  """Tile sizes (rows) and Triton launch parameters. All block sizes are powers of two."""

  block_q: int = 128        # forward
  block_k: int = 64
  block_q_dq: int = 128     # dQ kernel
  block_k_dq: int = 64
  block_q_dkv: int = 64     # dK/dV kernel
  block_k_dkv: int = 128
  num_warps: int = 8
  num_stages: int = 3
  num_warps_bwd: int = 8    # dK/dV kernel (and dQ unless num_warps_dq is set)
  num_stages_bwd: int = 2
  num_warps_dq: int | None = None
  num_stages_dq: int | None = None
  # Fused backward: the dK/dV kernel also adds each tile's dQ into a float32 buffer with atomics
  # (5 matmuls per tile instead of 3 + 4 over two kernels), and the dQ kernel is not run.
  fused_bwd: bool = False
  # Triton only: the dK/dV kernel computes S^T = K Q^T (no register transposes of P and dS).
  bwd_transposed: bool = False


# H200, d = 128, bf16, measured by launch/bench_kernels.py --tune (docs/PERFORMANCE.md, Kernels):
# forward 128 x 128 tiles, 8 warps, 3 stages (3% over 128 x 64); backward 64 x 64 tiles, 4 warps,
# 2 stages (twice the backward throughput of 128 x 64 / 64 x 128 at 8 warps; the fused backward
# with atomic dQ was 1.5-6x slower). Small tiles on CPU keep interpret mode cheap and exercise the
# multi-block paths on small test shapes.
# Triton's transposed dK/dV step: +2% backward on an H100 (378 vs 370 TF/s, same run); its
# 32 x 128 and 64 x 128 dK/dV tiles were 2-3x slower.
GPU_CONFIG = Config(block_q=128, block_k=128, block_q_dq=64, block_k_dq=64, block_q_dkv=64,
                    block_k_dkv=64, num_warps=8, num_stages=3, num_warps_bwd=4, num_stages_bwd=2,
                    bwd_transposed=True)
CPU_CONFIG = Config(16, 16, 16, 16, 16, 16, 4, 1, 4, 1)
# GPU tiles per head dim, shared by the Pallas and Triton backends (launch/bench_kernels.py --tune
# --head-dim D writes its best here for the rest of its run). A head dim not listed takes the
# config of the smallest listed one above it (or the largest listed): tiles that fit a larger
# head dim's registers and shared memory fit a smaller one's.
# d = 64 and 256: `bench_kernels.py --tune triton --head-dim D` on an H100 (PERFORMANCE.md, "Tiles
# per head dim"); at 256 d = 128's tiles ask for twice the shared memory there is, and the dK/dV
# accumulators want 8 warps.
GPU_CONFIGS: dict[int, Config] = {
    64: GPU_CONFIG._replace(block_k=64, num_warps=4, num_stages_bwd=3),
    128: GPU_CONFIG,
    256: GPU_CONFIG._replace(block_k=64, num_stages=2, num_warps_bwd=8),
}


def gpu_config(head_dim: int) -> Config:
  """The GPU tiles for `head_dim` (see GPU_CONFIGS)."""
  dims = sorted(GPU_CONFIGS)
  return GPU_CONFIGS[next((d for d in dims if d >= head_dim), dims[-1])]


def _dot_nt(a, b):
  """a [m, d] @ b[n, d]^T -> float32 [m, n]."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(a, b):
  """a [m, n]^T @ b[m, d] -> float32 [n, d]."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _compiler_params(num_warps, num_stages, interpret):
  if interpret:
    return None
  from jax.experimental.pallas import triton as plgpu
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _row_mask(lo_B, hi_B, kb, block_k):
  cols = kb * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
  return (cols >= lo_B[:, None]) & (cols < hi_B[:, None])


def _three_runs(lo, full_lo, full_hi, hi, body, carry):
  """Masked run, unmasked run, masked run: the boundary tiles pay for the mask, the rest not."""
  carry = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
  return lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry)


# ----------------------------------------------------------------------------------- forward


def _fwd_kernel(kb_lo_ref, kb_flo_ref, kb_fhi_ref, kb_hi_ref, lo_ref, hi_ref, q_ref, k_ref,
                v_ref, o_ref, lse_ref, *, scale2, block_k):
  q_BxD = q_ref[...]
  lo_B, hi_B = lo_ref[...], hi_ref[...]
  block_q, d = q_BxD.shape

  def body(kb, carry, masked):
    acc_BxD, m_B, l_B = carry
    k_KxD = k_ref[pl.ds(kb * block_k, block_k), :]
    v_KxD = v_ref[pl.ds(kb * block_k, block_k), :]
    s_BxK = _dot_nt(q_BxD, k_KxD) * scale2
    if masked:
      s_BxK = jnp.where(_row_mask(lo_B, hi_B, kb, block_k), s_BxK, NEG_INF)
    m_new = jnp.maximum(m_B, jnp.max(s_BxK, axis=1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # a row that has seen nothing yet
    p_BxK = jnp.exp2(s_BxK - m_safe[:, None])
    alpha = jnp.exp2(m_B - m_safe)
    l_B = alpha * l_B + jnp.sum(p_BxK, axis=1)
    acc_BxD = alpha[:, None] * acc_BxD + _dot_nn(p_BxK.astype(v_KxD.dtype), v_KxD)
    return acc_BxD, m_new, l_B

  carry = (jnp.zeros((block_q, d), jnp.float32), jnp.full((block_q,), NEG_INF, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  acc_BxD, m_B, l_B = _three_runs(kb_lo_ref[0], kb_flo_ref[0], kb_fhi_ref[0], kb_hi_ref[0], body,
                                  carry)
  live = l_B > 0
  l_safe = jnp.where(live, l_B, 1.0)
  o_ref[...] = (acc_BxD / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(live, (m_B + jnp.log2(l_safe)) * LN2, NEG_INF)


@functools.partial(jax.jit, static_argnames=("scale", "cfg", "interpret"))
def _forward(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale, cfg: Config, interpret):
  """Padded-shape forward: T, S multiples of the block sizes. -> O [T,H,D], LSE [H,T] f32."""
  T, H, D = q_TxHxD.shape
  S, K, _ = k_SxKxD.shape
  G = H // K
  bq, bk = cfg.block_q, cfg.block_k
  nq = T // bq
  sch = query_schedule(tasks, T, bq, bk)
  one = lambda i, h: (nq - 1 - i,)  # heaviest (last, longest-prefix) query blocks first
  kernel = functools.partial(_fwd_kernel, scale2=scale * LOG2E, block_k=bk)
  o, lse = pl.pallas_call(
      kernel,
      grid=(nq, H),
      in_specs=[pl.BlockSpec((1,), one)] * 4 + [
          pl.BlockSpec((bq,), one), pl.BlockSpec((bq,), one),
          pl.BlockSpec((bq, None, D), lambda i, h: (nq - 1 - i, h, 0)),
          pl.BlockSpec((S, None, D), lambda i, h: (0, h // G, 0)),
          pl.BlockSpec((S, None, D), lambda i, h: (0, h // G, 0)),
      ],
      out_specs=[pl.BlockSpec((bq, None, D), lambda i, h: (nq - 1 - i, h, 0)),
                 pl.BlockSpec((None, bq), lambda i, h: (h, nq - 1 - i))],
      out_shape=[jax.ShapeDtypeStruct((T, H, D), q_TxHxD.dtype),
                 jax.ShapeDtypeStruct((H, T), jnp.float32)],
      compiler_params=_compiler_params(cfg.num_warps, cfg.num_stages, interpret),
      interpret=interpret,
      name="ca_flash_fwd",
  )(sch.kb_lo, sch.kb_full_lo, sch.kb_full_hi, sch.kb_hi, sch.row_lo, sch.row_hi, q_TxHxD,
    k_SxKxD, v_SxKxD)
  return o, lse


# ---------------------------------------------------------------------------------- backward


def _dq_kernel(kb_lo_ref, kb_flo_ref, kb_fhi_ref, kb_hi_ref, lo_ref, hi_ref, lse2_ref, delta_ref,
               q_ref, do_ref, k_ref, v_ref, dq_ref, *, scale, block_k):
  q_BxD, do_BxD = q_ref[...], do_ref[...]
  lo_B, hi_B = lo_ref[...], hi_ref[...]
  lse2_B, delta_B = lse2_ref[...], delta_ref[...]
  scale2 = scale * LOG2E

  def body(kb, dq_BxD, masked):
    k_KxD = k_ref[pl.ds(kb * block_k, block_k), :]
    v_KxD = v_ref[pl.ds(kb * block_k, block_k), :]
    s_BxK = _dot_nt(q_BxD, k_KxD) * scale2
    if masked:
      s_BxK = jnp.where(_row_mask(lo_B, hi_B, kb, block_k), s_BxK, NEG_INF)
    p_BxK = jnp.exp2(s_BxK - lse2_B[:, None])
    ds_BxK = p_BxK * (_dot_nt(do_BxD, v_KxD) - delta_B[:, None])
    return dq_BxD + _dot_nn(ds_BxK.astype(k_KxD.dtype), k_KxD)

  dq_BxD = _three_runs(kb_lo_ref[0], kb_flo_ref[0], kb_fhi_ref[0], kb_hi_ref[0], body,
                       jnp.zeros(q_BxD.shape, jnp.float32))
  dq_ref[...] = (dq_BxD * scale).astype(dq_ref.dtype)


def _dkv_kernel(t_lo_ref, t_hi_ref, qs_ref, ql_ref, ks_ref, kl_ref, lse2_ref, delta_ref, q_ref,
                do_ref, k_ref, v_ref, *out_refs, scale, block_q, group, fused):
  if fused:  # a zeroed float32 input aliased to the third output: atomics add into it
    _, dk_ref, dv_ref, dq_ref = out_refs
  else:
    dk_ref, dv_ref = out_refs
  kb = pl.program_id(0)
  k_KxD, v_KxD = k_ref[...], v_ref[...]
  block_k = k_KxD.shape[0]
  scale2 = scale * LOG2E
  cols_1xK = kb * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)

  def task_body(t, carry):
    qs, ql, ks, kl = qs_ref[t], ql_ref[t], ks_ref[t], kl_ref[t]
    qb_lo, f_lo, f_hi, qb_hi = task_q_blocks(qs, ql, ks, kl, kb, block_q, block_k)

    def body(qb, carry, g, masked):
      dk_KxD, dv_KxD = carry
      rows = pl.ds(qb * block_q, block_q)
      q_BxD, do_BxD = q_ref[rows, g, :], do_ref[rows, g, :]
      lse2_B, delta_B = lse2_ref[g, rows], delta_ref[g, rows]
      s_BxK = _dot_nt(q_BxD, k_KxD) * scale2
      if masked:
        r_Bx1 = qb * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        mask = ((r_Bx1 >= qs) & (r_Bx1 < qs + ql) & (cols_1xK >= ks)
                & (cols_1xK <= ks + kl - ql + (r_Bx1 - qs)))
        s_BxK = jnp.where(mask, s_BxK, NEG_INF)
      p_BxK = jnp.exp2(s_BxK - lse2_B[:, None])
      dv_KxD = dv_KxD + _dot_tn(p_BxK.astype(do_BxD.dtype), do_BxD)
      ds_BxK = p_BxK * (_dot_nt(do_BxD, v_KxD) - delta_B[:, None])
      dk_KxD = dk_KxD + _dot_tn(ds_BxK.astype(q_BxD.dtype), q_BxD)
      if fused:
        from jax.experimental.pallas import triton as plgpu
        dq_BxD = _dot_nn(ds_BxK.astype(k_KxD.dtype), k_KxD) * scale
        plgpu.atomic_add(dq_ref, (rows, jnp.int32(g), slice(None)), dq_BxD)
      return dk_KxD, dv_KxD

    for g in range(group):  # static: one walk per query head of the group
      carry = _three_runs(qb_lo, f_lo, f_hi, qb_hi,
                          lambda qb, c, masked, g=g: body(qb, c, g, masked), carry)
    return carry

  zeros = jnp.zeros(k_KxD.shape, jnp.float32)
  dk_KxD, dv_KxD = lax.fori_loop(t_lo_ref[0], t_hi_ref[0], task_body, (zeros, zeros))
  dk_ref[...] = (dk_KxD * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv_KxD.astype(dv_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "cfg", "interpret"))
def _backward(q_TxHxD, k_SxKxD, v_SxKxD, tasks, o_TxHxD, lse_HxT, do_TxHxD, dlse_HxT, scale,
              cfg: Config, interpret):
  """Padded-shape backward -> dQ, dK, dV in the inputs' dtypes."""
  T, H, D = q_TxHxD.shape
  S, K, _ = k_SxKxD.shape
  G = H // K
  # The LSE cotangent enters as a shift of delta: dS = P * (dP - (rowsum(dO*O) - dLSE)).
  delta_HxT = row_delta(do_TxHxD, o_TxHxD).T - dlse_HxT
  # Rows that see nothing have LSE -inf; 0 keeps (-inf) - LSE from becoming NaN.
  lse2_HxT = jnp.where(jnp.isfinite(lse_HxT), lse_HxT * LOG2E, 0.0)

  if not cfg.fused_bwd:
    bq, bk = cfg.block_q_dq, cfg.block_k_dq
    nq = T // bq
    sch = query_schedule(tasks, T, bq, bk)
    one = lambda i, h: (nq - 1 - i,)
    rowblk = lambda i, h: (nq - 1 - i, h, 0)
    full = lambda i, h: (0, h // G, 0)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_k=bk),
        grid=(nq, H),
        in_specs=[pl.BlockSpec((1,), one)] * 4 + [pl.BlockSpec((bq,), one)] * 2 + [
            pl.BlockSpec((None, bq), lambda i, h: (h, nq - 1 - i))] * 2 + [
            pl.BlockSpec((bq, None, D), rowblk)] * 2 + [pl.BlockSpec((S, None, D), full)] * 2,
        out_specs=pl.BlockSpec((bq, None, D), rowblk),
        out_shape=jax.ShapeDtypeStruct((T, H, D), q_TxHxD.dtype),
        compiler_params=_compiler_params(cfg.num_warps_dq or cfg.num_warps_bwd,
                                        cfg.num_stages_dq or cfg.num_stages_bwd, interpret),
        interpret=interpret,
        name="ca_flash_dq",
    )(sch.kb_lo, sch.kb_full_lo, sch.kb_full_hi, sch.kb_hi, sch.row_lo, sch.row_hi, lse2_HxT,
      delta_HxT, q_TxHxD, do_TxHxD, k_SxKxD, v_SxKxD)

  bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
  nk = S // bk
  C = tasks.q_start.shape[0]
  whole_c = pl.BlockSpec((C,), lambda j, h: (0,))
  t_lo, t_hi = key_task_ranges(tasks, S, bq, bk)
  group_rows = pl.BlockSpec((T, G, D), lambda j, h: (0, h, 0))
  group_stats = pl.BlockSpec((G, T), lambda j, h: (h, 0))
  kvblk = pl.BlockSpec((bk, None, D), lambda j, h: (j, h, 0))
  fused = cfg.fused_bwd
  extra_in, extra_specs, extra_out, extra_shapes, alias = [], [], [], [], {}
  if fused:
    extra_in = [jnp.zeros((T, H, D), jnp.float32)]
    extra_specs = extra_out = [group_rows]
    extra_shapes = [jax.ShapeDtypeStruct((T, H, D), jnp.float32)]
    alias = {12: 2}
  outs = pl.pallas_call(
      functools.partial(_dkv_kernel, scale=scale, block_q=bq, group=G, fused=fused),
      # Key block 0 goes first: under causal masks the earliest keys are seen by the most rows.
      grid=(nk, K),
      in_specs=[pl.BlockSpec((1,), lambda j, h: (j,))] * 2 + [whole_c] * 4 + [group_stats] * 2
      + [group_rows] * 2 + [kvblk] * 2 + extra_specs,
      out_specs=[kvblk, kvblk] + extra_out,
      out_shape=[jax.ShapeDtypeStruct((S, K, D), k_SxKxD.dtype),
                 jax.ShapeDtypeStruct((S, K, D), v_SxKxD.dtype)] + extra_shapes,
      input_output_aliases=alias,
      compiler_params=_compiler_params(cfg.num_warps_bwd, cfg.num_stages_bwd, interpret),
      interpret=interpret,
      name="ca_flash_dkv",
  )(t_lo, t_hi, *tasks, lse2_HxT, delta_HxT, q_TxHxD, do_TxHxD, k_SxKxD, v_SxKxD, *extra_in)
  if fused:
    dk, dv, dq32 = outs
    dq = dq32.astype(q_TxHxD.dtype)
  else:
    dk, dv = outs
  return dq, dk, dv


# --------------------------------------------------------------------------------- interface


def row_delta(do_TxHxD, o_TxHxD):
  """rowsum(dO * O) per query row and head, float32 [T, H], in a pass of its own. Left to fuse
  with the [H, T] transpose and the statistics around it, XLA read dO and O in the transposed
  order at ~0.6 TB/s: 1.7 ms beside a 13 ms attention backward on ProLong 64K, 0.35 ms this way
  (H100 profile)."""
  f32 = jnp.float32
  return jax.lax.optimization_barrier(jnp.sum(do_TxHxD.astype(f32) * o_TxHxD.astype(f32), -1))


def _pad_rows(x, rows):
  return x if x.shape[0] == rows else jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _pow2(n):
  return 1 << max(n - 1, 0).bit_length()


def _padded(cfg: Config, T: int, S: int, tasks: TaskTable):
  """(T, S) rounded up to every kernel's block sizes, and the task table padded to a power-of-two
  capacity (Triton wants power-of-two block shapes, and the dK/dV kernel reads the whole table).
  Shared by the Pallas and the Triton backends."""
  row_q = max(cfg.block_q, cfg.block_q_dq, cfg.block_q_dkv)
  row_k = max(cfg.block_k, cfg.block_k_dq, cfg.block_k_dkv)
  C = tasks.q_start.shape[-1]
  tasks = TaskTable(*(_pad_rows(jnp.asarray(a, jnp.int32), _pow2(C)) for a in tasks))
  return cdiv(T, row_q) * row_q, cdiv(S, row_k) * row_k, tasks


def from_stats(backward, cfg: Config, q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, o_TxHxD,
               lse_TxH, do_TxHxD, dlse_TxH, scale: float):
  """dQ, dK, dV from saved O and LSE through `backward` (a backend's padded-shape backward,
  called as backward(q, k, v, tasks, o, lse_HxT, do, dlse_HxT, scale, cfg)): pads the rows and
  the table, runs it, cuts the padding off."""
  T, S = q_TxHxD.shape[0], k_SxKxD.shape[0]
  Tp, Sp, tasks = _padded(cfg, T, S, tasks)
  lse_HxT = jnp.pad(lse_TxH.T, [(0, 0), (0, Tp - T)], constant_values=NEG_INF)
  dlse_HxT = jnp.pad(dlse_TxH.T.astype(jnp.float32), [(0, 0), (0, Tp - T)])
  dq, dk, dv = backward(_pad_rows(q_TxHxD, Tp), _pad_rows(k_SxKxD, Sp), _pad_rows(v_SxKxD, Sp),
                        tasks, _pad_rows(o_TxHxD, Tp), lse_HxT, _pad_rows(do_TxHxD, Tp),
                        dlse_HxT, scale, cfg)
  return dq[:T], dk[:S], dv[:S]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale, cfg, interpret):
  o, lse_HxT = _forward(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale, cfg, interpret)
  return o, lse_HxT


def _attention_fwd(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale, cfg, interpret):
  o, lse_HxT = _forward(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale, cfg, interpret)
  return (o, lse_HxT), (q_TxHxD, k_SxKxD, v_SxKxD, tasks, o, lse_HxT)


def _attention_bwd(scale, cfg, interpret, res, cts):
  q, k, v, tasks, o, lse_HxT = res
  do, dlse_HxT = cts
  dq, dk, dv = _backward(q, k, v, tasks, o, lse_HxT, do, dlse_HxT.astype(jnp.float32), scale,
                         cfg, interpret)
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q_TxHxD: jax.Array, k_SxKxD: jax.Array, v_SxKxD: jax.Array, tasks: TaskTable, *,
              scale: float | None = None, config: Config | None = None,
              interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """O [T, H, D] in q's dtype and LSE [T, H] float32 (natural log; -inf for uncovered rows).

  Differentiable in q, k, v (custom VJP; O and LSE cotangents both honoured). `interpret`
  defaults to True on CPU. Rows are padded internally to the block sizes, so T and S are free.
  """
  T, H, D = q_TxHxD.shape
  S, K, _ = k_SxKxD.shape
  if H % K:
    raise ValueError(f"GQA: {H} query heads are not a multiple of {K} KV heads")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  cfg = config or (CPU_CONFIG if interpret else gpu_config(D))
  scale = D ** -0.5 if scale is None else float(scale)
  Tp, Sp, tasks = _padded(cfg, T, S, tasks)
  o, lse_HxT = _attention(_pad_rows(q_TxHxD, Tp), _pad_rows(k_SxKxD, Sp), _pad_rows(v_SxKxD, Sp),
                          tasks, scale, cfg, bool(interpret))
  return o[:T], lse_HxT[:, :T].T


def backward_from_stats(q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, o_TxHxD, lse_TxH, do_TxHxD,
                        dlse_TxH, scale: float, config: Config | None = None,
                        interpret: bool | None = None):
  """dQ, dK, dV from saved O and LSE (any backend's forward): the Pallas backward kernels alone."""
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  cfg = config or (CPU_CONFIG if interpret else gpu_config(q_TxHxD.shape[-1]))
  return from_stats(functools.partial(_backward, interpret=bool(interpret)), cfg, q_TxHxD,
                    k_SxKxD, v_SxKxD, tasks, o_TxHxD, lse_TxH, do_TxHxD, dlse_TxH, scale)
