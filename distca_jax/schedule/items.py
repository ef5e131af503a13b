"""CA-task items: the units of attention work the scheduler places, derived from a packed layout.

docs/METHOD.md "CA-tasks". A task is a range of query positions [q_lo, q_hi) of one document, whose
keys are the document prefix [0, q_hi) (bottom-right causal). Every task has one *home* device,
the buffer that holds its query rows; its rows there are [home_off, home_off + q_hi - q_lo).

Items. The layout (`distca_jax.data.packing.Layout`) has one shard per (document, buffer): a
whole document, or the part of a document that overflows into the next buffers. Each shard is
one initial item on its home device. The paper's head+tail item (chunks [i] and [n-1-i] of a
document split over ranks, constant causal cost) arises only from context-parallel layouts; in a
packed layout a spanning document is contiguous per buffer, so its items are its per-buffer
shards. (The head+tail chunking is used by the per-document CP baseline in `baselines.py`.)
Splitting an item moves a contiguous query sub-range [x, y) to a server; what remains at home
([q_lo, x) and [y, q_hi)) stays as up to two home tasks. Query rows of every task are therefore
contiguous in the home buffer, which the dispatch arrays rely on.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from distca_jax.data.packing import Layout

# Flash-attention tile: shards of at least this many rows keep the fused kernel efficient, and
# cut points at multiples of it in document coordinates keep tiles aligned (docs/METHOD.md "The idea").
GRANULE = 128


def row_bucket(rows: int, buffer_len: int) -> int:
  """Smallest bucket >= rows: multiples of max(128, T/8) up to T, then T times powers of two."""
  unit = max(128, buffer_len // 8)
  rows = max(int(rows), 1)
  if rows <= buffer_len:
    return min(-(-rows // unit) * unit, max(buffer_len, unit))
  return buffer_len * (1 << math.ceil(math.log2(rows / buffer_len)))


def task_bucket(n: int, minimum: int = 8) -> int:
  """Smallest power of two >= max(n, minimum): task tables (and other counts that size a
  compiled array) come in few sizes, so the jitted step recompiles rarely."""
  return max(minimum, 1 << max(0, int(n - 1).bit_length()))


# Steps per octave of the exchange buffers' buckets: at most 2^(1/4) - 1 = 19% padding, and few
# enough sizes that a run's buffers (which only grow) compile a handful of times.
BUFFER_BUCKET_STEPS = 4


def buffer_bucket(rows: int) -> int:
  """Rows of an exchange buffer or block holding `rows`: 0 for 0 (nothing moves, the exchange is
  skipped), else the smallest 128 * 2^(i/4), rounded up to a multiple of 8, that holds them. Its
  size follows the rows that move, never the buffer length or N."""
  rows = int(rows)
  if rows <= 0:
    return 0
  i = max(0, math.ceil(BUFFER_BUCKET_STEPS * math.log2(rows / GRANULE) - 1e-9))
  while True:
    bucket = -(-math.ceil(GRANULE * 2.0 ** (i / BUFFER_BUCKET_STEPS)) // 8) * 8
    if bucket >= rows:
      return bucket
    i += 1


def exchange_capacity(moved: int, buffer_len: int) -> int:
  """Rows per (device, server) block of the all_to_all: 0 when no row moves (the exchange is
  skipped: a balanced batch costs what colocated attention costs), else a bucket."""
  return 0 if moved == 0 else row_bucket(moved, buffer_len)


@dataclasses.dataclass(frozen=True)
class Tasks:
  """Struct of int64 arrays, one entry per CA-task.

  home[t]      device whose buffer holds the task's query rows
  doc[t]       document id (index into layout.doc_lens)
  q_lo, q_hi   query positions in the document; keys are [0, q_hi)
  home_off[t]  buffer row of position q_lo on the home device
  server[t]    device that computes the task (== home: stays local)
  """

  home: np.ndarray
  doc: np.ndarray
  q_lo: np.ndarray
  q_hi: np.ndarray
  home_off: np.ndarray
  server: np.ndarray

  @property
  def size(self) -> int:
    return int(self.home.size)

  @property
  def q_len(self) -> np.ndarray:
    return self.q_hi - self.q_lo

  @property
  def kv_len(self) -> np.ndarray:
    return self.q_hi

  def area(self) -> np.ndarray:
    """Query-key pairs per task (float64)."""
    return (self.q_hi - self.q_lo) * (self.q_hi + self.q_lo + 1.0) / 2.0

  def sorted(self) -> "Tasks":
    """Ordered by (home, home_off): document order inside each home buffer."""
    key = self.home * (int(self.home_off.max(initial=0)) + 1) + self.home_off
    if key.size < 2 or (key[1:] >= key[:-1]).all():
      return self
    order = np.argsort(key, kind="stable")
    return Tasks(*(getattr(self, f.name)[order] for f in dataclasses.fields(self)))


def validate_layout(layout: Layout) -> None:
  """Raises ValueError naming the problem if the layout is not a valid packing.

  Checks: positive buffer count and length; every shard length >= 1; shards inside their buffer;
  no two shards overlap in a buffer; shard ranges inside their document; every document covered
  exactly once, in order, by its shards (lengths >= 1) and its `prior` shards (ping-pong).
  """
  n, t = layout.num_buffers, layout.buffer_len
  if n < 1 or t < 1:
    raise ValueError(f"layout: need num_buffers >= 1 and buffer_len >= 1, got {n}, {t}")
  doc_lens = np.asarray(layout.doc_lens)
  if doc_lens.size and doc_lens.min() < 1:
    raise ValueError(f"layout: document lengths must be >= 1, found {int(doc_lens.min())}")
  arrays = (layout.buffer, layout.buffer_offset, layout.doc, layout.doc_offset, layout.length)
  if len({a.shape for a in arrays}) != 1:
    raise ValueError("layout: buffer, buffer_offset, doc, doc_offset and length differ in length")
  if layout.num_shards == 0:
    if doc_lens.size:
      raise ValueError("layout: documents but no shards")
    return
  if layout.length.min() < 1:
    raise ValueError(f"layout: shard lengths must be >= 1, found {int(layout.length.min())}")
  if layout.buffer_offset.min() < 0 or layout.doc_offset.min() < 0:
    raise ValueError("layout: negative buffer_offset or doc_offset")
  if layout.buffer.min() < 0 or layout.buffer.max() >= n:
    raise ValueError(f"layout: shard buffer index outside [0, {n})")
  end = layout.buffer_offset + layout.length
  if end.max() > t:
    s = int(np.argmax(end > t))
    raise ValueError(f"layout: shard {s} ends at row {int(end[s])} of a buffer of {t} tokens "
                     "(layout does not match the buffer size)")
  if layout.doc.min() < 0 or layout.doc.max() >= doc_lens.size:
    raise ValueError("layout: shard document id outside doc_lens")
  if (layout.doc_offset + layout.length > doc_lens[layout.doc]).any():
    raise ValueError("layout: a shard runs past the end of its document")
  key = layout.buffer * t + layout.buffer_offset
  if (key[1:] < key[:-1]).any():  # packed layouts are already in buffer order
    order = np.argsort(key, kind="stable")
    b, o, e = layout.buffer[order], layout.buffer_offset[order], end[order]
  else:
    b, o, e = layout.buffer, layout.buffer_offset, end
  if ((b[1:] == b[:-1]) & (o[1:] < e[:-1])).any():
    raise ValueError("layout: two shards overlap in one buffer")
  doc, doc_off, length = layout.doc, layout.doc_offset, layout.length
  if layout.prior is not None:  # shards of its documents another stream holds (ping-pong)
    p = layout.prior
    if (p.num_buffers, p.buffer_len) != (n, t) or not np.array_equal(p.doc_lens, doc_lens):
      raise ValueError("layout: its prior shards are for other buffers or documents")
    if p.num_shards and (p.length.min() < 1 or p.buffer.min() < 0 or p.buffer.max() >= n
                         or p.buffer_offset.min() < 0 or (p.buffer_offset + p.length).max() > t
                         or p.doc.min() < 0 or p.doc.max() >= doc_lens.size):
      raise ValueError("layout: a prior shard lies outside its buffers or documents")
    doc, doc_off, length = (np.concatenate([doc, p.doc]), np.concatenate([doc_off, p.doc_offset]),
                            np.concatenate([length, p.length]))
  covered = np.bincount(doc, weights=length, minlength=doc_lens.size)
  if (covered != doc_lens).any():
    d = int(np.argmax(covered != doc_lens))
    raise ValueError(f"layout: document {d} has {int(doc_lens[d])} tokens but its shards cover "
                     f"{int(covered[d])}")
  # Each document's shards follow each other from position 0 (with the sum above: every
  # position exactly once).
  order = np.lexsort((doc_off, doc))
  d_, o_, l_ = doc[order], doc_off[order], length[order]
  first = np.r_[True, d_[1:] != d_[:-1]]
  bad = np.where(first, o_ != 0, o_ != np.r_[0, (o_ + l_)[:-1]])
  if bad.any():
    raise ValueError(f"layout: the shards of document {int(d_[np.argmax(bad)])} do not cover its "
                     "positions in order (a gap or an overlap)")


def initial_tasks(layout: Layout, validate: bool = True) -> Tasks:
  """One task per layout shard, computed on its home device (the colocated assignment)."""
  if validate:
    validate_layout(layout)
  i64 = lambda a: np.asarray(a, np.int64)
  return Tasks(home=i64(layout.buffer), doc=i64(layout.doc), q_lo=i64(layout.doc_offset),
               q_hi=i64(layout.doc_offset + layout.length), home_off=i64(layout.buffer_offset),
               server=i64(layout.buffer))
