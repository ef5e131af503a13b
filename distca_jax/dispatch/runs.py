"""Following row ranges through the dispatch arrays: what `checks.py` reads a plan with.

The plan's index arrays are written range by range (a task's query rows, a K/V piece), so a
run of consecutive slots mostly names a run of consecutive rows. A check follows *runs*, not
rows: each index array is read once, in a few vectorised passes over the slots that matter, as
its maximal runs (`Table`); a range of rows is then followed through it by cutting the range
where the table's runs start and end (`follow`), work of the ranges, not of their rows. A slot
that is not valid, or a run whose rows fall outside the space they index, marks the item the
range belongs to as bad.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from distca_jax.data.packing import Layout, index_in_runs, ranges


class Runs(NamedTuple):
  """Row ranges being followed: range k holds rows [row, row + n) of device `dev`'s row space,
  which are rows [off, off + n) of item `item` (a task's query rows, a K/V group's slots)."""

  item: np.ndarray
  off: np.ndarray
  dev: np.ndarray
  row: np.ndarray
  n: np.ndarray

  @staticmethod
  def of(item, dev, row, n) -> "Runs":
    """Items' whole ranges (offset 0), empty ones dropped."""
    i64 = lambda a: np.asarray(a, np.int64).reshape(-1)
    item, dev, row, n = map(i64, (item, dev, row, n))
    keep = n > 0
    return Runs(item[keep], np.zeros(int(keep.sum()), np.int64), dev[keep], row[keep], n[keep])

  def take(self, mask) -> "Runs":
    return Runs(*(a[mask] for a in self))

  def concat(self, *others: "Runs") -> "Runs":
    return Runs(*(np.concatenate(parts) for parts in zip(self, *others)))


class Table(NamedTuple):
  """A map from one row space to another as runs: rows [start, start + n) of `key`'s device
  (key = device * width + row, sorted, the runs disjoint) go to rows [to_row, to_row + n) of
  device `to_dev`."""

  key: np.ndarray
  n: np.ndarray
  to_dev: np.ndarray
  to_row: np.ndarray
  width: int


def cut(r: Runs, at: int) -> Runs:
  """Each range that holds both rows below `at` and rows from it, cut in two there."""
  split = (r.row < at) & (r.row + r.n > at)
  if not split.any():
    return r
  s = r.take(split)
  head = at - s.row
  lower = s._replace(n=head)
  upper = Runs(s.item, s.off + head, s.dev, np.full(s.n.size, at, np.int64), s.n - head)
  return r.take(~split).concat(lower, upper)


def split_at(r: Runs, width: int, points: np.ndarray) -> Runs:
  """The ranges cut at `points` (sorted keys device * width + row)."""
  key = r.dev * width + r.row
  end = key + r.n
  lo = np.searchsorted(points, key, side="right")
  k = np.searchsorted(points, end, side="left") - lo  # cut points inside each range
  if not k.any():
    return r
  parent = np.repeat(np.arange(key.size), k + 1)
  j = index_in_runs(k + 1)
  at = lo[parent] + j
  first = np.where(j == 0, key[parent], points[np.maximum(at - 1, 0)])
  last = np.where(j == k[parent], end[parent], points[np.minimum(at, max(points.size - 1, 0))])
  shift = first - key[parent]
  return Runs(r.item[parent], r.off[parent] + shift, r.dev[parent], r.row[parent] + shift,
              last - first)


def follow(r: Runs, table: Table, limit: int) -> tuple[Runs, np.ndarray]:
  """(the ranges mapped through `table`, the items of ranges it does not map): a range is cut
  where the table's runs start and end; a piece in no run, or mapped outside rows [0, limit) of
  its new device, is not mapped."""
  inside = (r.row >= 0) & (r.row + r.n <= table.width)
  bad = r.item[~inside]
  r = r.take(inside)
  points = np.unique(np.concatenate([table.key, table.key + table.n]))
  r = split_at(r, table.width, points)
  key = r.dev * table.width + r.row
  k = np.searchsorted(table.key, key, side="right") - 1
  kk = np.maximum(k, 0)
  hit = (k >= 0) & (key < table.key[kk] + table.n[kk]) if table.key.size else np.zeros(key.size, bool)
  row = table.to_row[kk] + (key - table.key[kk]) if table.key.size else key
  dev = table.to_dev[kk] if table.key.size else key
  ok = hit & (row >= 0) & (row + r.n <= limit)
  return (Runs(r.item[ok], r.off[ok], dev[ok], row[ok], r.n[ok]),
          np.concatenate([bad, r.item[~ok]]))


def table_of(idx: np.ndarray, valid: np.ndarray, dev, start, n) -> Table:
  """The maximal runs of index array `idx` [N, W] (consecutive valid slots of one row holding
  consecutive values) over the slots [start, start + n) of devices `dev` (sorted by device then
  start, disjoint): the valid flags of those slots are read once, as the contiguous spans they
  form (a device's whole row, a sender's blocks one after another), and the values of the valid
  ones, which lie in a few segments (a buffer is filled from its start), a few element-wise
  passes over each and no index per slot."""
  width = idx.shape[-1]
  dev, start, n = np.broadcast_arrays(*(np.asarray(a, np.int64).reshape(-1)
                                        for a in (dev, start, n)))
  keep = n > 0
  lo = (dev * width + start)[keep]
  hi = lo + n[keep]
  if not width or not lo.size:
    z = np.zeros(0, np.int64)
    return Table(z, z, z, z, max(width, 1))
  # Regions that touch are one span of the flattened array.
  first = np.flatnonzero(np.concatenate([[True], lo[1:] != hi[:-1]]))
  lo, hi = lo[first], np.append(hi[first[1:] - 1], hi[-1])
  ok = _spans(valid.reshape(-1), lo, hi)
  at = np.cumsum(hi - lo) - (hi - lo)  # where each span starts in `ok`
  # The valid slots' segments: `ok` changes, or a span starts, at their ends.
  cuts = np.union1d(_changes(ok), at)
  seg = cuts[ok[cuts]]
  seg_end = np.append(cuts, ok.size)[np.searchsorted(cuts, seg, side="right")]
  span = np.searchsorted(at, seg, side="right") - 1
  seg_lo = seg - at[span] + lo[span]
  seg_hi = seg_lo + (seg_end - seg)
  flat = idx.reshape(-1)
  if seg.size * _FEW <= ok.size:  # few segments: read in place
    return _segment_runs(flat, seg_lo, seg_hi, width)
  return _runs(_spans(flat, lo, hi)[ok], seg_lo, seg_hi, width)


def mask_table(valid: np.ndarray, dev: np.ndarray) -> Table:
  """The rows of devices `dev` (sorted) that `valid` [len(dev), W] marks, as runs each mapped to
  itself: rows a device reads in place."""
  width = valid.shape[-1]
  edge = np.diff(valid.astype(np.int8), axis=1, prepend=0, append=0)
  d, start = np.nonzero(edge == 1)
  end = np.nonzero(edge == -1)[1]  # (row-major: each run's end follows its start)
  dev = np.asarray(dev, np.int64)[d]
  return Table(dev * width + start, end - start, dev, start.astype(np.int64), max(width, 1))


def _changes(ok: np.ndarray) -> np.ndarray:
  """The positions i > 0 where ok[i] != ok[i - 1], a chunk at a time."""
  last = ok.size - 1
  out = [np.flatnonzero(ok[c + 1:min(c + _CHUNK, last) + 1] != ok[c:min(c + _CHUNK, last)])
         + (c + 1) for c in range(0, last, _CHUNK)]
  return np.concatenate(out) if out else np.zeros(0, np.int64)


def _segment_runs(flat: np.ndarray, lo: np.ndarray, hi: np.ndarray, width: int) -> Table:
  """`_runs` of the slots [lo, hi) of `flat` (an [N, width] array's, all valid), each segment
  read in place a chunk at a time: no copy of the values, and temporaries of one chunk."""
  if not lo.size:
    z = np.zeros(0, np.int64)
    return Table(z, z, z, z, width)
  begins = []
  for a, b in zip(lo.tolist(), hi.tolist()):
    begins.append(np.array([a], np.int64))
    for c in range(a, b, _CHUNK):
      v = flat[max(c - 1, a):min(c + _CHUNK, b)]
      # (int32 differences may wrap only for values a run's range check then refuses)
      begins.append(np.flatnonzero(np.subtract(v[1:], v[:-1]) != 1) + (max(c - 1, a) + 1))
  row_starts = ranges(lo // width + 1, (hi - 1) // width - lo // width) * width
  key = np.union1d(np.concatenate(begins), row_starts)  # a run ends where a row does too
  seg = np.searchsorted(lo, key, side="right") - 1
  end = np.minimum(np.append(key[1:], hi[-1]), hi[seg])
  return Table(key, end - key, key // width, flat[key].astype(np.int64), width)


_CHUNK = 1 << 16  # slots read at a time: a chunk's temporaries are reused, not fresh memory
_FEW = 64  # segments are few when they average this many slots


def _runs(values: np.ndarray, lo: np.ndarray, hi: np.ndarray, width: int) -> Table:
  """The maximal runs of consecutive values in `values`, the contents of flat slots [lo, hi)
  of an [N, width] array, one segment after another (a run ends where a segment or a row
  does)."""
  if not values.size:
    z = np.zeros(0, np.int64)
    return Table(z, z, z, z, width)
  at = np.cumsum(hi - lo) - (hi - lo)  # where each segment starts in `values`
  # A slot continues the one before it when it holds the next value (int32 differences may
  # wrap only for values a run's range check then refuses).
  cont = np.empty(values.size, bool)
  cont[0] = False
  np.equal(np.subtract(values[1:], values[:-1]), 1, out=cont[1:])
  cont[at] = False
  row_starts = ranges(lo // width + 1, (hi - 1) // width - lo // width)  # rows begun inside
  if row_starts.size:
    seg = np.searchsorted(lo, row_starts * width, side="right") - 1
    cont[at[seg] + row_starts * width - lo[seg]] = False
  begins = np.flatnonzero(~cont)
  seg = np.searchsorted(at, begins, side="right") - 1
  key = begins - at[seg] + lo[seg]
  return Table(key, np.diff(np.append(begins, values.size)), key // width,
               values[begins].astype(np.int64), width)


def _spans(a: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
  """`a[lo:hi]` of each span, one after another (a view for one span)."""
  if lo.size <= 1:
    return a[int(lo[0]):int(hi[0])] if lo.size else a[:0]
  return np.concatenate([a[i:j] for i, j in zip(lo.tolist(), hi.tolist())])


def exchange_table(count: np.ndarray, recv_off: np.ndarray, send_off: np.ndarray, servers,
                   width: int) -> Table:
  """Rows of the receive buffers (`width` rows) of `servers` to the send-buffer slots they were
  sent from: server s's rows [recv_off[s, h], + count[h, s]) are sender h's slots
  [send_off[h, s], + count[h, s])."""
  servers = np.unique(np.asarray(servers, np.int64))
  at, sender = np.nonzero(count[:, servers].T > 0)  # per server, senders in order: offsets grow
  s = servers[at]
  key = s * width + recv_off[s, sender].astype(np.int64)
  return Table(key, count[sender, s].astype(np.int64), sender.astype(np.int64),
               send_off[sender, s].astype(np.int64), width)


def send_regions(count: np.ndarray, send_off: np.ndarray, receivers, checked):
  """(sender, first slot, slots) of the send buffers to read: a checked device's every row it
  sends, and the blocks other senders send `receivers`; sorted by sender."""
  n = count.shape[0]
  checked = np.unique(np.asarray(checked, np.int64))
  receivers = np.unique(np.asarray(receivers, np.int64))
  own = np.zeros(n, bool)
  own[checked] = True
  h, j = np.nonzero((count[:, receivers] > 0) & ~own[:, None])
  s = receivers[j]
  dev = np.concatenate([checked, h])
  start = np.concatenate([np.zeros(checked.size, np.int64), send_off[h, s].astype(np.int64)])
  size = np.concatenate([count[checked].sum(1, dtype=np.int64), count[h, s].astype(np.int64)])
  order = np.lexsort((start, dev))
  return dev[order], start[order], size[order]


def shard_table(layout: Layout) -> Table:
  """A buffer's rows to (document, in-document position), as `layout`'s shards: rows outside
  every shard (padding) are in no run."""
  T = layout.buffer_len
  key = layout.buffer * T + layout.buffer_offset
  order = np.argsort(key, kind="stable")
  if not np.all(order == np.arange(order.size)):
    key = key[order]
  return Table(np.asarray(key, np.int64), layout.length[order].astype(np.int64),
               layout.doc[order].astype(np.int64), layout.doc_offset[order].astype(np.int64), T)
