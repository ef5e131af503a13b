"""Triton backend (GPU): the block-sparse CA-task flash attention written in Triton, called through
jax-triton. Same algorithm, schedules (`blocks.py`) and guarantees as `pallas.py`; written directly
in Triton so that tile-level details (int64 addressing, loop structure, launch order) are ours
rather than the Pallas lowering's.

Kernels: forward and dQ with grid (query block, query head), heaviest query blocks first; dK/dV
with grid (key block, KV head), looping over tasks and over the query heads of the group, so
group and shared-prefix sums happen in registers. Row-major [rows, heads, D] layouts as given, no
transposes. Requires `jax_triton` (and `triton`); fp32 inputs use TF32 dots (tests hold fp32 to
1e-5 on CPU only).

Shapes: T query rows, S key rows, H query heads, KH (launchers: K) KV heads, D head dim; BQ and
BK rows of a query and a key block. In-kernel tiles are named by role (q, k, s, p, ...) and are
[BQ, D], [BK, D], [BQ, BK] as in `pallas.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from .blocks import key_task_ranges, query_schedule
from .common import LOG2E, Config, backward_stats, gpu_config, pad_rows, padded
from .tasks import TaskTable


def _jt():
  import jax_triton as jt
  return jt


# ------------------------------------------------------------------------------------ kernels


@triton.jit
def _scores(q, k_base, v_base, kb, lo, hi, scale2, k_stride, D: tl.constexpr, BK: tl.constexpr,
            MASKED: tl.constexpr):
  """Key block kb's K and V [BK, D] and the query block's scores S = Q K^T * scale2 [BQ, BK], each
  row's masked to its keys [lo, hi) when MASKED."""
  cols = kb * BK + tl.arange(0, BK)
  dd = tl.arange(0, D)
  offs = cols.to(tl.int64)[:, None] * k_stride + dd[None, :]
  k = tl.load(k_base + offs)
  v = tl.load(v_base + offs)
  s = tl.dot(q, tl.trans(k)) * scale2
  if MASKED:
    s = tl.where((cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None]), s,
                 float("-inf"))
  return s, k, v


@triton.jit
def _query_block(Q, LO, HI, KB, NQ: tl.constexpr, H: tl.constexpr, KH: tl.constexpr,
                 D: tl.constexpr, BQ: tl.constexpr):
  """The program's query block (heaviest, longest-prefix, first) and head: (head, its KV head,
  the block's rows, their offsets into [T, H, D], Q [BQ, D], each row's keys [lo, hi), and the
  block's key-block runs kb_lo <= kb_full_lo <= kb_full_hi <= kb_hi)."""
  qb = NQ - 1 - tl.program_id(0)
  h = tl.program_id(1)
  kh = h // (H // KH)
  rows = qb * BQ + tl.arange(0, BQ)
  dd = tl.arange(0, D)
  q_offs = (rows.to(tl.int64)[:, None] * H + h) * D + dd[None, :]
  q = tl.load(Q + q_offs)
  lo = tl.load(LO + rows)
  hi = tl.load(HI + rows)
  kb_lo = tl.load(KB + qb * 4)
  kb_flo = tl.load(KB + qb * 4 + 1)
  kb_fhi = tl.load(KB + qb * 4 + 2)
  kb_hi = tl.load(KB + qb * 4 + 3)
  return h, kh, rows, q_offs, q, lo, hi, kb_lo, kb_flo, kb_fhi, kb_hi


@triton.jit
def _fwd_step(acc, m, l, q, k_base, v_base, kb, lo, hi, scale2, k_stride,
              D: tl.constexpr, BK: tl.constexpr, MASKED: tl.constexpr):
  s, k, v = _scores(q, k_base, v_base, kb, lo, hi, scale2, k_stride, D, BK, MASKED)
  m_new = tl.maximum(m, tl.max(s, 1))
  m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
  p = tl.math.exp2(s - m_safe[:, None])
  alpha = tl.math.exp2(m - m_safe)
  l = alpha * l + tl.sum(p, 1)
  acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
  return acc, m_new, l


@triton.jit
def _fwd_kernel(Q, K, V, LO, HI, KB, O, LSE, scale2: tl.constexpr, T: tl.constexpr,
                NQ: tl.constexpr, H: tl.constexpr, KH: tl.constexpr, D: tl.constexpr,
                BQ: tl.constexpr, BK: tl.constexpr):
  h, kh, rows, q_offs, q, lo, hi, kb_lo, kb_flo, kb_fhi, kb_hi = _query_block(
      Q, LO, HI, KB, NQ, H, KH, D, BQ)
  acc = tl.zeros([BQ, D], tl.float32)
  m = tl.full([BQ], float("-inf"), tl.float32)
  l = tl.zeros([BQ], tl.float32)
  k_base = K + kh * D
  v_base = V + kh * D
  for kb in range(kb_lo, kb_flo):
    acc, m, l = _fwd_step(acc, m, l, q, k_base, v_base, kb, lo, hi, scale2, KH * D, D, BK, True)
  for kb in range(kb_flo, kb_fhi):
    acc, m, l = _fwd_step(acc, m, l, q, k_base, v_base, kb, lo, hi, scale2, KH * D, D, BK, False)
  for kb in range(kb_fhi, kb_hi):
    acc, m, l = _fwd_step(acc, m, l, q, k_base, v_base, kb, lo, hi, scale2, KH * D, D, BK, True)
  live = l > 0
  l_safe = tl.where(live, l, 1.0)
  tl.store(O + q_offs, (acc / l_safe[:, None]).to(O.dtype.element_ty))
  tl.store(LSE + h * T + rows, tl.where(live, (m + tl.math.log2(l_safe)) * 0.6931471805599453,
                                        float("-inf")))


@triton.jit
def _dq_step(dq, q, do, lse2, delta, k_base, v_base, kb, lo, hi, scale2, k_stride,
             D: tl.constexpr, BK: tl.constexpr, MASKED: tl.constexpr):
  s, k, v = _scores(q, k_base, v_base, kb, lo, hi, scale2, k_stride, D, BK, MASKED)
  p = tl.math.exp2(s - lse2[:, None])
  ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
  return dq + tl.dot(ds.to(k.dtype), k)


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE2, DELTA, LO, HI, KB, DQ, scale: tl.constexpr, T: tl.constexpr,
               NQ: tl.constexpr, H: tl.constexpr, KH: tl.constexpr, D: tl.constexpr,
               BQ: tl.constexpr, BK: tl.constexpr):
  h, kh, rows, q_offs, q, lo, hi, kb_lo, kb_flo, kb_fhi, kb_hi = _query_block(
      Q, LO, HI, KB, NQ, H, KH, D, BQ)
  do = tl.load(DO + q_offs)
  lse2 = tl.load(LSE2 + h * T + rows)
  delta = tl.load(DELTA + h * T + rows)
  scale2 = scale * 1.4426950408889634
  dq = tl.zeros([BQ, D], tl.float32)
  k_base = K + kh * D
  v_base = V + kh * D
  for kb in range(kb_lo, kb_flo):
    dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, kb, lo, hi, scale2, KH * D, D, BK, True)
  for kb in range(kb_flo, kb_fhi):
    dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, kb, lo, hi, scale2, KH * D, D, BK,
                  False)
  for kb in range(kb_fhi, kb_hi):
    dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, kb, lo, hi, scale2, KH * D, D, BK, True)
  tl.store(DQ + q_offs, (dq * scale).to(DQ.dtype.element_ty))


@triton.jit
def _dkv_step(dk, dv, k, v, Q, DO, LSE2, DELTA, DQ, qb, h, cols, qs, ql, ks, kl, scale2,
              T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr,
              MASKED: tl.constexpr, FUSED: tl.constexpr):
  rows = qb * BQ + tl.arange(0, BQ)
  dd = tl.arange(0, D)
  q_offs = (rows.to(tl.int64)[:, None] * H + h) * D + dd[None, :]
  q = tl.load(Q + q_offs)
  do = tl.load(DO + q_offs)
  lse2 = tl.load(LSE2 + h * T + rows)
  delta = tl.load(DELTA + h * T + rows)
  s = tl.dot(q, tl.trans(k)) * scale2
  if MASKED:
    r = rows[:, None]
    c = cols[None, :]
    s = tl.where((r >= qs) & (r < qs + ql) & (c >= ks) & (c <= ks + kl - ql + (r - qs)), s,
                 float("-inf"))
  p = tl.math.exp2(s - lse2[:, None])
  dv += tl.dot(tl.trans(p.to(do.dtype)), do)
  ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
  dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
  if FUSED:  # this tile's share of dQ; scale2 * ln 2 is the softmax scale
    tl.atomic_add(DQ + q_offs, tl.dot(ds.to(k.dtype), k) * (scale2 * 0.6931471805599453),
                  sem="relaxed")
  return dk, dv


@triton.jit
def _dkv_step_t(dk, dv, k, v, Q, DO, LSE2, DELTA, qb, h, cols, qs, ql, ks, kl, scale2,
                T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr,
                MASKED: tl.constexpr):
  """`_dkv_step` computed transposed (S^T = K Q^T, as the Triton tutorial's backward does): P^T
  and dS^T come out of their matmuls in the layout the next matmul takes as its register operand,
  so no register tensor is transposed."""
  rows = qb * BQ + tl.arange(0, BQ)
  dd = tl.arange(0, D)
  rows64 = rows.to(tl.int64)
  qT = tl.load(Q + (rows64[None, :] * H + h) * D + dd[:, None])
  do = tl.load(DO + (rows64[:, None] * H + h) * D + dd[None, :])
  lse2 = tl.load(LSE2 + h * T + rows)
  delta = tl.load(DELTA + h * T + rows)
  sT = tl.dot(k, qT) * scale2
  if MASKED:
    r = rows[None, :]
    c = cols[:, None]
    sT = tl.where((r >= qs) & (r < qs + ql) & (c >= ks) & (c <= ks + kl - ql + (r - qs)), sT,
                  float("-inf"))
  pT = tl.math.exp2(sT - lse2[None, :])
  dv += tl.dot(pT.to(do.dtype), do)
  dsT = pT * (tl.dot(v, tl.trans(do)) - delta[None, :])
  dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT))
  return dk, dv


@triton.jit
def _dkv_tile(dk, dv, k, v, Q, DO, LSE2, DELTA, DQ, qb, h, cols, qs, ql, ks, kl, scale2,
              T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr,
              MASKED: tl.constexpr, FUSED: tl.constexpr, TRANS: tl.constexpr):
  if TRANS:
    dk, dv = _dkv_step_t(dk, dv, k, v, Q, DO, LSE2, DELTA, qb, h, cols, qs, ql, ks, kl, scale2,
                         T, H, D, BQ, MASKED)
  else:
    dk, dv = _dkv_step(dk, dv, k, v, Q, DO, LSE2, DELTA, DQ, qb, h, cols, qs, ql, ks, kl, scale2,
                       T, H, D, BQ, MASKED, FUSED)
  return dk, dv


@triton.jit
def _dkv_kernel(Q, K, V, DO, LSE2, DELTA, TLO, THI, QS, QL, KS, KL, DK, DV, DQ,
                scale: tl.constexpr, T: tl.constexpr, H: tl.constexpr, KH: tl.constexpr,
                D: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, FUSED: tl.constexpr,
                TRANS: tl.constexpr):
  kb = tl.program_id(0)  # key block 0 first: under causal masks it is seen by the most rows
  kh = tl.program_id(1)
  G: tl.constexpr = H // KH
  cols = kb * BK + tl.arange(0, BK)
  dd = tl.arange(0, D)
  kv_offs = (cols.to(tl.int64)[:, None] * KH + kh) * D + dd[None, :]
  k = tl.load(K + kv_offs)
  v = tl.load(V + kv_offs)
  scale2 = scale * 1.4426950408889634
  dk = tl.zeros([BK, D], tl.float32)
  dv = tl.zeros([BK, D], tl.float32)
  k0 = kb * BK
  k1 = k0 + BK
  for t in range(tl.load(TLO + kb), tl.load(THI + kb)):
    qs = tl.load(QS + t)
    ql = tl.load(QL + t)
    ks = tl.load(KS + t)
    kl = tl.load(KL + t)
    # blocks.task_q_blocks, inline (all quantities >= 0 where divided).
    q_end = qs + ql
    shift = ks + kl - ql
    first_row = qs + tl.maximum(tl.maximum(k0, ks) - shift, 0)
    hit = (ql > 0) & (k0 < ks + kl) & (k1 > ks) & (first_row < q_end)
    qb_lo = tl.where(hit, first_row // BQ, 0)
    qb_hi = tl.where(hit, (q_end + BQ - 1) // BQ, 0)
    full_lo = tl.maximum(tl.maximum((qs + BQ - 1) // BQ,
                                    (qs + tl.maximum(k1 - 1 - shift, 0) + BQ - 1) // BQ), qb_lo)
    full_ok = hit & (k0 >= ks)
    f_lo = tl.where(full_ok, tl.minimum(full_lo, qb_hi), qb_lo)
    f_hi = tl.where(full_ok, tl.maximum(tl.minimum(q_end // BQ, qb_hi), f_lo), f_lo)
    for g in tl.static_range(G):
      h = kh * G + g
      for qb in range(qb_lo, f_lo):
        dk, dv = _dkv_tile(dk, dv, k, v, Q, DO, LSE2, DELTA, DQ, qb, h, cols, qs, ql, ks, kl,
                           scale2, T, H, D, BQ, True, FUSED, TRANS)
      for qb in range(f_lo, f_hi):
        dk, dv = _dkv_tile(dk, dv, k, v, Q, DO, LSE2, DELTA, DQ, qb, h, cols, qs, ql, ks, kl,
                           scale2, T, H, D, BQ, False, FUSED, TRANS)
      for qb in range(f_hi, qb_hi):
        dk, dv = _dkv_tile(dk, dv, k, v, Q, DO, LSE2, DELTA, DQ, qb, h, cols, qs, ql, ks, kl,
                           scale2, T, H, D, BQ, True, FUSED, TRANS)
  tl.store(DK + kv_offs, (dk * scale).to(DK.dtype.element_ty))
  tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty))


# ---------------------------------------------------------------------------------- launchers


def _kb4(sch):
  return jnp.stack([sch.kb_lo, sch.kb_full_lo, sch.kb_full_hi, sch.kb_hi], axis=1).reshape(-1)


@functools.partial(jax.jit, static_argnames=("scale", "cfg"))
def _forward(q, k, v, tasks, scale, cfg: Config):
  T, H, D = q.shape
  S, K, _ = k.shape
  bq, bk = cfg.block_q, cfg.block_k
  nq = T // bq
  sch = query_schedule(tasks, T, bq, bk)
  o, lse_HxT = _jt().triton_call(
      q, k, v, sch.row_lo, sch.row_hi, _kb4(sch), kernel=_fwd_kernel,
      out_shape=[jax.ShapeDtypeStruct((T, H, D), q.dtype),
                 jax.ShapeDtypeStruct((H, T), jnp.float32)],
      grid=(nq, H), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
      scale2=scale * LOG2E, T=T, NQ=nq, H=H, KH=K, D=D, BQ=bq, BK=bk)
  return o, lse_HxT


@functools.partial(jax.jit, static_argnames=("scale", "cfg"))
def _backward(q, k, v, tasks, o, lse_HxT, do, dlse_HxT, scale, cfg: Config):
  T, H, D = q.shape
  S, K, _ = k.shape
  jt = _jt()
  lse2_HxT, delta_HxT = backward_stats(do, o, lse_HxT, dlse_HxT)
  if not cfg.fused_bwd:
    bq, bk = cfg.block_q_dq, cfg.block_k_dq
    nq = T // bq
    sch = query_schedule(tasks, T, bq, bk)
    dq = jt.triton_call(
        q, k, v, do, lse2_HxT, delta_HxT, sch.row_lo, sch.row_hi, _kb4(sch), kernel=_dq_kernel,
        out_shape=jax.ShapeDtypeStruct((T, H, D), q.dtype), grid=(nq, H),
        num_warps=cfg.num_warps_dq or cfg.num_warps_bwd,
        num_stages=cfg.num_stages_dq or cfg.num_stages_bwd,
        scale=scale, T=T, NQ=nq, H=H, KH=K, D=D, BQ=bq, BK=bk)
  bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
  t_lo, t_hi = key_task_ranges(tasks, S, bq, bk)
  # The fused variant's dQ buffer is float32 and zeroed by jax-triton before the launch.
  dq_shape = (T, H, D) if cfg.fused_bwd else (1,)
  dk, dv, dq32 = jt.triton_call(
      q, k, v, do, lse2_HxT, delta_HxT, t_lo, t_hi, *tasks, kernel=_dkv_kernel,
      out_shape=[jax.ShapeDtypeStruct((S, K, D), k.dtype),
                 jax.ShapeDtypeStruct((S, K, D), v.dtype),
                 jax.ShapeDtypeStruct(dq_shape, jnp.float32)],
      grid=(S // bk, K), num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd,
      zeroed_outputs=(2,) if cfg.fused_bwd else (),
      scale=scale, T=T, H=H, KH=K, D=D, BQ=bq, BK=bk, FUSED=cfg.fused_bwd,
      TRANS=cfg.bwd_transposed)
  if cfg.fused_bwd:
    dq = dq32.astype(q.dtype)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, tasks, scale, cfg):
  return _forward(q, k, v, tasks, scale, cfg)


def _attention_fwd(q, k, v, tasks, scale, cfg):
  o, lse_HxT = _forward(q, k, v, tasks, scale, cfg)
  return (o, lse_HxT), (q, k, v, tasks, o, lse_HxT)


def _attention_bwd(scale, cfg, res, cts):
  q, k, v, tasks, o, lse_HxT = res
  do, dlse_HxT = cts
  dq, dk, dv = _backward(q, k, v, tasks, o, lse_HxT, do, dlse_HxT.astype(jnp.float32), scale, cfg)
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, *, scale: float | None = None,
              config: Config | None = None):
  """O [T, H, D] in q's dtype and LSE [T, H] float32 (natural log; -inf for uncovered rows).
  GPU only; D must be a power of two (Triton tile shapes)."""
  T, H, D = q_TxHxD.shape
  S, K, _ = k_SxKxD.shape
  if H % K:
    raise ValueError(f"GQA: {H} query heads are not a multiple of {K} KV heads")
  if D & (D - 1):
    raise ValueError(f"triton backend: head dim {D} is not a power of two")
  cfg = config or gpu_config(D)
  if cfg.fused_bwd and cfg.bwd_transposed:
    raise ValueError("triton backend: fused_bwd and bwd_transposed cannot be combined")
  scale = D ** -0.5 if scale is None else float(scale)
  Tp, Sp, tasks = padded(cfg, T, S, tasks)
  o, lse_HxT = _attention(pad_rows(q_TxHxD, Tp), pad_rows(k_SxKxD, Sp),
                          pad_rows(v_SxKxD, Sp), tasks, scale, cfg)
  return o[:T], lse_HxT[:, :T].T
