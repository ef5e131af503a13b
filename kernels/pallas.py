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

Shapes: T query rows, S key rows, H query heads, K KV heads, G = H / K, D head dim; inside a
kernel B rows of a query block and N rows of a key block (q_BxD, k_NxD, s_BxN).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .blocks import key_task_ranges, query_schedule, task_q_blocks
from .common import (CPU_CONFIG, LN2, LOG2E, NEG_INF, Config, backward_stats,
                     gpu_config, pad_rows, padded)
from .tasks import TaskTable


def _dot_nt(a, b):
  """a [m, c] @ b [n, c]^T -> float32 [m, n]."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(a, b):
  """a [m, n]^T @ b [m, c] -> float32 [n, c]."""
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
  block_q, D = q_BxD.shape

  def body(kb, carry, masked):
    acc_BxD, m_B, l_B = carry
    k_NxD = k_ref[pl.ds(kb * block_k, block_k), :]
    v_NxD = v_ref[pl.ds(kb * block_k, block_k), :]
    s_BxN = _dot_nt(q_BxD, k_NxD) * scale2
    if masked:
      s_BxN = jnp.where(_row_mask(lo_B, hi_B, kb, block_k), s_BxN, NEG_INF)
    m_new = jnp.maximum(m_B, jnp.max(s_BxN, axis=1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # a row that has seen nothing yet
    p_BxN = jnp.exp2(s_BxN - m_safe[:, None])
    alpha = jnp.exp2(m_B - m_safe)
    l_B = alpha * l_B + jnp.sum(p_BxN, axis=1)
    acc_BxD = alpha[:, None] * acc_BxD + _dot_nn(p_BxN.astype(v_NxD.dtype), v_NxD)
    return acc_BxD, m_new, l_B

  carry = (jnp.zeros((block_q, D), jnp.float32), jnp.full((block_q,), NEG_INF, jnp.float32),
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
    k_NxD = k_ref[pl.ds(kb * block_k, block_k), :]
    v_NxD = v_ref[pl.ds(kb * block_k, block_k), :]
    s_BxN = _dot_nt(q_BxD, k_NxD) * scale2
    if masked:
      s_BxN = jnp.where(_row_mask(lo_B, hi_B, kb, block_k), s_BxN, NEG_INF)
    p_BxN = jnp.exp2(s_BxN - lse2_B[:, None])
    ds_BxN = p_BxN * (_dot_nt(do_BxD, v_NxD) - delta_B[:, None])
    return dq_BxD + _dot_nn(ds_BxN.astype(k_NxD.dtype), k_NxD)

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
  k_NxD, v_NxD = k_ref[...], v_ref[...]
  block_k = k_NxD.shape[0]
  scale2 = scale * LOG2E
  cols_1xN = kb * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)

  def task_body(t, carry):
    qs, ql, ks, kl = qs_ref[t], ql_ref[t], ks_ref[t], kl_ref[t]
    qb_lo, f_lo, f_hi, qb_hi = task_q_blocks(qs, ql, ks, kl, kb, block_q, block_k)

    def body(qb, carry, g, masked):
      dk_NxD, dv_NxD = carry
      rows = pl.ds(qb * block_q, block_q)
      q_BxD, do_BxD = q_ref[rows, g, :], do_ref[rows, g, :]
      lse2_B, delta_B = lse2_ref[g, rows], delta_ref[g, rows]
      s_BxN = _dot_nt(q_BxD, k_NxD) * scale2
      if masked:
        r_Bx1 = qb * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        mask = ((r_Bx1 >= qs) & (r_Bx1 < qs + ql) & (cols_1xN >= ks)
                & (cols_1xN <= ks + kl - ql + (r_Bx1 - qs)))
        s_BxN = jnp.where(mask, s_BxN, NEG_INF)
      p_BxN = jnp.exp2(s_BxN - lse2_B[:, None])
      dv_NxD = dv_NxD + _dot_tn(p_BxN.astype(do_BxD.dtype), do_BxD)
      ds_BxN = p_BxN * (_dot_nt(do_BxD, v_NxD) - delta_B[:, None])
      dk_NxD = dk_NxD + _dot_tn(ds_BxN.astype(q_BxD.dtype), q_BxD)
      if fused:
        from jax.experimental.pallas import triton as plgpu
        dq_BxD = _dot_nn(ds_BxN.astype(k_NxD.dtype), k_NxD) * scale
        plgpu.atomic_add(dq_ref, (rows, jnp.int32(g), slice(None)), dq_BxD)
      return dk_NxD, dv_NxD

    for g in range(group):  # static: one walk per query head of the group
      carry = _three_runs(qb_lo, f_lo, f_hi, qb_hi,
                          lambda qb, c, masked, g=g: body(qb, c, g, masked), carry)
    return carry

  zeros = jnp.zeros(k_NxD.shape, jnp.float32)
  dk_NxD, dv_NxD = lax.fori_loop(t_lo_ref[0], t_hi_ref[0], task_body, (zeros, zeros))
  dk_ref[...] = (dk_NxD * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv_NxD.astype(dv_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "cfg", "interpret"))
def _backward(q_TxHxD, k_SxKxD, v_SxKxD, tasks, o_TxHxD, lse_HxT, do_TxHxD, dlse_HxT, scale,
              cfg: Config, interpret):
  """Padded-shape backward -> dQ, dK, dV in the inputs' dtypes."""
  T, H, D = q_TxHxD.shape
  S, K, _ = k_SxKxD.shape
  G = H // K
  lse2_HxT, delta_HxT = backward_stats(do_TxHxD, o_TxHxD, lse_HxT, dlse_HxT)

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
  Tp, Sp, tasks = padded(cfg, T, S, tasks)
  o, lse_HxT = _attention(pad_rows(q_TxHxD, Tp), pad_rows(k_SxKxD, Sp), pad_rows(v_SxKxD, Sp),
                          tasks, scale, cfg, bool(interpret))
  return o[:T], lse_HxT[:, :T].T
