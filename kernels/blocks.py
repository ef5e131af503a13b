"""Task table -> block schedule: which (query block, key block) tiles a kernel must visit.

A flash-attention kernel tiles queries into blocks of `block_q` rows and keys into blocks of
`block_k` rows. For a fused batch of CA-tasks most tiles are empty (a query row sees only its own
task's causal prefix), so the kernels visit only the tiles some row can see, and skip the per-element
mask on tiles every row sees in full. Two views of the same set of tiles:

- Query side (forward, dQ): per query block a contiguous run of key blocks
  `[kb_lo, kb_hi)`, of which `[kb_full_lo, kb_full_hi)` need no mask. The run is the hull of the
  rows' visible ranges: exact when a query block lies inside one task (the common case, since
  shards are multiples of 128 tokens), a superset when it straddles two tasks whose key ranges are
  apart. Elements outside a row's range are masked, so a superset is correct, only slower.
- Key side (dK, dV): per key block and per task the run of query blocks of that task that see it,
  `task_q_blocks`. Exact, and each (row, key) pair is visited under exactly one task (its row's
  owner), which is what lets a key block shared by several tasks (shared KV prefix) sum their
  gradients without double counting.

Everything here is jnp and traceable (task tables are runtime data under jit); the key-side
function works on scalars so the kernels call it in-kernel.

Shapes: `_QxB` arrays hold one row per query block and one column per row in it; `_CxN` ones one
row per task and one column per key block.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .tasks import TaskTable, row_bounds


def cdiv(a, b):
  """Ceiling division that works on Python ints and on traced int32 scalars (in kernels too)."""
  if isinstance(a, int) and isinstance(b, int):
    return -(-a // b)
  a = jnp.asarray(a)
  return lax.div(a + (b - 1), jnp.asarray(b, a.dtype))


class QuerySchedule(NamedTuple):
  """Per query row and per query block visibility, for a query array padded to `nq * block_q` rows.

  row_lo, row_hi: int32 [nq * block_q]; row r sees key rows [row_lo[r], row_hi[r]) (empty for
    rows outside every task and for padding rows).
  kb_lo, kb_full_lo, kb_full_hi, kb_hi: int32 [nq]; query block i visits key blocks
    [kb_lo, kb_hi); those in [kb_full_lo, kb_full_hi) are visible to every row of the block (no
    mask needed). kb_lo <= kb_full_lo <= kb_full_hi <= kb_hi always; an empty block has
    kb_lo == kb_hi.
  """

  row_lo: jax.Array
  row_hi: jax.Array
  kb_lo: jax.Array
  kb_full_lo: jax.Array
  kb_full_hi: jax.Array
  kb_hi: jax.Array


def query_schedule(tasks: TaskTable, num_q_rows: int, block_q: int, block_k: int) -> QuerySchedule:
  """The query-side schedule for `num_q_rows` rows padded up to a multiple of `block_q`."""
  nq = cdiv(num_q_rows, block_q)
  tasks = TaskTable(*(jnp.asarray(a, jnp.int32) for a in tasks))
  lo, hi = row_bounds(tasks, nq * block_q)
  lo_QxB = lo.reshape(nq, block_q)
  hi_QxB = hi.reshape(nq, block_q)
  seen = hi_QxB > lo_QxB
  big = jnp.iinfo(jnp.int32).max
  # Hull over rows that see something; rows that see nothing must not widen it.
  hull_lo = jnp.min(jnp.where(seen, lo_QxB, big), axis=1)
  hull_hi = jnp.max(jnp.where(seen, hi_QxB, 0), axis=1)
  any_seen = jnp.any(seen, axis=1)
  kb_lo = jnp.where(any_seen, hull_lo // block_k, 0)
  kb_hi = jnp.where(any_seen, (hull_hi + block_k - 1) // block_k, 0)
  # Columns every row sees: the intersection (empty if any row sees nothing).
  inter_lo = jnp.max(lo_QxB, axis=1)
  inter_hi = jnp.min(jnp.where(seen, hi_QxB, 0), axis=1)
  full_lo = jnp.clip((inter_lo + block_k - 1) // block_k, kb_lo, kb_hi)
  full_hi = jnp.clip(inter_hi // block_k, full_lo, kb_hi)
  i32 = lambda a: a.astype(jnp.int32)
  return QuerySchedule(i32(lo), i32(hi), i32(kb_lo), i32(full_lo), i32(full_hi), i32(kb_hi))


def task_q_blocks(q_start, q_len, kv_start, kv_len, kb, block_q: int, block_k: int):
  """Query blocks of one task that see key block `kb` (scalar ints or int32 scalars).

  Returns (qb_lo, qb_full_lo, qb_full_hi, qb_hi): the task's query blocks that see some key of
  block `kb` are [qb_lo, qb_hi); in [qb_full_lo, qb_full_hi) every row of the query block belongs
  to the task and sees every key of block `kb` (no mask needed). An empty run has qb_lo == qb_hi.
  Rows of the task see keys kv_start .. kv_start + kv_len - q_len + i (bottom-right causal).
  """
  mx, mn = jnp.maximum, jnp.minimum
  k0 = kb * block_k
  k1 = k0 + block_k
  q_end = q_start + q_len
  shift = kv_start + kv_len - q_len  # row i of the task sees keys < shift + i + 1
  # First task row that sees key k0 (rows see more as i grows; every row sees kv_start).
  first_row = q_start + mx(mx(k0, kv_start) - shift, 0)
  hit = (q_len > 0) & (k0 < kv_start + kv_len) & (k1 > kv_start) & (first_row < q_end)
  qb_lo = jnp.where(hit, first_row // block_q, 0)
  qb_hi = jnp.where(hit, cdiv(q_end, block_q), 0)
  # Full: the block's rows lie inside the task, the block's keys start at or after kv_start, and
  # the block's first row already sees its last key k1 - 1.
  rows_in_lo = cdiv(q_start, block_q)
  rows_in_hi = q_end // block_q
  full_lo = mx(mx(rows_in_lo, cdiv(q_start + mx(k1 - 1 - shift, 0), block_q)), qb_lo)
  full_ok = hit & (k0 >= kv_start)
  full_lo = jnp.where(full_ok, mn(full_lo, qb_hi), qb_lo)
  full_hi = jnp.where(full_ok, mx(mn(rows_in_hi, qb_hi), full_lo), full_lo)
  return qb_lo, full_lo, full_hi, qb_hi


def visited_tiles(tasks: TaskTable, num_q_rows: int, num_kv_rows: int, block_q: int,
                  block_k: int):
  """Dense bool masks [nq, nk] (visited, visited-without-mask) from the query-side schedule.

  For tests; O(nq * nk).
  """
  s = query_schedule(tasks, num_q_rows, block_q, block_k)
  nk = cdiv(num_kv_rows, block_k)
  kb = jnp.arange(nk)[None, :]
  visit = (kb >= s.kb_lo[:, None]) & (kb < s.kb_hi[:, None])
  full = (kb >= s.kb_full_lo[:, None]) & (kb < s.kb_full_hi[:, None])
  return visit, full


def key_task_ranges(tasks: TaskTable, num_kv_rows: int, block_q: int, block_k: int):
  """Per key block, the hull [t_lo, t_hi) of task indices that see it: int32 [nk] each.

  The dK/dV kernels loop over these tasks only (not the whole capacity); tasks inside the hull
  that miss the block cost a few scalar loads. The hull is tight when tasks are listed in key
  order, as the scheduler and `make_task_table` callers usually do.
  """
  nk = cdiv(num_kv_rows, block_k)
  t = [jnp.asarray(a, jnp.int32)[:, None] for a in tasks]
  qb_lo, _, _, qb_hi = task_q_blocks(*t, jnp.arange(nk, dtype=jnp.int32)[None, :], block_q,
                                     block_k)
  hit_CxN = qb_hi > qb_lo
  C = hit_CxN.shape[0]
  any_hit = jnp.any(hit_CxN, axis=0)
  t_lo = jnp.where(any_hit, jnp.argmax(hit_CxN, axis=0), 0)
  t_hi = jnp.where(any_hit, C - jnp.argmax(hit_CxN[::-1], axis=0), 0)
  return t_lo.astype(jnp.int32), t_hi.astype(jnp.int32)
