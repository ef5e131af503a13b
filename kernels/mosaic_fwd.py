"""Mosaic GPU attention forward (Hopper) over a fused CA-task batch, after JAX's `attention_mgpu`
(FA3's two compute warpgroups taking turns at the tensor cores, a memory warpgroup streaming K
and V), with persistent CTAs.

`forward` runs `ctas` CTAs (one per SM by default) that loop over the (query tile, head) units,
heaviest tiles first, every head of a tile side by side, dealt to the CTAs in snake order
(`snake_units`), so a CTA's fixed work overlaps its neighbours' instead of ending the CTA: its
memory warpgroup streams the next unit's first K / V blocks while the compute warpgroups finish
the last unit (one flat step sequence over all its units), each compute warpgroup loads the next
unit's Q rows into a second buffer, and O and LSE leave by TMA without a wait. Short-document
batches have units of few key blocks, whose fixed cost a CTA per unit would pay alone.

The key blocks a query tile visits are the query-side block schedule's [kb_lo, kb_hi) for its
rows (`blocks.py`); those in [kb_full_lo, kb_full_hi) every row sees whole and run unmasked, the
others mask each element to its row's key range (one unsigned compare). Both warpgroups take the
same steps, so the turn barrier stays paired.

Shapes: T query rows, S key rows, H query heads, K KV heads, G = H / K, D head dim; NQ query
tiles of WGS · BLOCK_Q rows, P CTAs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .blocks import cdiv, query_schedule
from .common import LOG2E, pad_rows, row_ranges, visible
from .tasks import TaskTable

WGS = 2          # compute warpgroups per CTA, taking turns at the tensor cores
BLOCK_Q = 64     # query rows per compute warpgroup (a query tile: WGS * BLOCK_Q rows of one head)
BLOCK_KV = 128   # key rows per step
STAGES = 2       # key blocks in flight


def _take_turn(turn):
  """The forward's two compute warpgroups meet at `turn` (two arrivals): each passes the tensor
  cores to the other."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  plgpu.barrier_arrive(turn)
  plgpu.barrier_wait(turn)


def _key_blocks(qo_smem, k_smem, v_smem, bars, sched, n, lo, length, carry, *, scale2: float,
                g0, total):
  """One query tile's key blocks in a forward compute warpgroup: (acc, m, l) after the n blocks
  from kb_lo of `sched` (kb_lo, full_lo, full_hi), those outside [full_lo, full_hi) masked to
  each row's key range [lo, lo + length). K and V block j sit in stage slot
  (g0 + j) % STAGES of the CTA's flat step sequence; while block j's P·V runs, the warpgroup waits
  for block j + 1's K if g0 + j + 1 < total (the CTA's step count)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  k_bars, v_bars, k_consumed, v_consumed, turn = bars
  kb_lo, full_lo, full_hi = sched
  stages = STAGES
  dtype = qo_smem.dtype
  tile = lambda x: lax.broadcast_in_dim(x, (BLOCK_Q, BLOCK_KV), [0])

  take_turn = functools.partial(_take_turn, turn)

  def kv_step(j, carry, masked: bool):
    acc, m_i, l_i = carry
    g = g0 + j
    slot = lax.rem(g, jnp.array(stages, g.dtype))

    def qk_mm(acc_ref):
      plgpu.wgmma(acc_ref, qo_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
      take_turn()
      return acc_ref[...]

    qk = pl.run_scoped(qk_mm, plgpu.ACC((BLOCK_Q, BLOCK_KV), jnp.float32))
    plgpu.barrier_arrive(k_consumed.at[slot])
    if masked:  # each row to its key range; a row that has seen nothing yet keeps m = -inf
      col = (kb_lo + j) * BLOCK_KV + plgpu.broadcasted_iota(
          jnp.int32, (BLOCK_Q, BLOCK_KV), 1, layout=plgpu.Layout.WGMMA)
      qk = jnp.where(visible(col, tile(lo), tile(length)), qk, -jnp.inf)
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


def num_sms() -> int:
  """Streaming multiprocessors of this process's first device (a GPU's `core_count`; a remote
  device of a multi-host job may not say); 132 (a Hopper SXM card's) where it does not say (e.g.
  lowering for CUDA on a CPU)."""
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


def _tile_schedule(tasks: TaskTable, T: int):
  """The query tiles' block schedule: (Tp rows padded to the tiles, the `query_schedule` of
  WGS · BLOCK_Q-row tiles and BLOCK_KV-key blocks, its [kb_lo, kb_full_lo, kb_full_hi, kb_hi] as
  a [4, NQ] array, and the tiles in descending order of their key blocks, ties in row order, so
  the short ones fill the launch's tail)."""
  rows_cta = WGS * BLOCK_Q
  Tp = cdiv(T, rows_cta) * rows_cta
  sch = query_schedule(tasks, Tp, rows_cta, BLOCK_KV)
  sched_4xNQ = jnp.stack([sch.kb_lo, sch.kb_full_lo, sch.kb_full_hi, sch.kb_hi])
  order_NQ = jnp.argsort(sch.kb_lo - sch.kb_hi, stable=True).astype(jnp.int32)
  return Tp, sch, sched_4xNQ, order_NQ


def _cta_steps(sch, order_NQ, heads: int, P: int):
  """[P] int32: each CTA's key-block steps over all its units (the compute warpgroups' last K
  wait needs the count)."""
  units = order_NQ.shape[0] * heads
  rounds, position, _ = snake_units(P, units)
  r_RxP, c_RxP = jnp.meshgrid(jnp.arange(rounds, dtype=jnp.int32), jnp.arange(P, dtype=jnp.int32))
  pos = position(r_RxP, c_RxP)
  steps = jnp.maximum(sch.kb_hi - sch.kb_lo, 0)[order_NQ][jnp.minimum(pos, units - 1) // heads]
  return jnp.sum(jnp.where(pos < units, steps, 0), axis=1, dtype=jnp.int32)


# The kernel builders (`forward`, `mosaic_bwd.backward_from_stats`) are jitted, so the call sites
# of a model (a layer's forward, its rematerialised forward, its backward; every layer) share one
# lowering of each kernel: JAX lowers a jitted function once per distinct input shape and static
# arguments. Lowered at each site instead, every Mosaic GPU module came out distinct (jaxlib
# stamps a per-process counter into each module before hashing it) and XLA compiled the kernels
# again for every layer.
@functools.partial(jax.jit, static_argnames=("scale", "ctas"))
def forward(q_TxHxD, k_SxKxD, v_SxKxD, tasks: TaskTable, scale: float, ctas: int = -1):
  """O [T, H, D] in q's dtype and natural-log LSE [T, H] float32 (-inf and O = 0 for rows that
  see nothing) from `ctas` persistent CTAs (-1: one per SM; at most one per unit)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  T, H, D = q_TxHxD.shape
  S, K, _ = k_SxKxD.shape
  G = H // K
  Sp = cdiv(S, BLOCK_KV) * BLOCK_KV
  Tp, sch, sched, order = _tile_schedule(tasks, T)
  dtype = q_TxHxD.dtype
  rows_cta = WGS * BLOCK_Q
  units = order.shape[0] * H
  P = min(num_sms() if ctas == -1 else int(ctas), units)
  if P < 1:
    raise ValueError(f"mosaic forward: {ctas} persistent CTAs; give -1 (one per SM) or >= 1")
  _, position, count = snake_units(P, units)
  totals = _cta_steps(sch, order, H, P)
  bounds = row_ranges(sch.row_lo, sch.row_hi)  # [2, Tp]
  c = float(scale) * LOG2E
  tiles16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  row_layout = plgpu.Layout.WGMMA.reduce(1)  # per query row of a [rows, keys] tile
  stages = STAGES

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
        return pl.ds(qt * rows_cta + wg * BLOCK_Q, BLOCK_Q)

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

        m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), row_layout)
        l_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0, jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.full((BLOCK_Q, D), 0, jnp.float32), plgpu.Layout.WGMMA)
        n = kb_hi - kb_lo
        # The turns, per unit: warpgroup 1 starts a turn behind and warpgroup 0 hands it back
        # after its last P·V, so each one's epilogue runs beside the other's matmuls.
        pl.when(wg == 1)(take_turn)
        acc, m_i, l_i = _key_blocks(
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

          keys = pl.ds((kb_lo + j) * BLOCK_KV, BLOCK_KV)
          plgpu.copy_gmem_to_smem(k_ref.at[keys, kh], k_smem.at[slot], k_bars.at[slot])
          plgpu.copy_gmem_to_smem(v_ref.at[keys, kh], v_smem.at[slot], v_bars.at[slot])

        return g0 + n

      lax.fori_loop(0, n_units, unit_loads, jnp.int32(0))

  def entry(q_ref, k_ref, v_ref, sched_ref, bounds_ref, order_ref, totals_ref, o_ref, lse_ref):
    smem = (plgpu.SMEM((2, WGS, BLOCK_Q, D), dtype, transforms=tiles16),  # Q, then O
            plgpu.SMEM((stages, BLOCK_KV, D), dtype, transforms=tiles16),
            plgpu.SMEM((stages, BLOCK_KV, D), dtype, transforms=tiles16),
            plgpu.SMEM((2, WGS, BLOCK_Q), jnp.float32),
            plgpu.SMEM((2, WGS, 2, BLOCK_Q), jnp.int32))
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
      compiler_params=plgpu.CompilerParams(approx_math=True), name="ca_tasks_fwd")(
      pad_rows(q_TxHxD, Tp), pad_rows(k_SxKxD, Sp), pad_rows(v_SxKxD, Sp), sched, bounds, order,
      totals)
  return o[:T], lse.T[:T]
