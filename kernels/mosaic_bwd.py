"""Mosaic GPU attention backward (Hopper): dQ, dK and dV of a fused CA-task batch from one
kernel, FA3-style, fed the saved O and LSE of any backend's forward.

Why one kernel: our Triton and Pallas backwards run two (dQ over key blocks; dK/dV over query
blocks), 7 tile matmuls per visible tile where one kernel needs 5, and float32 atomics for dQ
cost more than they save (docs/PERFORMANCE.md, Kernels). Here each tile's dQ share goes to shared
memory and the TMA unit adds it into a float32 dQ in global memory (`cp.reduce.async.bulk`): one
bulk operation per tile, off the math warps.

One CTA per (key block of WGS · BLOCK_KV rows, KV head), the grid key block major, so the KV
heads of a key block run side by side and read the same query tiles. Two compute warpgroups each
own BLOCK_KV of the key rows (their dK and dV accumulators stay in registers and sum over the
group's query heads and over every task that sees the keys); a memory warpgroup streams the
query tiles that see the key block (Q, dO, LSE, delta and the rows' visible key ranges), one
(tile, query head) per step, through Pallas' warp-specialised pipeline with a per-CTA step
count. Per step each compute warpgroup:

1. issues S = Q Kᵀ and dP = dO Vᵀ together (`_scores_and_dp`);
2. masks P = exp(S − LSE) to each row's key range (`_probabilities`) and stages it in shared
   memory;
3. computes dS = P (dP − delta) while dV += Pᵀ dO runs, and stores dS in P's place (`_dv_and_ds`);
4. waits for the other warpgroup's dS while dK += dSᵀ Q runs (`_dk_and_wait`: an mbarrier of two
   arrivals, double-buffered by step parity);
5. computes its share of the tile's dQ = dS K over all WGS · BLOCK_KV keys and reduce-adds it
   (`_reduce_dq`): columns [D/2 · w, D/2 · (w+1)) for warpgroup w, or at D = 64, where half a row
   is less than a swizzle tile, whole steps' dQ in turn.

K's and V's wgmma descriptors are made in every step: hoisted out of the loop, ptxas spilled them
to local memory and reloaded them every step. The step's query tile index (a global load, for
dQ's rows) is read at the top of the step, under the first matmuls. Pallas' automatic warpgroup
barriers around every shared-memory store are off; the one the kernel needs is written out.

The tiles a key block visits come from the query-side block schedule (`blocks.py`): query tile i
sees key blocks [kb_lo, kb_hi) (the hull of its rows' ranges; every element is masked to its
row's range, so a tile that straddles two tasks is visited once and each (row, key) pair counts
once). The per-key-block lists are a dense [key blocks, query tiles] array (`visit_lists`).

Shapes: T query rows, S key rows, H query heads, K KV heads, G = H / K, D head dim; NK key blocks
and NQ query tiles. Costs a float32 [T, H, D] dQ buffer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .blocks import cdiv, query_schedule
from .common import LOG2E, pad_rows, row_delta, row_ranges, visible
from .tasks import TaskTable

WGS = 2          # compute warpgroups per CTA, each owning BLOCK_KV of its key rows
BLOCK_Q = 64     # query rows per step
BLOCK_KV = 64    # key rows per compute warpgroup (a CTA covers WGS * BLOCK_KV)
STAGES = 2       # query tiles in flight
# Registers of the memory warpgroup (the compute ones share the rest): fewer starve it, more
# take them from the compute warpgroups (docs/PERFORMANCE.md, Kernels).
MEMORY_REGISTERS = 24
TILE = (BLOCK_Q, BLOCK_KV)  # a step's score tile: [query rows, keys]


def unsupported(head_dim: int, dtype) -> str | None:
  """Why these kernels cannot run attention of this head dim and dtype, or None."""
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return f"the mosaic backward takes bf16 or fp16, not {jnp.dtype(dtype).name}"
  if head_dim not in (64, 128):  # 256 needs more shared memory than the card has with these tiles
    return f"the mosaic backward takes head dim 64 or 128, not {head_dim}"
  return None


def visit_lists(tasks: TaskTable, num_q_rows: int, num_kv_rows: int):
  """Per key block of WGS * BLOCK_KV rows: the query tiles that see it, in row order.

  Returns (tiles_NKxNQ int32: row kb lists its tiles in its first count[kb] entries, zeros after;
  count_NK; row_lo, row_hi [NQ * BLOCK_Q]: each query row's visible key range, from `blocks.py`).
  The lists come from a running count along each row and a scatter: a sort of each row gives the
  same arrays with a log factor more work."""
  sch = query_schedule(tasks, num_q_rows, BLOCK_Q, WGS * BLOCK_KV)
  nq = sch.kb_lo.shape[0]
  nk = cdiv(num_kv_rows, WGS * BLOCK_KV)
  kb_NKx1 = jnp.arange(nk, dtype=jnp.int32)[:, None]
  vis_NKxNQ = (kb_NKx1 >= sch.kb_lo[None]) & (kb_NKx1 < sch.kb_hi[None])
  qb_1xNQ = jnp.arange(nq, dtype=jnp.int32)[None]
  slot = jnp.where(vis_NKxNQ, jnp.cumsum(vis_NKxNQ, axis=1, dtype=jnp.int32) - 1, nq)  # nq: drop
  tiles_NKxNQ = jnp.zeros((nk, nq), jnp.int32).at[jnp.broadcast_to(kb_NKx1, (nk, nq)), slot].set(
      jnp.broadcast_to(qb_1xNQ, (nk, nq)), mode="drop")
  count_NK = jnp.sum(vis_NKxNQ, axis=1, dtype=jnp.int32)
  return tiles_NKxNQ, count_NK, sch.row_lo, sch.row_hi


def zeros_after(x, shape):
  """float32 zeros of `shape` that XLA can only make once `x` exists: a finite integer (the bits
  of x's first element) times 0.0, which XLA does not fold. A constant broadcast has no operands,
  and XLA fused every layer's float32 dQ zeros into one fusion at the start of the training step,
  all of them alive at its peak; made from each layer's dO they appear when its backward
  starts."""
  if x.size == 0:
    return jnp.zeros(shape, jnp.float32)
  bits = lax.bitcast_convert_type(x.reshape(-1)[0], jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
  return jnp.broadcast_to(bits.astype(jnp.float32) * 0.0, shape)


# ------------------------------------------------------------------------ a step's pieces


def _tr(ref):
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.transpose_ref(ref, (1, 0))


def _zeros(shape):
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _per_row(x):
  """A per-query-row vector broadcast over the keys of a score tile."""
  return lax.broadcast_in_dim(x, TILE, [0])


def _row_layout():
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.Layout.WGMMA.reduce(1)


def _warpgroup_barrier():
  """bar.sync of the calling warpgroup's 128 threads (Mosaic GPU's, which Pallas does not
  expose)."""
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.pallas import mosaic_gpu as plgpu

  plgpu.inline_mgpu()(lambda ctx: mgpu.warpgroup_barrier())()


def _scores_and_dp(q_smem, do_smem, k_smem, v_smem):
  """S = Q Kᵀ and dP = dO Vᵀ, float32 [BLOCK_Q, BLOCK_KV], issued together."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def s_dp(refs):
    plgpu.wgmma(refs[0], q_smem, _tr(k_smem))
    plgpu.wgmma(refs[1], do_smem, _tr(v_smem))

  return pl.run_state(s_dp)((plgpu.ACC.init(_zeros(TILE)), plgpu.ACC.init(_zeros(TILE))))


def _probabilities(s_tile, bound_smem, stat_smem, bound_done, key0, scale2: float):
  """P = exp2(S · scale2 − LSE₂) with each row masked to its visible key range [lo, lo + len)
  (from `bound_smem`, released through `bound_done`) on every tile: exact where a tile needs no
  mask, and cheaper than branching (a lax.cond around it spilled). One unsigned compare per
  element, and the scale and LSE as one FMA before the select."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  lo = plgpu.load(bound_smem.at[0], (), layout=_row_layout())
  length = plgpu.load(bound_smem.at[1], (), layout=_row_layout())
  plgpu.barrier_arrive(bound_done)
  col = key0 + plgpu.broadcasted_iota(jnp.int32, TILE, 1, layout=plgpu.Layout.WGMMA)
  seen = visible(col, _per_row(lo), _per_row(length))
  lse2 = plgpu.load(stat_smem.at[0], (), layout=_row_layout())
  return jnp.exp2(jnp.where(seen, s_tile * scale2 - _per_row(lse2), -jnp.inf))


def _dv_and_ds(dv, p, dp, ds_smem, do_smem, stat_smem):
  """dV += Pᵀ dO, P staged in `ds_smem` and read transposed by the matmul, with
  dS = P (dP − delta) computed while it runs and then stored in P's place. Returns dV."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  dtype = ds_smem.dtype
  ds_smem[...] = p.astype(dtype)
  plgpu.commit_smem()

  def dv_ds(dv_acc):
    plgpu.wgmma(dv_acc, _tr(ds_smem), do_smem)
    delta = plgpu.load(stat_smem.at[1], (), layout=_row_layout())
    ds = (p * (dp - _per_row(delta))).astype(dtype)
    plgpu.wgmma_wait(0)
    _warpgroup_barrier()  # every warp's share of dV's matmul has read P
    ds_smem[...] = ds
    plgpu.commit_smem()

  return pl.run_state(dv_ds)(plgpu.ACC.init(dv))


def _dk_and_wait(dk, ds_smem, q_smem, ds_bar):
  """dK += dSᵀ Q, waiting at `ds_bar` (WGS arrivals) for every warpgroup's dS of the step while
  the matmul runs. Returns dK."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def dk_mm(acc):
    plgpu.wgmma(acc, _tr(ds_smem), q_smem)
    plgpu.barrier_arrive(ds_bar)
    plgpu.barrier_wait(ds_bar)

  return pl.run_state(dk_mm)(plgpu.ACC.init(dk))


def _reduce_dq(ds_smems, k_smems, out_smem, dq_at, cols, width: int, scale: float):
  """dQ[rows, cols] += scale · dS K[:, cols] over every warpgroup's keys (`ds_smems`, `k_smems`:
  each warpgroup's dS and K tile), staged in `out_smem` and reduce-added by the TMA unit into
  `dq_at` (the Ref of dQ's rows and columns)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def dq_mm(acc):
    for ds_smem, k_smem in zip(ds_smems, k_smems):
      plgpu.wgmma(acc, ds_smem, k_smem.at[:, cols])
    return acc[...]

  dq = pl.run_scoped(dq_mm, plgpu.ACC((BLOCK_Q, width), jnp.float32))
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last reduce has read the buffer
  out_smem[...] = dq * scale
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, dq_at, reduction_op="add")


# ------------------------------------------------------------------------------- the kernel


def _cta(q_ref, k_ref, v_ref, do_ref, stats_ref, bounds_ref, tiles_ref, count_ref, dq_ref,
         dk_ref, dv_ref, smem, bars, *, group: int, scale: float):
  """One CTA: its key block's dK and dV over the query tiles of its list, dQ reduce-added."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  kb = lax.axis_index("kv_block")
  kh = lax.axis_index("kv_head")
  wg = lax.axis_index("wg")
  k_smem2, v_smem2, ds_smem, out_smem = smem
  kv_bar, ds_bar, end_bar = bars
  D = k_ref.shape[-1]
  dtype = k_ref.dtype
  key0 = kb * (WGS * BLOCK_KV) + wg * BLOCK_KV
  qb_of = lambda s: tiles_ref[kb, lax.div(s, group)]
  h_of = lambda s: kh * group + lax.rem(s, group)
  # dQ of a step: with D >= 128 each warpgroup computes a D / WGS column slice (a whole number of
  # 64-column swizzle tiles); at D = 64 the warpgroups take whole steps in turn (by step parity).
  split = D >= 64 * WGS
  assert split or WGS == 2, "taking steps in turn by parity needs two compute warpgroups"
  dq_cols = D // WGS if split else D

  def key_block(run):  # the pipeline's compute context: K, V in, dK, dV out
    k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
    keys = pl.ds(key0, BLOCK_KV)
    plgpu.copy_gmem_to_smem(k_ref.at[keys, kh], k_smem, kv_bar.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[keys, kh], v_smem, kv_bar.at[WGS + wg])
    plgpu.barrier_wait(kv_bar.at[wg])
    plgpu.barrier_wait(kv_bar.at[WGS + wg])
    dk, dv = run((_zeros((BLOCK_KV, D)), _zeros((BLOCK_KV, D))))
    # The other warpgroup's last dQ read this warpgroup's K tile: wait for it before reuse.
    plgpu.barrier_arrive(end_bar)
    plgpu.barrier_wait(end_bar)
    k_smem[...] = (dk * scale).astype(dtype)
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[keys, kh], commit_group=False)
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[keys, kh], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)

  def step(idx, q_smem, do_smem, stat_smem, bound_smem, q_done, do_done, stat_done, bound_done,
           carry):
    dk, dv = carry
    s = idx[0]
    par = lax.rem(s, 2)
    # wg_s == wg, through a barrier LLVM cannot see through: the wgmma descriptors made from it
    # stay in the step instead of being hoisted (and spilled).
    wg_s = lax.optimization_barrier(wg)
    k_smem, v_smem = k_smem2.at[wg_s], v_smem2.at[wg_s]
    rows = pl.ds(qb_of(s) * BLOCK_Q, BLOCK_Q)  # a global load, under the first matmuls
    s_tile, dp = _scores_and_dp(q_smem, do_smem, k_smem, v_smem)
    p = _probabilities(s_tile, bound_smem, stat_smem, bound_done, key0, scale * LOG2E)
    # P and dS share this parity's buffer: the other warpgroup read its dS two steps ago, before
    # the dS barrier of the step between.
    dv = _dv_and_ds(dv, p, dp, ds_smem.at[par, wg], do_smem, stat_smem)
    plgpu.barrier_arrive(do_done)
    plgpu.barrier_arrive(stat_done)
    dk = _dk_and_wait(dk, ds_smem.at[par, wg], q_smem, ds_bar.at[par])
    plgpu.barrier_arrive(q_done)
    for w in range(WGS):  # static column slices, one branch per warpgroup

      @pl.when((wg == w) if split else ((wg == w) & (par == w)))
      def _(w=w):
        cols = pl.ds(w * dq_cols if split else 0, dq_cols)
        _reduce_dq([ds_smem.at[par, src] for src in range(WGS)],
                   [k_smem2.at[src + (wg_s - wg)] for src in range(WGS)], out_smem.at[w],
                   dq_ref.at[rows, h_of(s), cols], cols, dq_cols, scale)

    return dk, dv

  tiles16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  pipeline = plgpu.emit_pipeline_warp_specialized(
      step, grid=(count_ref[kb] * group,), max_concurrent_steps=STAGES,
      num_compute_wgs=WGS, memory_registers=MEMORY_REGISTERS, wg_axis="wg",
      manual_consumed_barriers=True,
      compute_context=key_block,
      in_specs=[
          plgpu.BlockSpec((BLOCK_Q, D), lambda s: (qb_of(s), h_of(s)), transforms=tiles16),
          plgpu.BlockSpec((BLOCK_Q, D), lambda s: (qb_of(s), h_of(s)), transforms=tiles16),
          plgpu.BlockSpec((2, BLOCK_Q), lambda s: (h_of(s), qb_of(s))),
          plgpu.BlockSpec((2, BLOCK_Q), lambda s: (0, qb_of(s))),
      ])
  pipeline(q_ref, do_ref, stats_ref, bounds_ref)


def _scratch(D: int, dtype):
  """The CTA's shared memory and barriers. 194 KiB with the pipeline's Q / dO / statistics
  buffers at D = 128: under the 196 KiB carve-out less the driver's 1 KiB (a test keeps the
  line; more moves the card to a carve-out that leaves less L1)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  dq_cols = D // WGS if D >= 64 * WGS else D
  tiles16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  tiles32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
  smem = (
      plgpu.SMEM((WGS, BLOCK_KV, D), dtype, transforms=tiles16),             # K
      plgpu.SMEM((WGS, BLOCK_KV, D), dtype, transforms=tiles16),             # V
      plgpu.SMEM((2, WGS, *TILE), dtype, transforms=tiles16),  # P, then dS, by step parity
      plgpu.SMEM((WGS, BLOCK_Q, dq_cols), jnp.float32, transforms=tiles32),  # dQ reduce staging
  )
  bars = (plgpu.Barrier(num_barriers=2 * WGS),                  # K and V loaded
          plgpu.Barrier(num_arrivals=WGS, num_barriers=2),      # both dS stored, by parity
          plgpu.Barrier(num_arrivals=WGS))                      # both warpgroups' last dQ done
  return smem, bars


def _launch(q_TxHD, k_SxKxD, v_SxKxD, do_TxHD, stats_2HxT, bounds_2xT, tiles_NKxNQ, count_NK,
            dq_ref, *, heads: int, scale: float):
  """The kernel over the first count[kb] tiles of each key block's list: adds dQ into the float32
  Ref, returns dK and dV."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  S, K, D = k_SxKxD.shape
  smem, bars = _scratch(D, k_SxKxD.dtype)
  cta = functools.partial(_cta, group=heads // K, scale=scale)

  def kernel(*refs):  # plgpu.kernel less its vmap wrapper, which refuses Ref operands
    pl.run_scoped(functools.partial(cta, *refs), smem, bars, collective_axes="wg")

  mesh = plgpu.Mesh(grid=(S // (WGS * BLOCK_KV), K), grid_names=("kv_block", "kv_head"),
                    num_threads=WGS + 1, thread_name="wg")
  # Without Pallas' automatic barriers every other shared-memory store is safe as written: P
  # (after two steps and the dS barrier between), the dQ staging (wait_smem_to_gmem ends in a
  # warpgroup barrier) and dK / dV (after end_bar) overwrite what no warp still reads, and
  # commit_smem's fence and barrier publish each one before a matmul or copy reads it.
  params = plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True)
  return pl.kernel(kernel, out_type=[jax.ShapeDtypeStruct(k_SxKxD.shape, k_SxKxD.dtype)] * 2,
                   mesh=mesh, compiler_params=params, name="ca_tasks_bwd")(
      q_TxHD, k_SxKxD, v_SxKxD, do_TxHD, stats_2HxT, bounds_2xT, tiles_NKxNQ, count_NK, dq_ref)


@functools.partial(jax.jit, static_argnames=("scale",))
def backward_from_stats(q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, o_TxHxD, lse_TxH, do_TxHxD,
                        dlse_TxH, scale: float):
  """dQ, dK, dV from saved O and LSE (any backend's forward), in the inputs' dtypes. Jitted so
  that every call site of a model shares one lowering of the kernel (`mosaic.py`)."""
  T, H, D = q_TxHxD.shape
  S, K, _ = k_SxKxD.shape
  why = unsupported(D, q_TxHxD.dtype)
  if why:
    raise ValueError(why)
  if H % K:
    raise ValueError(f"GQA: {H} query heads are not a multiple of {K} KV heads")
  Tp = cdiv(T, BLOCK_Q) * BLOCK_Q
  Sp = cdiv(S, WGS * BLOCK_KV) * WGS * BLOCK_KV
  f32 = jnp.float32
  lse_HxT = pad_rows(lse_TxH, Tp).T
  lse2_HxT = jnp.where(jnp.isfinite(lse_HxT), lse_HxT * LOG2E, 0.0).astype(f32)
  delta_HxT = pad_rows(row_delta(do_TxHxD, o_TxHxD) - dlse_TxH.astype(f32), Tp).T
  tiles_NKxNQ, count_NK, row_lo, row_hi = visit_lists(tasks, Tp, Sp)
  # Inputs as the kernel's TMA tiles read them: Q and dO [T, H * D] (a tile is 64 rows of one
  # head), LSE and delta interleaved per head [2H, T], the rows' key ranges [2, T] as start and
  # length.
  args = (pad_rows(q_TxHxD, Tp).reshape(Tp, H * D), pad_rows(k_SxKxD, Sp),
          pad_rows(v_SxKxD, Sp), pad_rows(do_TxHxD, Tp).reshape(Tp, H * D),
          jnp.stack([lse2_HxT, delta_HxT], axis=1).reshape(2 * H, Tp),
          row_ranges(row_lo, row_hi), tiles_NKxNQ)
  # dQ is reduced into a float32 buffer, so it starts as zeros (a Ref operand is aliased in and
  # out of the kernel).
  dq = jax.new_ref(zeros_after(do_TxHxD, (Tp, H, D)))
  dk, dv = _launch(*args, count_NK, dq, heads=H, scale=float(scale))
  return dq[...][:T].astype(q_TxHxD.dtype), dk[:S], dv[:S]
