"""An FA3-style attention backward in Mosaic GPU: dK, dV and dQ from one kernel, dQ reduced with
TMA reduce-add (a probe for issue 4; dense, non-causal, Hopper only).

Why: our packed backward (and JAX's Mosaic GPU one) runs a dQ kernel and a dK/dV kernel, 7 tile
matmuls per visible tile where one kernel needs 5 (S, dP, dV, dK, dQ). The float32 atomics that
would let one kernel do it were slower than the matmuls they save (PERFORMANCE.md, Kernels). FA3
instead writes each tile's dQ share to shared memory and adds it into a float32 dQ in global
memory with the TMA unit (`cp.reduce.async.bulk`): one bulk operation per tile, off the math
warps. This module measures whether that closes the gap before anyone builds it for task tables.

Layout of one CTA (grid: query head x 128 key rows), after JAX's `attention_mgpu` backward:
two compute warpgroups, each owning 64 key rows (its dK, dV accumulators in registers), and a
memory warpgroup streaming Q, dO, LSE and delta tiles of 64 query rows. Per query tile each
compute warpgroup computes Sᵀ, Pᵀ, dV, dPᵀ, dSᵀ and dK for its keys and stores dSᵀ (float16)
to shared memory; after both have (an mbarrier of two arrivals, double-buffered by step parity)
warpgroup w computes columns [64w, 64w + 64) of the tile's dQ = dS · K over all 128 keys (two
wgmmas) and reduce-adds them to global memory. Splitting dQ by columns keeps its accumulator at
64 x 64 per warpgroup (32 registers a thread) beside dK and dV.

Same conventions as JAX's kernel: no softmax scale (fold it into q), LSE in base 2 as its
forward saves it, dK / dV per query head then summed over the group.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
WGS = 2  # compute warpgroups per CTA


def fused_backward(q, k, v, do, lse_HxT, delta_HxT, *, block_q=64, block_kv=64,
                   max_concurrent_steps=2):
  """dQ, dK, dV for one sequence: q, do [T, H, D]; k, v [S, K, D]; lse, delta [H, T] float32."""
  T, H, D = q.shape
  S, K, _ = k.shape
  G = H // K
  dtype = q.dtype
  half = D // WGS
  if D % (64 * WGS) or T % block_q or S % (WGS * block_kv):
    raise ValueError(f"shapes T={T} S={S} D={D} do not tile by {block_q} / {WGS} x {block_kv}")
  tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  tiles32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
  zeros = lambda shape: plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)

  def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref,
           kv_smem, ds_smem, dq_smem, kv_bars, ds_bar, end_bar):
    h = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    kh = lax.div(h, jnp.array(G, h.dtype))
    k_smem2, v_smem2 = kv_smem
    k_bar, v_bar = kv_bars

    def compute(run):
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      rows = pl.ds(lax.axis_index("kv_seq") * (WGS * block_kv) + wg * block_kv, block_kv)
      plgpu.copy_gmem_to_smem(k_ref.at[rows, kh], k_smem, k_bar.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[rows, kh], v_smem, v_bar.at[wg])
      plgpu.barrier_wait(k_bar.at[wg])
      plgpu.barrier_wait(v_bar.at[wg])
      dk, dv = run((zeros((block_kv, D)), zeros((block_kv, D))))
      # The other warpgroup's last dQ reads this warpgroup's K tile: wait for it before reuse.
      plgpu.barrier_arrive(end_bar)
      plgpu.barrier_wait(end_bar)
      k_smem[...] = dk.astype(dtype)
      v_smem[...] = dv.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rows, h], commit_group=False)
      plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rows, h], commit_group=False)
      plgpu.commit_smem_to_gmem_group()
      plgpu.wait_smem_to_gmem(0)

    def step(idx, q_smem, do_smem, lse_smem, delta_smem, q_done, do_done, lse_done, delta_done,
             carry):
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      dk, dv = carry
      i = idx[0]
      slot = lax.rem(i, 2)

      def s_t(acc):
        plgpu.wgmma(acc, k_smem, plgpu.transpose_ref(q_smem, (1, 0)))
        return acc[...]

      s = pl.run_scoped(s_t, plgpu.ACC((block_kv, block_q), jnp.float32)) * LOG2E
      lse = plgpu.load(lse_smem, (), layout=plgpu.Layout.WGMMA.reduce(0))
      plgpu.barrier_arrive(lse_done)
      p = jnp.exp2(s - lax.broadcast_in_dim(lse, (block_kv, block_q), [1]))

      def dv_dp(refs):
        dv_acc, dp_acc = refs
        plgpu.wgmma(dv_acc, p.astype(dtype), do_smem)
        plgpu.wgmma(dp_acc, v_smem, plgpu.transpose_ref(do_smem, (1, 0)))

      dv, dp = pl.run_state(dv_dp)((plgpu.ACC.init(dv), plgpu.ACC.init(zeros((block_kv, block_q)))))
      plgpu.barrier_arrive(do_done)
      delta = plgpu.load(delta_smem, (), layout=plgpu.Layout.WGMMA.reduce(0))
      plgpu.barrier_arrive(delta_done)
      ds = (p * (dp - lax.broadcast_in_dim(delta, (block_kv, block_q), [1]))).astype(dtype)
      ds_smem.at[slot, wg][...] = ds
      plgpu.commit_smem()

      def dk_mm(acc):
        plgpu.wgmma(acc, ds, q_smem)

      dk = pl.run_state(dk_mm)(plgpu.ACC.init(dk))
      plgpu.barrier_arrive(q_done)
      plgpu.barrier_arrive(ds_bar.at[slot])
      plgpu.barrier_wait(ds_bar.at[slot])
      for w in range(WGS):  # static column slices: one branch per warpgroup

        @pl.when(wg == w)
        def _(w=w):
          cols = pl.ds(w * half, half)

          def dq_mm(acc):
            for src in range(WGS):
              plgpu.wgmma(acc, plgpu.transpose_ref(ds_smem.at[slot, src], (1, 0)),
                          k_smem2.at[src, :, cols])
            return acc[...]

          dq = pl.run_scoped(dq_mm, plgpu.ACC((block_q, half), jnp.float32))
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last reduce has read dq_smem
          dq_smem.at[w][...] = dq
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(dq_smem.at[w], dq_ref.at[pl.ds(i * block_q, block_q), h, cols],
                                  reduction_op="add")

      return dk, dv

    pipeline = plgpu.emit_pipeline_warp_specialized(
        step, grid=(T // block_q,), max_concurrent_steps=max_concurrent_steps,
        num_compute_wgs=WGS, memory_registers=40, wg_axis="wg", manual_consumed_barriers=True,
        compute_context=compute,
        in_specs=[plgpu.BlockSpec((block_q, D), lambda i: (i, 0), transforms=tiles),
                  plgpu.BlockSpec((block_q, D), lambda i: (i, 0), transforms=tiles),
                  plgpu.BlockSpec((block_q,), lambda i: (i,)),
                  plgpu.BlockSpec((block_q,), lambda i: (i,))])
    pipeline(q_ref.at[:, h, :], do_ref.at[:, h, :], lse_ref.at[h, :], delta_ref.at[h, :])

  kv_scratch = plgpu.SMEM((WGS, block_kv, D), dtype, transforms=tiles)
  scratch = [
      (kv_scratch, kv_scratch),
      plgpu.SMEM((2, WGS, block_kv, block_q), dtype, transforms=tiles),
      plgpu.SMEM((WGS, block_q, half), jnp.float32, transforms=tiles32),
      (plgpu.Barrier(num_barriers=WGS),) * 2,
      plgpu.Barrier(num_arrivals=WGS, num_barriers=2),
      plgpu.Barrier(num_arrivals=WGS),
  ]
  mesh = plgpu.Mesh(grid=(H, S // (WGS * block_kv)), grid_names=("heads", "kv_seq"),
                    num_threads=WGS + 1, thread_name="wg")

  def kernel_body(*refs):  # plgpu.kernel less its vmap wrapper, which refuses Ref operands
    pl.run_scoped(functools.partial(body, *refs), *scratch, collective_axes="wg")

  # dQ is reduced into, so it starts as zeros: a Ref operand is aliased in and out of the kernel.
  dq_ref = jax.new_ref(jnp.zeros((T, H, D), jnp.float32))
  dk, dv = pl.kernel(kernel_body, out_type=[jax.ShapeDtypeStruct((S, H, D), dtype)] * 2,
                     mesh=mesh, compiler_params=plgpu.CompilerParams(approx_math=True),
                     name="fused_bwd")(q, k, v, do, lse_HxT, delta_HxT, dq_ref)
  dq = dq_ref[...].astype(dtype)
  if G > 1:
    dk = dk.reshape(S, K, G, D).astype(jnp.float32).sum(2).astype(dtype)
    dv = dv.reshape(S, K, G, D).astype(jnp.float32).sum(2).astype(dtype)
  return dq, dk, dv


def attention(q, k, v, fwd_config, max_concurrent_steps=2):
  """JAX's Mosaic GPU forward with `fused_backward` as its VJP; q [T, H, D], k / v [S, K, D]."""
  return _attention(q, k, v, fwd_config, max_concurrent_steps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, cfg, steps):
  from jax.experimental.pallas.ops.gpu import attention_mgpu as mg
  return mg.attention(q[None], k[None], v[None], cfg)[0]


def _fwd(q, k, v, cfg, steps):
  from jax.experimental.pallas.ops.gpu import attention_mgpu as mg
  o, (lse,) = mg._attention_forward(q[None], k[None], v[None], cfg, save_residuals=True)
  return o[0], (q, k, v, o[0], lse[0])


def _bwd(cfg, steps, res, do):
  q, k, v, o, lse = res
  delta = jnp.einsum("thd,thd->ht", o.astype(jnp.float32), do.astype(jnp.float32))
  return fused_backward(q, k, v, do, lse, delta, max_concurrent_steps=steps)


_attention.defvjp(_fwd, _bwd)
