"""The task table: the one description of a fused batch of CA-tasks that every backend reads.

A CA-task is a shard of queries of one document with its whole causal KV prefix. In a fused batch
the queries of all tasks are rows of one `q_TxHxD` array and the keys/values rows of one
`k_SxKxD` / `v_SxKxD` array. Task `t` owns query rows `[q_start[t], q_start[t] + q_len[t])` and
reads key rows `[kv_start[t], kv_start[t] + kv_len[t])`; the causal mask is aligned bottom-right:
query `i` of the task sees keys `0 .. kv_len - q_len + i` of its range.

The table has a fixed *capacity* (so that XLA compiles once per capacity); unused entries have
`q_len = 0`. Query ranges of different tasks are disjoint; key ranges may overlap (several shards
of one document share one copy of its prefix). Rows covered by no task produce O = 0 and
LSE = -inf.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class TaskTable(NamedTuple):
  """int32 arrays of shape [capacity]."""

  q_start: jax.Array
  q_len: jax.Array
  kv_start: jax.Array
  kv_len: jax.Array

  @property
  def capacity(self) -> int:
    return self.q_start.shape[-1]


def make_task_table(q_start, q_len, kv_start, kv_len, capacity: int | None = None,
                    num_q_rows: int | None = None, num_kv_rows: int | None = None) -> TaskTable:
  """Validated, capacity-padded numpy task table (host side).

  Raises ValueError if the tasks break the table's rules: negative sizes, q_len > kv_len, ranges
  outside the row counts, overlapping query ranges, or more tasks than `capacity`.
  """
  arrays = [np.asarray(a, np.int64).reshape(-1) for a in (q_start, q_len, kv_start, kv_len)]
  n = arrays[0].size
  if any(a.size != n for a in arrays):
    raise ValueError("task table: the four arrays must have the same length")
  qs, ql, ks, kl = arrays
  if capacity is None:
    capacity = max(n, 1)
  if n > capacity:
    raise ValueError(f"task table: {n} tasks exceed capacity {capacity}")
  if (ql < 0).any() or (kl < 0).any() or (qs < 0).any() or (ks < 0).any():
    raise ValueError("task table: starts and lengths must be >= 0")
  if (ql > kl).any():
    t = int(np.argmax(ql > kl))
    raise ValueError(f"task table: task {t} has q_len {ql[t]} > kv_len {kl[t]}; a task sees its whole prefix")
  if num_q_rows is not None and (qs + ql > num_q_rows).any():
    raise ValueError(f"task table: a query range ends past the {num_q_rows} query rows")
  if num_kv_rows is not None and (ks + kl > num_kv_rows).any():
    raise ValueError(f"task table: a key range ends past the {num_kv_rows} key rows")
  live = ql > 0
  order = np.argsort(qs[live], kind="stable")
  s, e = qs[live][order], (qs + ql)[live][order]
  if s.size > 1 and (s[1:] < e[:-1]).any():
    raise ValueError("task table: query ranges of two tasks overlap")
  pad = capacity - n
  out = [np.concatenate([a, np.zeros(pad, np.int64)]).astype(np.int32) for a in arrays]
  return TaskTable(*out)


def causal_area(tasks: TaskTable) -> np.ndarray:
  """Query-key pairs each task computes: q*kv - q*(q-1)/2 (numpy, float64)."""
  q = np.asarray(tasks.q_len, np.float64)
  kv = np.asarray(tasks.kv_len, np.float64)
  return q * kv - q * (q - 1) / 2


def row_owner(tasks: TaskTable, num_q_rows: int):
  """Per query row: (index of the task that owns it, whether any task does). jnp, traceable,
  O(capacity + num_q_rows): each live task marks its first row, and a running max carries the
  latest mark forward (query ranges are disjoint, so the latest start at or before a row is the
  only candidate owner)."""
  tasks = TaskTable(*(jnp.asarray(a, jnp.int32) for a in tasks))
  T = num_q_rows
  C = tasks.q_start.shape[0]
  rows = jnp.arange(T, dtype=jnp.int32)
  live = (tasks.q_len > 0) & (tasks.q_start < T)
  # Dead tasks write to the spare slot T, which is cut off.
  marks = jnp.full((T + 1,), -1, jnp.int32).at[jnp.where(live, tasks.q_start, T)].set(
      jnp.arange(C, dtype=jnp.int32))[:T]
  last_start = jax.lax.cummax(jnp.where(marks >= 0, rows, -1), axis=0)
  owner = jnp.where(last_start >= 0, marks[jnp.maximum(last_start, 0)], 0)
  covered = (last_start >= 0) & (rows < tasks.q_start[owner] + tasks.q_len[owner])
  return owner, covered


def row_bounds(tasks: TaskTable, num_q_rows: int):
  """Per query row: (first visible key row, last visible key row + 1); (0, 0) for rows outside
  every task. jnp, traceable; O(capacity + num_q_rows)."""
  tasks = TaskTable(*(jnp.asarray(a, jnp.int32) for a in tasks))
  rows = jnp.arange(num_q_rows, dtype=jnp.int32)
  owner, covered = row_owner(tasks, num_q_rows)
  lo = tasks.kv_start[owner]
  hi = lo + tasks.kv_len[owner] - tasks.q_len[owner] + (rows - tasks.q_start[owner]) + 1
  return jnp.where(covered, lo, 0), jnp.where(covered, hi, 0)
