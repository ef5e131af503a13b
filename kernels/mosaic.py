"""Mosaic GPU attention (Hopper) over a fused CA-task batch: a forward after JAX's `attention_mgpu`
(`forward_persistent`, the default: one CTA per SM looping over query tiles; `forward`, a CTA per
tile), and dQ, dK and dV from one kernel, FA3-style (`backward_from_stats`).

The `mosaic` backend is this pair (no jax-triton needed); `Options(forward="triton")` puts our
Triton forward before this backward, and the `cudnn` backend takes the backward as
`backward="mosaic"`. H100, head dim 128, same process (docs/PERFORMANCE.md): forward+backward
0.91-0.94x dense cuDNN causal attention by busy GPU time on five of the benchmark's eight batches
(Pretrain 64K / 128K / 512K, ProLong 256K / 512K) and 0.83-0.87x on the three whose CTAs are
shortest (ProLong 64K / 128K, Pretrain 256K; the forward is level with cuDNN's or ahead, the
backward is the gap), against the Triton pair's 0.67-0.76x.

Why one kernel: our Triton and Pallas backwards run two (dQ over key blocks; dK/dV over query
blocks), 7 tile matmuls per visible tile where one kernel needs 5, and float32 atomics for dQ
cost more than they save (docs/PERFORMANCE.md, Kernels). Here each tile's dQ share goes to shared
memory and the TMA unit adds it into a float32 dQ in global memory (`cp.reduce.async.bulk`): one
bulk operation per tile, off the math warps.

One CTA per (128 key rows, KV head). Two compute warpgroups each own 64 of the key rows (their dK
and dV accumulators stay in registers and sum over the group's query heads and over every task
that sees the keys); a memory warpgroup streams the 64-row query tiles that see the key block
(Q, dO, LSE, delta and the rows' visible key ranges), one (tile, query head) per step, through
Pallas' warp-specialised pipeline with a per-CTA step count. Per step each compute warpgroup
issues S = Q Kᵀ and dP = dO Vᵀ together, masks P = exp(S − LSE) to each row's key range and
stores it to shared memory, computes dS = P (dP − delta) while dV += Pᵀ dO runs, stores dS in P's
place, and waits for the other warpgroup's dS while dK += dSᵀ Q runs (an mbarrier of two
arrivals, double-buffered by step parity); then warpgroup w computes columns [D/2 · w,
D/2 · (w+1)) of the tile's dQ = dS K over all 128 keys and reduce-adds them (at D = 64, where
half a row is less than a swizzle tile, the warpgroups take whole steps' dQ in turn). K's and V's
wgmma descriptors are made in every step: hoisted out of the loop, ptxas spilled them to local
memory and reloaded them every step. The kernel spills nothing (ptxas, H100).

The tiles a key block visits come from the query-side block schedule (`blocks.py`): query tile i
sees key blocks [kb_lo, kb_hi) (the hull of its rows' ranges; every element is masked to its
row's range, so a tile that straddles two tasks is visited once and each (row, key) pair counts
once). The per-key-block lists are a dense [key blocks, query tiles] array: S · T / 8192 int32
(8 MB at 128K rows).

Conventions as the other backends: O, natural-log LSE in; rows outside every task (LSE = -inf)
get zero gradients. Head dims 64 and 128 (at 256 these tiles need more shared memory than a
Hopper card has), bf16 or fp16, Hopper (wgmma, TMA). Costs a float32 [T, H, D] dQ buffer. The
GPU tests compare it with the float64 oracle; on the CPU a test lowers it for CUDA (layouts,
transforms, barriers, pipelines; the PTX is made on the GPU).
"""

from __future__ import annotations

import functools
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .blocks import cdiv, query_schedule
from .pallas import _pad_rows, row_delta
from .tasks import TaskTable

LOG2E = math.log2(math.e)
WGS = 2          # compute warpgroups per CTA
BLOCK_Q = 64     # query rows per step
BLOCK_KV = 64    # key rows per compute warpgroup (a CTA covers WGS * BLOCK_KV)
STAGES = 2       # query tiles in flight


class Options(NamedTuple):
  """Kernel variants (`launch/bench_kernels.py --tune mosaic` times them against each other)."""

  forward: str = "mosaic"  # `forward` below; "triton": our Triton forward (jax-triton)
  stages: int = STAGES
  kv_major: bool = True  # grid (key block, KV head): the KV heads of a key block side by side read
                         # the same query tiles; 2.6-3.6% faster than (KV head, key block), H100
  memory_registers: int = 24  # registers of the memory warpgroup (the compute ones share the
                              # rest): 24 +1.7% over 40, 56 -20% (H100, when the kernel spilled);
                              # 32 ran past a 300 s limit once (not understood: not offered)
  kq_scores: bool = False  # True: the backward's score tile transposed, Sᵀ = K Qᵀ [keys,
                          # queries], P and dS feeding dV and dK from registers (16 registers a
                          # thread per query-row vector); False: S = Q Kᵀ [queries, keys] (2
                          # registers a row vector), its S and dP matmuls issued together, P
                          # and dS through dS's shared-memory buffer, dS computed under dV's
                          # matmul: +4-5% backward with step_descriptors, +2-5% more for the
                          # overlap (H100)
  step_descriptors: bool = True  # K's and V's wgmma descriptors made inside every step (from
                                 # the warpgroup index through an optimization barrier): hoisted
                                 # out of the loop by LLVM, ptxas spilled them to local memory
                                 # and reloaded them every step; +4% backward (H100)
  dk_under_barrier: bool = True  # wait for the other warpgroup's dS while the dK matmul runs:
                                 # +12% backward on Pretrain 64K, +5% ProLong (H100, same
                                 # process; with the S = Q Kᵀ tile's S and dP matmuls issued
                                 # together and dS under dV's, +15% / +7%)
  lists_by_scan: bool = True  # the backward's visit lists from a running count and a scatter
                              # (`visit_lists`; the same lists as a sort of each key block's
                              # row, False): the sort took 0.10 / 0.48 ms a call on ProLong
                              # 128K / Pretrain 256K, the scan 0.02 / 0.07 (H200)
  fwd_ctas: int = -1  # -1: one persistent forward CTA per SM looping over (query tile, head)
                      # units (`forward_persistent`); N: N of them; 0: a CTA per unit
                      # (`forward`). -1 over 0, forward by busy GPU time: +2.4-9.8% on five
                      # of six batches, level on Pretrain 512K (H100, same process). The
                      # Mosaic forward's only (forward="triton" has its own grid)
  explicit_barriers: bool = True  # the backward compiled without Pallas' automatic warpgroup
                                  # barriers around every shared-memory store (one before and
                                  # one after each, beside commit_smem's own), with the one the
                                  # kernel needs written out (dS overwrites P while the other
                                  # warps' dV matmul may still read it): backward +1.2% ProLong
                                  # 64K, +1.7% Pretrain 64K alone (H200, same process)
  early_tile_index: bool = True  # the step's query tile index (a global load, for dQ's rows)
                                 # read at the top of the step, under the S and dP matmuls, not
                                 # where dQ is reduced (Nsight Compute: its latency was ~2% of
                                 # the compute warps' stall samples): backward +3.4% / +5.9%
                                 # alone; the two: +4.0% / +8.7% backward by wall time, +1.3% /
                                 # +2.3% f+b by busy GPU time in a second process (H200)
  fwd_heavy_first: bool = True  # forward CTAs in descending order of their key blocks, so the
                                # short ones fill the launch's tail: +2.6-3% forward on ProLong
                                # 64K, none on Pretrain (H100)


def parse_options(spec: str) -> Options:
  """Options from "key=value+key=value" (booleans as true / false), as the launchers' backend
  names `mosaic:key=value` give them; an unknown key or a bad value is an error."""
  opts = Options()
  for field in (f for f in spec.split("+") if f):
    key, _, val = field.partition("=")
    if key not in Options._fields:
      raise ValueError(f"mosaic option {key!r}: choose from {', '.join(Options._fields)}")
    old = getattr(opts, key)
    if isinstance(old, bool):
      if val.lower() not in ("1", "true", "0", "false"):
        raise ValueError(f"mosaic option {key}={val!r}: give true or false")
      opts = opts._replace(**{key: val.lower() in ("1", "true")})
    else:
      try:
        opts = opts._replace(**{key: type(old)(val)})
      except ValueError:
        raise ValueError(f"mosaic option {key}={val!r}: not a {type(old).__name__}") from None
  return opts


def unsupported(head_dim: int, dtype) -> str | None:
  """Why these kernels cannot run attention of this head dim and dtype, or None."""
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return f"the mosaic backward takes bf16 or fp16, not {jnp.dtype(dtype).name}"
  if head_dim not in (64, 128):  # 256 needs more shared memory than the card has with these tiles
    return f"the mosaic backward takes head dim 64 or 128, not {head_dim}"
  return None


def visit_lists(tasks: TaskTable, num_q_rows: int, num_kv_rows: int, by_scan: bool = True):
  """Per key block of WGS * BLOCK_KV rows: the query tiles that see it, in row order.

  Returns (tiles [nk, nq] int32: row kb lists its tiles in its first count[kb] entries, zeros
  after; count [nk]; row_lo, row_hi [nq * BLOCK_Q]: each query row's visible key range, from
  `blocks.py`). The lists come from a running count along each row and a scatter (`by_scan`), or
  from a sort of each row (unseen tiles last): the same arrays, the scan without the sort's log
  factor."""
  sch = query_schedule(tasks, num_q_rows, BLOCK_Q, WGS * BLOCK_KV)
  nq = sch.kb_lo.shape[0]
  nk = cdiv(num_kv_rows, WGS * BLOCK_KV)
  kb = jnp.arange(nk, dtype=jnp.int32)[:, None]
  vis = (kb >= sch.kb_lo[None]) & (kb < sch.kb_hi[None])
  qb = jnp.arange(nq, dtype=jnp.int32)[None]
  if by_scan:
    slot = jnp.where(vis, jnp.cumsum(vis, axis=1, dtype=jnp.int32) - 1, nq)  # nq: dropped
    tiles = jnp.zeros((nk, nq), jnp.int32).at[jnp.broadcast_to(kb, (nk, nq)), slot].set(
        jnp.broadcast_to(qb, (nk, nq)), mode="drop")
  else:
    tiles = jnp.sort(jnp.where(vis, qb, nq), axis=1) % nq  # unseen tiles sort last
  return tiles.astype(jnp.int32), jnp.sum(vis, axis=1, dtype=jnp.int32), sch.row_lo, sch.row_hi


def _row_ranges(row_lo, row_hi):
  """[2, T] int32: each row's visible key range as start and length, the length clamped at 0
  (the kernels' unsigned compare would read a negative one as every key)."""
  return jnp.stack([row_lo, jnp.maximum(row_hi - row_lo, 0)])


def _visible(keys, lo, length):
  """lo <= keys < lo + length as one unsigned compare per element (in-kernel arrays)."""
  u32 = lambda x: lax.bitcast_convert_type(x, jnp.uint32)
  return u32(keys - lo) < u32(length)


def _warpgroup_barrier():
  """bar.sync of the calling warpgroup's 128 threads (Mosaic GPU's, which Pallas does not
  expose)."""
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.pallas import mosaic_gpu as plgpu

  plgpu.inline_mgpu()(lambda ctx: mgpu.warpgroup_barrier())()


def _launch(q_TxHD, k, v, do_TxHD, stats_2HxT, bounds_2xT, tiles, count, dq_ref, *, heads: int,
            scale: float, opts: Options):
  """The kernel over the first count[kb] tiles of each key block's list: adds dQ into the float32
  Ref, returns dK and dV."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  S, K, D = k.shape
  G = heads // K
  dtype = k.dtype
  # dQ of a step: with D >= 128 each warpgroup computes a D / WGS column slice (a whole number of
  # 64-column swizzle tiles); at D = 64 the warpgroups take whole steps in turn (by step parity).
  split = D >= 64 * WGS
  assert split or WGS == 2, "taking steps in turn by parity needs two compute warpgroups"
  dq_cols = D // WGS if split else D
  nk = S // (WGS * BLOCK_KV)
  scale2 = scale * LOG2E
  tiles16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  tiles32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
  zeros = lambda shape: plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
  kq = opts.kq_scores
  # Per query row of the score tile: [keys, rows] (kq) or [rows, keys].
  row_layout = plgpu.Layout.WGMMA.reduce(0 if kq else 1)
  tile_shape = (BLOCK_KV, BLOCK_Q) if kq else (BLOCK_Q, BLOCK_KV)
  tr = lambda ref: plgpu.transpose_ref(ref, (1, 0))

  def body(q_ref, k_ref, v_ref, do_ref, stats_ref, bounds_ref, tiles_ref, count_ref, dq_ref,
           dk_ref, dv_ref, smem, bars):
    kh = lax.axis_index("kv_head")
    kb = lax.axis_index("kv_block")
    wg = lax.axis_index("wg")
    k_smem2, v_smem2, ds_smem, out_smem = smem
    kv_bar, ds_bar, end_bar = bars
    key0 = kb * (WGS * BLOCK_KV) + wg * BLOCK_KV
    qb_of = lambda s: tiles_ref[kb, lax.div(s, G)]
    h_of = lambda s: kh * G + lax.rem(s, G)

    def compute(run):
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      keys = pl.ds(key0, BLOCK_KV)
      plgpu.copy_gmem_to_smem(k_ref.at[keys, kh], k_smem, kv_bar.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[keys, kh], v_smem, kv_bar.at[WGS + wg])
      plgpu.barrier_wait(kv_bar.at[wg])
      plgpu.barrier_wait(kv_bar.at[WGS + wg])
      dk, dv = run((zeros((BLOCK_KV, D)), zeros((BLOCK_KV, D))))
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
      # wg_s == wg; with step_descriptors LLVM cannot hoist what is computed from it.
      wg_s = lax.optimization_barrier(wg) if opts.step_descriptors else wg
      k_smem, v_smem = k_smem2.at[wg_s], v_smem2.at[wg_s]
      dk, dv = carry
      s = idx[0]
      par = lax.rem(s, 2)
      # The step's first query row for dQ's reduce: a global load, issued here under the S and
      # dP matmuls (early_tile_index), else where dQ is reduced.
      tile_row0 = qb_of(s) * BLOCK_Q if opts.early_tile_index else None

      # Each row to its visible key range [lo, lo + len), on every tile: exact where a tile
      # needs no mask, and cheaper than branching (a lax.cond around it cost 28% in spills). One
      # unsigned compare per element, and the scale and LSE as one FMA before the select (two
      # compares and a separate multiply cost 10% of the backward, H100).
      tile = lambda x: lax.broadcast_in_dim(x, tile_shape, [1 if kq else 0])

      def probs(st):
        lo = plgpu.load(bound_smem.at[0], (), layout=row_layout)
        length = plgpu.load(bound_smem.at[1], (), layout=row_layout)
        plgpu.barrier_arrive(bound_done)
        col = key0 + plgpu.broadcasted_iota(jnp.int32, tile_shape, 0 if kq else 1,
                                            layout=plgpu.Layout.WGMMA)
        seen = _visible(col, tile(lo), tile(length))
        lse2 = plgpu.load(stat_smem.at[0], (), layout=row_layout)
        return jnp.exp2(jnp.where(seen, st * scale2 - tile(lse2), -jnp.inf))

      if kq:  # Sᵀ = K Qᵀ; Pᵀ and dSᵀ are the A operands of dV and dK, from registers

        def s_mm(acc):
          plgpu.wgmma(acc, k_smem, tr(q_smem))
          return acc[...]

        p = probs(pl.run_scoped(s_mm, plgpu.ACC(tile_shape, jnp.float32)))

        def dv_dp(refs):
          plgpu.wgmma(refs[0], p.astype(dtype), do_smem)
          plgpu.wgmma(refs[1], v_smem, tr(do_smem))

        dv, dp = pl.run_state(dv_dp)((plgpu.ACC.init(dv), plgpu.ACC.init(zeros(tile_shape))))
        plgpu.barrier_arrive(do_done)
        delta = plgpu.load(stat_smem.at[1], (), layout=row_layout)
        plgpu.barrier_arrive(stat_done)
        ds = (p * (dp - tile(delta))).astype(dtype)
        ds_smem.at[par, wg][...] = ds
        plgpu.commit_smem()
      else:  # S = Q Kᵀ and dP = dO Vᵀ in one go; P and dS through shared memory

        def s_dp(refs):
          plgpu.wgmma(refs[0], q_smem, tr(k_smem))
          plgpu.wgmma(refs[1], do_smem, tr(v_smem))

        st, dp = pl.run_state(s_dp)((plgpu.ACC.init(zeros(tile_shape)),
                                     plgpu.ACC.init(zeros(tile_shape))))
        p = probs(st)
        # dV's A operand is Pᵀ, read transposed from dS's buffer (the other warpgroup read this
        # parity's dS two steps ago, before the barrier of the step between).
        ds_smem.at[par, wg][...] = p.astype(dtype)
        plgpu.commit_smem()

        def dv_ds(dv_acc):  # dS while dV's matmul reads P; then dS takes P's place
          plgpu.wgmma(dv_acc, tr(ds_smem.at[par, wg]), do_smem)
          delta = plgpu.load(stat_smem.at[1], (), layout=row_layout)
          ds = (p * (dp - tile(delta))).astype(dtype)
          plgpu.wgmma_wait(0)
          if opts.explicit_barriers:  # every warp's share of dV's matmul has read P
            _warpgroup_barrier()
          ds_smem.at[par, wg][...] = ds
          plgpu.commit_smem()

        dv = pl.run_state(dv_ds)(plgpu.ACC.init(dv))
        plgpu.barrier_arrive(do_done)
        plgpu.barrier_arrive(stat_done)

      def both_ds():
        # Both warpgroups' dS are in shared memory: dQ's columns from all WGS * BLOCK_KV keys
        # (double-buffered by step parity, so one barrier per step suffices).
        plgpu.barrier_arrive(ds_bar.at[par])
        plgpu.barrier_wait(ds_bar.at[par])

      def reduce_dq(rows, slot, cols, width):
        """dQ[rows, cols] += scale · dS K[:, cols] over all WGS * BLOCK_KV keys, staged in
        out_smem[slot] and reduce-added by the TMA unit."""
        def dq_mm(acc):
          for src in range(WGS):
            ds_src = ds_smem.at[par, src]  # [keys, rows] (kq) or [rows, keys]
            k_src = k_smem2.at[src + (wg_s - wg) if opts.step_descriptors else src]
            plgpu.wgmma(acc, tr(ds_src) if kq else ds_src, k_src.at[:, cols])
          return acc[...]

        dq = pl.run_scoped(dq_mm, plgpu.ACC((BLOCK_Q, width), jnp.float32))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last reduce has read the buffer
        out_smem.at[slot][...] = dq * scale
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[slot], dq_ref.at[rows, h_of(s), cols],
                                reduction_op="add")

      def dq_part():  # this warpgroup's share of the tile's dQ columns, from every key
        rows = pl.ds(qb_of(s) * BLOCK_Q if tile_row0 is None else tile_row0, BLOCK_Q)
        for w in range(WGS):  # static column slices, one branch per warpgroup

          @pl.when((wg == w) if split else ((wg == w) & (par == w)))
          def _(w=w):
            reduce_dq(rows, w, pl.ds(w * dq_cols if split else 0, dq_cols), dq_cols)

      barrier = opts.dk_under_barrier

      def dk_mm(acc):
        plgpu.wgmma(acc, ds if kq else tr(ds_smem.at[par, wg]), q_smem)
        if barrier:
          both_ds()

      dk = pl.run_state(dk_mm)(plgpu.ACC.init(dk))
      plgpu.barrier_arrive(q_done)
      if not barrier:
        both_ds()
      dq_part()
      return dk, dv

    pipeline = plgpu.emit_pipeline_warp_specialized(
        step, grid=(count_ref[kb] * G,), max_concurrent_steps=opts.stages,
        num_compute_wgs=WGS, memory_registers=opts.memory_registers, wg_axis="wg",
        manual_consumed_barriers=True,
        compute_context=compute,
        in_specs=[
            plgpu.BlockSpec((BLOCK_Q, D), lambda s: (qb_of(s), h_of(s)), transforms=tiles16),
            plgpu.BlockSpec((BLOCK_Q, D), lambda s: (qb_of(s), h_of(s)), transforms=tiles16),
            plgpu.BlockSpec((2, BLOCK_Q), lambda s: (h_of(s), qb_of(s))),
            plgpu.BlockSpec((2, BLOCK_Q), lambda s: (0, qb_of(s))),
        ])
    pipeline(q_ref, do_ref, stats_ref, bounds_ref)

  # 194 KiB with the pipeline's Q / dO / statistics buffers (d = 128): under the 196 KiB carve-out
  # less the driver's 1 KiB, with ~0.9 KiB to spare; a test keeps the line. While the compute
  # warpgroups spilled (before step_descriptors), the spills lived in the L1 the carve-out leaves
  # and 512 bytes more (the 228 KiB carve-out) cost 20% (H100, Nsight Compute).
  smem = (
      plgpu.SMEM((WGS, BLOCK_KV, D), dtype, transforms=tiles16),           # K
      plgpu.SMEM((WGS, BLOCK_KV, D), dtype, transforms=tiles16),           # V
      plgpu.SMEM((2, WGS, *tile_shape), dtype, transforms=tiles16),  # P, then dS, by step parity
      plgpu.SMEM((WGS, BLOCK_Q, dq_cols), jnp.float32, transforms=tiles32),  # dQ reduce staging
  )
  bars = (plgpu.Barrier(num_barriers=2 * WGS), plgpu.Barrier(num_arrivals=WGS, num_barriers=2),
          plgpu.Barrier(num_arrivals=WGS))
  grid, names = ((nk, K), ("kv_block", "kv_head")) if opts.kv_major else (
      (K, nk), ("kv_head", "kv_block"))
  mesh = plgpu.Mesh(grid=grid, grid_names=names, num_threads=WGS + 1, thread_name="wg")

  def kernel_body(*refs):  # plgpu.kernel less its vmap wrapper, which refuses Ref operands
    pl.run_scoped(functools.partial(body, *refs), smem, bars, collective_axes="wg")

  # Without Pallas' automatic barriers every other shared-memory store is safe as written: P
  # (after two steps and the dS barrier between), the dQ staging (wait_smem_to_gmem ends in a
  # warpgroup barrier) and dK / dV (after end_bar) overwrite what no warp still reads, and
  # commit_smem's fence and barrier publish each one before a matmul or copy reads it.
  params = plgpu.CompilerParams(approx_math=True,
                                unsafe_no_auto_barriers=opts.explicit_barriers)
  return pl.kernel(kernel_body, out_type=[jax.ShapeDtypeStruct(k.shape, dtype)] * 2, mesh=mesh,
                   compiler_params=params, name="ca_tasks_bwd")(
      q_TxHD, k, v, do_TxHD, stats_2HxT, bounds_2xT, tiles, count, dq_ref)


FWD_BLOCK_Q = 64    # query rows per compute warpgroup (a CTA: WGS * FWD_BLOCK_Q rows of one head)
FWD_BLOCK_KV = 128  # key rows per step
FWD_STAGES = 2      # key blocks in flight


def _fwd_setup(q_TxHxD, k_SxKxD, tasks: TaskTable):
  """The forward's shapes and block schedule: (T, H, D, G query heads a KV head, Tp and Sp rows
  padded to its tiles, nq query tiles, the `query_schedule` of its WGS · FWD_BLOCK_Q-row tiles
  and FWD_BLOCK_KV-key blocks, and that schedule's [kb_lo, kb_full_lo, kb_full_hi, kb_hi] as a
  [4, nq] array)."""
  T, H, D = q_TxHxD.shape
  S, K, _ = k_SxKxD.shape
  rows_cta = WGS * FWD_BLOCK_Q
  Tp = cdiv(T, rows_cta) * rows_cta
  sch = query_schedule(tasks, Tp, rows_cta, FWD_BLOCK_KV)
  sched = jnp.stack([sch.kb_lo, sch.kb_full_lo, sch.kb_full_hi, sch.kb_hi])
  return (T, H, D, H // K, Tp, cdiv(S, FWD_BLOCK_KV) * FWD_BLOCK_KV, Tp // rows_cta, sch, sched)


def _heaviest_first(sch):
  """The forward's query tiles by descending key-block count (ties in row order), int32."""
  return jnp.argsort(sch.kb_lo - sch.kb_hi, stable=True).astype(jnp.int32)


def _take_turn(turn):
  """The forward's two compute warpgroups meet at `turn` (two arrivals): each passes the tensor
  cores to the other."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  plgpu.barrier_arrive(turn)
  plgpu.barrier_wait(turn)


def _fwd_key_blocks(qo_smem, k_smem, v_smem, bars, sched, n, lo, length, carry, *,
                    scale2: float, g0=None, total=None):
  """One query tile's key blocks in a forward compute warpgroup: (acc, m, l) after the n blocks
  from kb_lo of `sched` (kb_lo, full_lo, full_hi), those outside [full_lo, full_hi) masked to
  each row's key range [lo, lo + length). K and V block j sit in stage slot
  (g0 + j) % FWD_STAGES; while block j's P·V runs, the warpgroup waits for block j + 1's K if
  g0 + j + 1 < total (g0 None: 0 and the tile's own block count)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  k_bars, v_bars, k_consumed, v_consumed, turn = bars
  kb_lo, full_lo, full_hi = sched
  total = n if total is None else total
  stages = FWD_STAGES
  dtype = qo_smem.dtype
  tile = lambda x: lax.broadcast_in_dim(x, (FWD_BLOCK_Q, FWD_BLOCK_KV), [0])

  take_turn = functools.partial(_take_turn, turn)

  def kv_step(j, carry, masked: bool):
    acc, m_i, l_i = carry
    g = j if g0 is None else g0 + j
    slot = lax.rem(g, jnp.array(stages, g.dtype))

    def qk_mm(acc_ref):
      plgpu.wgmma(acc_ref, qo_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
      take_turn()
      return acc_ref[...]

    qk = pl.run_scoped(qk_mm, plgpu.ACC((FWD_BLOCK_Q, FWD_BLOCK_KV), jnp.float32))
    plgpu.barrier_arrive(k_consumed.at[slot])
    if masked:  # each row to its key range; a row that has seen nothing yet keeps m = -inf
      col = (kb_lo + j) * FWD_BLOCK_KV + plgpu.broadcasted_iota(
          jnp.int32, (FWD_BLOCK_Q, FWD_BLOCK_KV), 1, layout=plgpu.Layout.WGMMA)
      qk = jnp.where(_visible(col, tile(lo), tile(length)), qk, -jnp.inf)
    m_ij = jnp.maximum(m_i, qk.max(axis=1) * scale2)
    m_use = jnp.where(m_ij == -jnp.inf, 0.0, m_ij) if masked else m_ij
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(qk * scale2 - tile(m_use))
    acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
    l_i *= alpha
    p16 = p.astype(dtype)
    # As JAX's kernel: this order measured fastest there at head dims <= 128.
    l_i += p.sum(axis=1)
    acc, l_i, m_ij, p16 = lax.optimization_barrier((acc, l_i, m_ij, p16))
    plgpu.barrier_arrive(turn)  # done with the softmax
    plgpu.barrier_wait(v_bars.at[slot])
    plgpu.barrier_wait(turn)  # the tensor cores are ours

    def pv_mm(acc_ref):
      plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
      nxt = g + 1

      @pl.when(nxt < total)
      def _():
        plgpu.barrier_wait(k_bars.at[lax.rem(nxt, jnp.array(stages, nxt.dtype))])

    acc = pl.run_state(pv_mm)(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(v_consumed.at[slot])
    return acc, m_ij, l_i

  carry = lax.fori_loop(0, full_lo - kb_lo, functools.partial(kv_step, masked=True), carry)
  carry = lax.fori_loop(full_lo - kb_lo, full_hi - kb_lo,
                        functools.partial(kv_step, masked=False), carry)
  return lax.fori_loop(full_hi - kb_lo, n, functools.partial(kv_step, masked=True), carry)


def _fwd_finish(acc, m_i, l_i, o_smem, lse_smem):
  """O (normalised, in o_smem's dtype) and the natural-log LSE of one warpgroup's rows into
  shared memory (-inf and O = 0 for rows that saw nothing)."""
  seen = l_i > 0
  inv = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)
  o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_smem.dtype)
  lse_smem[...] = jnp.where(
      seen, m_i * (1.0 / LOG2E) + jnp.log(jnp.where(seen, l_i, 1.0)), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("scale", "heavy_first"))
def forward(q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, scale: float, heavy_first: bool = True):
  """O [T, H, D] and natural-log LSE [T, H] (float32; -inf and O = 0 for rows that see nothing)
  from one Mosaic GPU kernel, after JAX's `attention_mgpu` forward (FA3's two compute warpgroups
  taking turns at the tensor cores, a memory warpgroup streaming K and V).

  One CTA per (WGS * 64 query rows, query head). The key blocks it visits are the query-side
  block schedule's [kb_lo, kb_hi) for its rows (`blocks.py`, 128-row blocks both ways); those in
  [kb_full_lo, kb_full_hi) every row sees whole and run unmasked, the others mask each element to
  its row's key range (one unsigned compare). Both warpgroups take the same steps, so the turn
  barrier stays paired. `heavy_first`: CTAs run the query tiles with the most key blocks first,
  every head of a tile side by side, so the launch ends on short tiles (+2.6-3% on ProLong 64K).
  H100, head dim 128, same run: 586-592 TF/s on the Pretrain batches, 521-542 on ProLong,
  against the Triton forward's 499-506 and 423-463 (PERFORMANCE.md)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  T, H, D, G, Tp, Sp, nq, sch, sched = _fwd_setup(q_TxHxD, k_SxKxD, tasks)
  dtype = q_TxHxD.dtype
  rows_cta = WGS * FWD_BLOCK_Q
  # CTA i runs query tile order[i]: heavy_first, the tiles with the most key blocks first (every
  # head of a tile side by side), so the launch ends on short ones.
  order = _heaviest_first(sch) if heavy_first else jnp.arange(nq, dtype=jnp.int32)
  bounds = _row_ranges(sch.row_lo, sch.row_hi)  # [2, Tp]
  c = float(scale) * LOG2E
  tiles16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  row_layout = plgpu.Layout.WGMMA.reduce(1)  # per query row of a [rows, keys] tile
  stages = FWD_STAGES

  def kernel(q_ref, k_ref, v_ref, sched_ref, bounds_ref, order_ref, o_ref, lse_ref, scoped):
    h = lax.axis_index("heads")
    qt = order_ref[lax.axis_index("q_tile")]
    wg = lax.axis_index("wg")
    kh = lax.div(h, jnp.array(G, h.dtype))
    (qo_smem2, k_smem, v_smem, lse_smem2, bnd_smem2), bars, consumed, turn = scoped
    k_bars, v_bars, q_bars, b_bars = bars
    k_consumed, v_consumed = consumed
    kb_lo, full_lo, full_hi, kb_hi = (sched_ref[i, qt] for i in range(4))
    n = kb_hi - kb_lo

    take_turn = functools.partial(_take_turn, turn)

    @pl.when(wg < WGS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      qo_smem = qo_smem2.at[wg]
      row0 = qt * rows_cta + wg * FWD_BLOCK_Q
      rows = pl.ds(row0, FWD_BLOCK_Q)
      plgpu.copy_gmem_to_smem(q_ref.at[rows, h], qo_smem, q_bars.at[wg])
      plgpu.copy_gmem_to_smem(bounds_ref.at[:, rows], bnd_smem2.at[wg], b_bars.at[wg])
      plgpu.barrier_wait(b_bars.at[wg])
      lo = plgpu.load(bnd_smem2.at[wg, 0], (), layout=row_layout)
      length = plgpu.load(bnd_smem2.at[wg, 1], (), layout=row_layout)
      plgpu.barrier_wait(q_bars.at[wg])
      m_i = plgpu.layout_cast(jnp.full((FWD_BLOCK_Q,), -jnp.inf, jnp.float32), row_layout)
      l_i = plgpu.layout_cast(jnp.full((FWD_BLOCK_Q,), 0, jnp.float32), row_layout)
      acc = plgpu.layout_cast(jnp.full((FWD_BLOCK_Q, D), 0, jnp.float32), plgpu.Layout.WGMMA)

      @pl.when(n > 0)
      def _():
        plgpu.barrier_wait(k_bars.at[0])

      pl.when(wg == 1)(take_turn)
      acc, m_i, l_i = _fwd_key_blocks(
          qo_smem, k_smem, v_smem, (k_bars, v_bars, *consumed, turn),
          (kb_lo, full_lo, full_hi), n, lo, length, (acc, m_i, l_i), scale2=c)
      pl.when(wg == 0)(take_turn)
      _fwd_finish(acc, m_i, l_i, qo_smem, lse_smem2.at[wg])
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[rows, h])
      plgpu.copy_smem_to_gmem(lse_smem2.at[wg], lse_ref.at[h, rows])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == WGS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      def load(step, slot):
        keys = pl.ds((kb_lo + step) * FWD_BLOCK_KV, FWD_BLOCK_KV)
        plgpu.copy_gmem_to_smem(k_ref.at[keys, kh], k_smem.at[slot], k_bars.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[keys, kh], v_smem.at[slot], v_bars.at[slot])

      for i in range(stages):
        pl.when(i < n)(functools.partial(load, i, i))

      @pl.loop(0, lax.max(n - stages, 0))
      def _(j):
        slot = lax.rem(j, jnp.array(stages, j.dtype))
        plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.barrier_wait(v_consumed.at[slot])
        load(j + stages, slot)

  def entry(q_ref, k_ref, v_ref, sched_ref, bounds_ref, order_ref, o_ref, lse_ref):
    smem = (plgpu.SMEM((WGS, FWD_BLOCK_Q, D), dtype, transforms=tiles16),
            plgpu.SMEM((stages, FWD_BLOCK_KV, D), dtype, transforms=tiles16),
            plgpu.SMEM((stages, FWD_BLOCK_KV, D), dtype, transforms=tiles16),
            plgpu.SMEM((WGS, FWD_BLOCK_Q), jnp.float32),
            plgpu.SMEM((WGS, 2, FWD_BLOCK_Q), jnp.int32))
    bars = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=WGS), plgpu.Barrier(num_barriers=WGS))
    consumed = (plgpu.Barrier(num_arrivals=WGS, num_barriers=stages),) * 2
    pl.run_scoped(lambda *scoped: kernel(q_ref, k_ref, v_ref, sched_ref, bounds_ref, order_ref,
                                         o_ref, lse_ref, scoped),
                  smem, bars, consumed, plgpu.Barrier(num_arrivals=WGS), collective_axes="wg")

  grid, names = ((nq, H), ("q_tile", "heads")) if heavy_first else ((H, nq), ("heads", "q_tile"))
  mesh = plgpu.Mesh(grid=grid, grid_names=names, num_threads=WGS + 1, thread_name="wg")
  o, lse = pl.kernel(
      entry, out_type=[jax.ShapeDtypeStruct((Tp, H, D), dtype),
                       jax.ShapeDtypeStruct((H, Tp), jnp.float32)], mesh=mesh,
      compiler_params=plgpu.CompilerParams(approx_math=True), name="ca_tasks_fwd")(
      _pad_rows(q_TxHxD, Tp), _pad_rows(k_SxKxD, Sp), _pad_rows(v_SxKxD, Sp), sched, bounds, order)
  return o[:T], lse.T[:T]


def num_sms() -> int:
  """Streaming multiprocessors of this process's first device (a GPU's `core_count`; a remote
  device of a multi-host job may not say); 132 (an H100 SXM) where it does not say (e.g. lowering
  for CUDA on a CPU)."""
  dev = jax.local_devices()[0]
  return int(getattr(dev, "core_count", 0) if dev.platform == "gpu" else 0) or 132


def snake_units(ctas: int, units: int):
  """The persistent forward's deal of `units` positions to `ctas` CTAs: round r gives position
  r·ctas + i to CTA i when r is even, to CTA ctas − 1 − i when odd (heaviest units first, so the
  rounds' sums even out). Returns (rounds, position(r, cta), count(cta)); position and count are
  plain integer arithmetic, for jnp / lax values in and out of the kernel alike."""
  rounds = cdiv(units, ctas)

  def position(r, cta):
    return r * ctas + jnp.where(r % 2 == 0, cta, ctas - 1 - cta)

  def count(cta):  # every round but the last is full
    return rounds - 1 + (position(rounds - 1, cta) < units).astype(jnp.int32)

  return rounds, position, count


@functools.partial(jax.jit, static_argnames=("scale", "ctas"))
def forward_persistent(q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, scale: float, ctas: int = -1):
  """`forward` with persistent CTAs: `ctas` of them (-1: one per SM) loop over the (query tile,
  head) units, heaviest tiles first, every head of a tile side by side, dealt to the CTAs in
  snake order (`snake_units`), so a
  CTA's fixed work overlaps its neighbours' instead of ending the CTA: its memory warpgroup
  streams the next unit's first K / V blocks while the compute warpgroups finish the last unit
  (one flat step sequence over all its units), each compute warpgroup loads the next unit's Q
  rows into a second buffer, and O and LSE leave by TMA without a wait. The same math, masks
  and turn-taking as `forward`, whose CTAs on short-document batches (ProLong 64K) run ~18 key
  blocks each on average."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  T, H, D, G, Tp, Sp, nq, sch, sched = _fwd_setup(q_TxHxD, k_SxKxD, tasks)
  dtype = q_TxHxD.dtype
  rows_cta = WGS * FWD_BLOCK_Q
  order = _heaviest_first(sch)
  units = nq * H
  P = min(num_sms() if ctas == -1 else int(ctas), units)
  if P < 1:
    raise ValueError(f"mosaic forward: {ctas} persistent CTAs; give -1 (one per SM) or >= 1")
  rounds, position, count = snake_units(P, units)
  # Each CTA's step count over all its units (the compute warpgroups' last K wait needs it).
  r_C, c_C = jnp.meshgrid(jnp.arange(rounds, dtype=jnp.int32), jnp.arange(P, dtype=jnp.int32))
  pos_C = position(r_C, c_C)
  steps = jnp.maximum(sch.kb_hi - sch.kb_lo, 0)[order][jnp.minimum(pos_C, units - 1) // H]
  totals = jnp.sum(jnp.where(pos_C < units, steps, 0), axis=1, dtype=jnp.int32)  # [P]
  bounds = _row_ranges(sch.row_lo, sch.row_hi)  # [2, Tp]
  c = float(scale) * LOG2E
  tiles16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  row_layout = plgpu.Layout.WGMMA.reduce(1)  # per query row of a [rows, keys] tile
  stages = FWD_STAGES

  def kernel(q_ref, k_ref, v_ref, sched_ref, bounds_ref, order_ref, totals_ref, o_ref, lse_ref,
             scoped):
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")
    (qo_smem, k_smem, v_smem, lse_smem, bnd_smem), bars, consumed, turn = scoped
    k_bars, v_bars, q_bars, b_bars = bars
    k_consumed, v_consumed = consumed
    n_units = count(cta)

    def unit(r):  # (query tile, head) of this CTA's r-th unit
      p = position(r, cta)
      return order_ref[lax.div(p, jnp.array(H, p.dtype))], lax.rem(p, jnp.array(H, p.dtype))

    take_turn = functools.partial(_take_turn, turn)

    @pl.when(wg < WGS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      total = totals_ref[cta]

      def rows_of(qt):
        return pl.ds(qt * rows_cta + wg * FWD_BLOCK_Q, FWD_BLOCK_Q)

      def load_q(r, buf):  # this warpgroup's Q rows and key ranges of unit r into buffer buf
        qt, h = unit(r)
        plgpu.copy_gmem_to_smem(q_ref.at[rows_of(qt), h], qo_smem.at[buf, wg],
                                q_bars.at[buf * WGS + wg])
        plgpu.copy_gmem_to_smem(bounds_ref.at[:, rows_of(qt)], bnd_smem.at[buf, wg],
                                b_bars.at[buf * WGS + wg])

      load_q(0, 0)

      @pl.when(total > 0)
      def _():
        plgpu.barrier_wait(k_bars.at[0])

      def run_unit(r, g0):
        buf = lax.rem(r, 2)
        qt, h = unit(r)
        kb_lo, full_lo, full_hi, kb_hi = (sched_ref[i, qt] for i in range(4))
        plgpu.barrier_wait(b_bars.at[buf * WGS + wg])
        lo = plgpu.load(bnd_smem.at[buf, wg, 0], (), layout=row_layout)
        length = plgpu.load(bnd_smem.at[buf, wg, 1], (), layout=row_layout)
        plgpu.barrier_wait(q_bars.at[buf * WGS + wg])

        @pl.when(r + 1 < n_units)
        def _():
          # The last unit's O and LSE stores have read the other buffer: reuse it.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          load_q(r + 1, 1 - buf)

        m_i = plgpu.layout_cast(jnp.full((FWD_BLOCK_Q,), -jnp.inf, jnp.float32), row_layout)
        l_i = plgpu.layout_cast(jnp.full((FWD_BLOCK_Q,), 0, jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.full((FWD_BLOCK_Q, D), 0, jnp.float32), plgpu.Layout.WGMMA)
        n = kb_hi - kb_lo
        # The turns as `forward` takes them, per unit: warpgroup 1 starts a turn behind and
        # warpgroup 0 hands it back after its last P·V, so each one's epilogue runs beside the
        # other's matmuls.
        pl.when(wg == 1)(take_turn)
        acc, m_i, l_i = _fwd_key_blocks(
            qo_smem.at[buf, wg], k_smem, v_smem, (k_bars, v_bars, *consumed, turn),
            (kb_lo, full_lo, full_hi), n, lo, length, (acc, m_i, l_i), scale2=c, g0=g0,
            total=total)
        pl.when(wg == 0)(take_turn)
        _fwd_finish(acc, m_i, l_i, qo_smem.at[buf, wg], lse_smem.at[buf, wg])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem.at[buf, wg], o_ref.at[rows_of(qt), h])
        plgpu.copy_smem_to_gmem(lse_smem.at[buf, wg], lse_ref.at[h, rows_of(qt)])
        return g0 + n

      lax.fori_loop(0, n_units, run_unit, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == WGS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      def unit_loads(r, g0):  # one flat sequence of K / V blocks over this CTA's units
        qt, h = unit(r)
        kb_lo = sched_ref[0, qt]
        kh = lax.div(h, jnp.array(G, h.dtype))
        n = sched_ref[3, qt] - kb_lo

        @pl.loop(0, n)
        def _(j):
          g = g0 + j
          slot = lax.rem(g, jnp.array(stages, g.dtype))

          @pl.when(g >= stages)
          def _():
            plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.barrier_wait(v_consumed.at[slot])

          keys = pl.ds((kb_lo + j) * FWD_BLOCK_KV, FWD_BLOCK_KV)
          plgpu.copy_gmem_to_smem(k_ref.at[keys, kh], k_smem.at[slot], k_bars.at[slot])
          plgpu.copy_gmem_to_smem(v_ref.at[keys, kh], v_smem.at[slot], v_bars.at[slot])

        return g0 + n

      lax.fori_loop(0, n_units, unit_loads, jnp.int32(0))

  def entry(q_ref, k_ref, v_ref, sched_ref, bounds_ref, order_ref, totals_ref, o_ref, lse_ref):
    smem = (plgpu.SMEM((2, WGS, FWD_BLOCK_Q, D), dtype, transforms=tiles16),  # Q, then O
            plgpu.SMEM((stages, FWD_BLOCK_KV, D), dtype, transforms=tiles16),
            plgpu.SMEM((stages, FWD_BLOCK_KV, D), dtype, transforms=tiles16),
            plgpu.SMEM((2, WGS, FWD_BLOCK_Q), jnp.float32),
            plgpu.SMEM((2, WGS, 2, FWD_BLOCK_Q), jnp.int32))
    bars = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=2 * WGS), plgpu.Barrier(num_barriers=2 * WGS))
    consumed = (plgpu.Barrier(num_arrivals=WGS, num_barriers=stages),) * 2
    pl.run_scoped(lambda *scoped: kernel(q_ref, k_ref, v_ref, sched_ref, bounds_ref, order_ref,
                                         totals_ref, o_ref, lse_ref, scoped),
                  smem, bars, consumed, plgpu.Barrier(num_arrivals=WGS), collective_axes="wg")

  mesh = plgpu.Mesh(grid=(P,), grid_names=("cta",), num_threads=WGS + 1, thread_name="wg")
  o, lse = pl.kernel(
      entry, out_type=[jax.ShapeDtypeStruct((Tp, H, D), dtype),
                       jax.ShapeDtypeStruct((H, Tp), jnp.float32)], mesh=mesh,
      compiler_params=plgpu.CompilerParams(approx_math=True), name="ca_tasks_fwd_persistent")(
      _pad_rows(q_TxHxD, Tp), _pad_rows(k_SxKxD, Sp), _pad_rows(v_SxKxD, Sp), sched, bounds, order,
      totals)
  return o[:T], lse.T[:T]


def zeros_after(x, shape):
  """float32 zeros of `shape` that XLA can only make once `x` exists: a finite integer (the bits
  of x's first element) times 0.0, which XLA does not fold. A constant broadcast has no operands,
  and XLA fused every layer's float32 dQ zeros into one fusion at the start of the training step
  (llama_1b, 64K tokens: 16 x 512 MiB alive at its peak, H100); made from each layer's dO they
  appear when its backward starts."""
  if x.size == 0:
    return jnp.zeros(shape, jnp.float32)
  bits = lax.bitcast_convert_type(x.reshape(-1)[0], jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
  return jnp.broadcast_to(bits.astype(jnp.float32) * 0.0, shape)


# The three functions that build kernels (`forward`, `forward_persistent`, `backward_from_stats`)
# are jitted, so the call sites of a model (a layer's forward, its rematerialised forward, its
# backward; every layer) share one lowering of each kernel: JAX lowers a jitted function once per
# distinct input shape and static arguments and calls it from every site. Lowered at each site
# instead, every Mosaic GPU module came out distinct (jaxlib 0.11 stamps a per-process counter,
# `mosaic_gpu.dump_basename`, into each module before hashing it) and XLA compiled the kernels
# again for every layer.
@functools.partial(jax.jit, static_argnames=("scale", "opts"))
def backward_from_stats(q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, o_TxHxD, lse_TxH, do_TxHxD,
                        dlse_TxH, scale: float, opts: Options = Options()):
  """dQ, dK, dV from saved O and LSE (any backend's forward), in the inputs' dtypes."""
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
  lse_HxT = _pad_rows(lse_TxH, Tp).T
  lse2_HxT = jnp.where(jnp.isfinite(lse_HxT), lse_HxT * LOG2E, 0.0).astype(f32)
  delta_HxT = _pad_rows(row_delta(do_TxHxD, o_TxHxD) - dlse_TxH.astype(f32), Tp).T
  tiles, count, row_lo, row_hi = visit_lists(tasks, Tp, Sp, by_scan=opts.lists_by_scan)
  # Inputs as the kernel's TMA tiles read them: Q and dO [T, H * D] (a tile is 64 rows of one
  # head), LSE and delta interleaved per head [2H, T], the rows' key ranges [2, T] as start and
  # length.
  args = (_pad_rows(q_TxHxD, Tp).reshape(Tp, H * D), _pad_rows(k_SxKxD, Sp),
          _pad_rows(v_SxKxD, Sp), _pad_rows(do_TxHxD, Tp).reshape(Tp, H * D),
          jnp.stack([lse2_HxT, delta_HxT], axis=1).reshape(2 * H, Tp),
          _row_ranges(row_lo, row_hi), tiles)
  # dQ is reduced into a float32 buffer, so it starts as zeros (a Ref operand is aliased in and
  # out of the kernel).
  dq = jax.new_ref(zeros_after(do_TxHxD, (Tp, H, D)))
  dk, dv = _launch(*args, count, dq, heads=H, scale=float(scale), opts=opts)
  return dq[...][:T].astype(q_TxHxD.dtype), dk[:S], dv[:S]


def lowered_kernels(stablehlo_text: str) -> tuple[int, int]:
  """(Mosaic GPU call sites, distinct kernels) in a lowered module's text: jaxlib compiles each
  distinct kernel (by its hash) once a process, so the second number is what XLA's compile pays
  for."""
  hashes = re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', stablehlo_text)
  return len(re.findall(r"custom_call @mosaic_gpu", stablehlo_text)), len(set(hashes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, tasks, scale, opts):
  if opts.forward == "mosaic" and opts.fwd_ctas:
    return forward_persistent(q, k, v, tasks, scale, ctas=opts.fwd_ctas)
  if opts.forward == "mosaic":
    return forward(q, k, v, tasks, scale, heavy_first=opts.fwd_heavy_first)
  from . import triton
  return triton.attention(q, k, v, tasks, scale=scale)


def _attention_fwd(q, k, v, tasks, scale, opts):
  out = _attention(q, k, v, tasks, scale, opts)
  return out, (q, k, v, tasks, *out)


def _attention_bwd(scale, opts, res, cts):
  q, k, v, tasks, o, lse = res
  do, dlse = cts
  dlse = jnp.where(jnp.isfinite(lse), dlse.astype(jnp.float32), 0.0)
  return (*backward_from_stats(q, k, v, tasks, o, lse, do, dlse, scale, opts), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, *, scale: float | None = None,
              config: Options | None = None):
  """O [T, H, D] in q's dtype and LSE [T, H] float32 from the Mosaic GPU forward (or the Triton
  one: `config.forward`), differentiable through the one-kernel backward. Hopper GPU; bf16 or
  fp16; head dim 64 or 128."""
  T, H, D = q_TxHxD.shape
  why = unsupported(D, q_TxHxD.dtype)
  if why:
    raise ValueError(why)
  config = config or Options()
  if config.forward not in ("triton", "mosaic"):
    raise ValueError(f"mosaic backend: forward {config.forward!r}, choose triton or mosaic")
  if config.forward == "mosaic" and config.fwd_ctas and not config.fwd_heavy_first:
    raise ValueError("mosaic backend: persistent forward CTAs (fwd_ctas != 0) deal the units "
                     "heaviest first; for fwd_heavy_first=false set fwd_ctas=0")
  if config.fwd_ctas < -1:
    raise ValueError(f"mosaic backend: fwd_ctas={config.fwd_ctas}; give -1 (one per SM), 0 (off) "
                     "or a CTA count")
  scale = D ** -0.5 if scale is None else float(scale)
  tasks = TaskTable(*(jnp.asarray(a, jnp.int32) for a in tasks))
  return _attention(q_TxHxD, k_SxKxD, v_SxKxD, tasks, scale, config)
