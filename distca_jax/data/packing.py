"""Packing documents into fixed-length per-device token buffers (docs/METHOD.md, "Initial layout").

Documents fill buffer 0, then buffer 1, ... in order; a document that overflows a buffer
continues in the next one, its in-document positions continuing. Every buffer therefore holds
exactly `buffer_len` tokens (memory balance), except trailing padding when the documents run out.

The result is a `Layout`: one row per *shard* (the piece of one document inside one buffer). It is
the input of the CA-task scheduler and of the colocated attention task tables.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PAD_SEGMENT = -1


@dataclasses.dataclass(frozen=True)
class Layout:
  """Shards of documents in buffers. All arrays int64, one entry per shard, ordered by
  (buffer, buffer_offset) which is also document order.

  doc_lens[d]        length of document d (all documents of the batch)
  buffer[s]          which buffer (device) the shard lives in
  buffer_offset[s]   first token of the shard inside its buffer
  doc[s]             document id
  doc_offset[s]      in-document position of the shard's first token
  length[s]          tokens in the shard (>= 1)

  prior: ping-pong's second nano-batch only (`schedule/pingpong.py`): a Layout of the shards of
  this layout's documents that the first nano-batch's buffers hold (the prefix of the document
  the split cut in two), numbered as this layout numbers documents and buffers, `buffer_offset`
  in those buffers. They are not tokens of this layout (no queries, no outputs, not in
  `segment_ids`); its attention reads their K/V rows from the other stream, laid after its own
  rows: K/V row `buffer_len + r` of a device is row r of its prior buffer (`kv_rows`).
  """

  num_buffers: int
  buffer_len: int
  doc_lens: np.ndarray
  buffer: np.ndarray
  buffer_offset: np.ndarray
  doc: np.ndarray
  doc_offset: np.ndarray
  length: np.ndarray
  prior: "Layout | None" = None

  @property
  def num_shards(self) -> int:
    return int(self.length.size)

  @property
  def kv_rows(self) -> int:
    """K/V rows per device its attention reads: its buffer, then a `prior` stream's buffer."""
    return self.buffer_len * (1 if self.prior is None else 2)

  def segment_ids(self, rows=None) -> np.ndarray:
    """[rows, buffer_len] int32 document id per token, PAD_SEGMENT for padding, of buffers `rows`
    (default: all, in order)."""
    rows, starts, shards = self._rows(rows)
    out = np.full((rows.size, self.buffer_len), PAD_SEGMENT, np.int32)
    self._fill(out, starts, shards, lambda length: np.repeat(self.doc[shards], length))
    return out

  def positions(self, rows=None) -> np.ndarray:
    """[rows, buffer_len] int32 in-document position per token (0 for padding) of buffers `rows`
    (default: all, in order)."""
    rows, starts, shards = self._rows(rows)
    out = np.zeros((rows.size, self.buffer_len), np.int32)
    self._fill(out, starts, shards, lambda length: ranges(self.doc_offset[shards], length))
    return out

  def _rows(self, rows):
    """(rows, where each of their shards starts in a [rows, buffer_len] array, those shards)."""
    rows = np.arange(self.num_buffers) if rows is None else np.asarray(rows, np.int64).reshape(-1)
    where = np.full(self.num_buffers, -1, np.int64)
    where[rows] = np.arange(rows.size)
    shards = np.flatnonzero(where[self.buffer] >= 0)
    return rows, where[self.buffer[shards]] * self.buffer_len + self.buffer_offset[shards], shards

  def _fill(self, out: np.ndarray, starts: np.ndarray, shards: np.ndarray, values) -> None:
    """Writes `values(lengths)` (one value per row of `shards`, in order) at their rows of `out`
    (`starts`: where each shard starts in it). Shards that follow one another without a gap,
    as a batch's rows hold them but for padding at its end, are one slice."""
    length = self.length[shards]
    flat = out.reshape(-1)
    if not length.size:
      return
    if starts[0] == 0 and np.array_equal(starts[1:], np.cumsum(length[:-1])):
      flat[:int(starts[-1] + length[-1])] = values(length)
    else:
      flat[ranges(starts, length)] = values(length)

  def locate(self, buffer, offset) -> tuple[np.ndarray, np.ndarray]:
    """(document id, in-document position) of row `offset` of buffer `buffer` (int arrays of one
    shape; PAD_SEGMENT and 0 for padding): a lookup per row, so reading a few rows of a large
    batch costs those rows, not the batch."""
    flat = np.asarray(buffer, np.int64) * self.buffer_len + np.asarray(offset, np.int64)
    if not self.num_shards:
      return np.full(flat.shape, PAD_SEGMENT, np.int64), np.zeros(flat.shape, np.int64)
    starts = self.buffer * self.buffer_len + self.buffer_offset
    order = np.argsort(starts, kind="stable")
    i = np.searchsorted(starts[order], flat, side="right") - 1
    s = order[np.maximum(i, 0)]
    real = (i >= 0) & (flat < starts[s] + self.length[s])
    return (np.where(real, self.doc[s], PAD_SEGMENT),
            np.where(real, flat - starts[s] + self.doc_offset[s], 0))


def run_of(ends: np.ndarray, p: np.ndarray) -> np.ndarray:
  """For each position `p`, how many of the sorted `ends` are <= it (the run it falls in, for
  runs ending at `ends`): `np.searchsorted(ends, p, side="right")`. Positions read in order (a
  process's rows, a half of a batch) are the common case: there each end is placed among the
  positions instead, a search per run rather than per position (~8x faster for 10^6 positions
  in 10^4 runs)."""
  ends = np.asarray(ends)
  p = np.asarray(p)
  if p.ndim != 1 or p.size < 2 * ends.size or (p[1:] < p[:-1]).any():
    return np.searchsorted(ends, p, side="right")
  counts = np.diff(np.searchsorted(p, ends, side="left"), prepend=0, append=p.size)
  return np.repeat(np.arange(ends.size + 1), counts)


def run_values(ends: np.ndarray, p: np.ndarray, *values: np.ndarray) -> tuple[np.ndarray, ...]:
  """`v[run_of(ends, p)]` for each of `values` (one entry per run ending at `ends`, plus one
  past them for a `p` at or past the last end): for positions in order, each value repeated
  over its run's positions, without the index of each position's run."""
  ends = np.asarray(ends)
  p = np.asarray(p)
  if p.ndim != 1 or p.size < 2 * ends.size or (p[1:] < p[:-1]).any():
    run = np.searchsorted(ends, p, side="right")
    return tuple(np.asarray(v)[run] for v in values)
  counts = np.diff(np.searchsorted(p, ends, side="left"), prepend=0, append=p.size)
  if not counts[-1]:  # no position past the last end: values may have one entry per run only
    counts = counts[:-1]
  return tuple(np.repeat(np.asarray(v)[:counts.size], counts) for v in values)


def index_in_runs(counts: np.ndarray) -> np.ndarray:
  """Each element's index within its run, for runs of `counts` elements laid end to end:
  [2, 3] -> [0, 1, 0, 1, 2]."""
  return ranges(0, counts)


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """Concatenation of arange(s, s + l) for each pair, without a Python loop: one running sum of
  ones, each range's first element the jump from the previous range's last."""
  lengths = np.asarray(lengths, np.int64).reshape(-1)
  starts = np.broadcast_to(np.asarray(starts, np.int64).reshape(-1), lengths.shape)
  keep = lengths > 0
  if not keep.all():
    starts, lengths = starts[keep], lengths[keep]
  if not lengths.size:
    return np.zeros(0, np.int64)
  step = np.ones(int(lengths.sum()), np.int64)
  first = np.cumsum(lengths) - lengths
  step[0] = starts[0]
  step[first[1:]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
  return np.cumsum(step, out=step)


def pack(doc_lens, num_buffers: int, buffer_len: int) -> Layout:
  """Lays out documents in order over `num_buffers` buffers of `buffer_len` tokens.

  Raises ValueError if a length is < 1 or the documents do not fit.
  """
  doc_lens = np.asarray(doc_lens, dtype=np.int64).reshape(-1)
  if num_buffers < 1 or buffer_len < 1:
    raise ValueError(f"pack: need num_buffers >= 1 and buffer_len >= 1, got {num_buffers}, {buffer_len}")
  if doc_lens.size and doc_lens.min() < 1:
    raise ValueError(f"pack: document lengths must be >= 1, found {int(doc_lens.min())}")
  capacity = num_buffers * buffer_len
  total = int(doc_lens.sum())
  if total > capacity:
    raise ValueError(f"pack: {total} tokens do not fit {num_buffers} buffers of {buffer_len}")
  doc_start = np.cumsum(doc_lens) - doc_lens  # global flat position of each document
  doc_end = doc_start + doc_lens
  # A document touches buffers first_b .. last_b; one shard per touched buffer.
  first_b = doc_start // buffer_len
  last_b = (doc_end - 1) // buffer_len
  per_doc = np.where(doc_lens > 0, last_b - first_b + 1, 0)
  doc = np.repeat(np.arange(doc_lens.size), per_doc)
  k = index_in_runs(per_doc)
  buffer = first_b[doc] + k
  lo = np.maximum(doc_start[doc], buffer * buffer_len)
  hi = np.minimum(doc_end[doc], (buffer + 1) * buffer_len)
  return Layout(
      num_buffers=num_buffers,
      buffer_len=buffer_len,
      doc_lens=doc_lens,
      buffer=buffer,
      buffer_offset=lo - buffer * buffer_len,
      doc=doc,
      doc_offset=lo - doc_start[doc],
      length=hi - lo,
  )
