"""Ping-pong: split a micro-batch into two nano-batches of equal tokens and balanced Σl².

docs/METHOD.md, "Ping-pong execution". Each nano-batch gets its own plan, and the dispatch of one
overlaps the compute of the other; for that to hide communication both halves must cost the same:
equal tokens (the linear layers and memory) and about equal attention (Σl²).

Greedy: documents in descending length go whole to the half with the smaller Σl² (a cut
document's suffix counted with the keys it sees) that has room for them, else whole to the
other half. Only a document that fits in neither half is *cut*: its prefix fills the rest of
Ping (half 0) and its suffix goes to Pong (half 1). At
most one document per micro-batch is cut (after the cut Ping is full and everything else goes to
Pong): a document longer than a half, or a short one near the end of the greedy order.

The cut loses nothing. Pong's layout keeps the suffix as the same document from position x on
(its RoPE positions continue) and records the prefix's shards in Ping's buffers as `prior`
shards (`Layout.prior`); Pong's attention reads the prefix's K/V rows from Ping's rows of the
same layer, which exist before Pong's attention runs (the model projects both streams first).
Pong never needs anything of a later stream, so Ping's dispatch still overlaps Pong's compute.
Halves get ceil(total/2) and floor(total/2) tokens (exactly equal when the total is even, which
it is for N buffers of an even length).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distca_jax.data.packing import Layout, pack


@dataclasses.dataclass(frozen=True)
class NanoSplit:
  """Two nano-batches. lens[i]: document pieces of half i (0 = Ping, 1 = Pong), in original
  document order; source[i]: [len(lens[i]), 2] int64 (original document id, offset in it). A
  piece with offset x > 0 (only ever in Pong) is the suffix of a document whose first x
  positions are Ping's."""

  lens: tuple[np.ndarray, np.ndarray]
  source: tuple[np.ndarray, np.ndarray]

  @property
  def tokens(self) -> tuple[int, int]:
    return int(self.lens[0].sum()), int(self.lens[1].sum())

  @property
  def cut(self) -> tuple[int, int] | None:
    """(original document, prefix length x) of the document cut between Ping and Pong, or None."""
    off = self.source[1][:, 1]
    if not (off > 0).any():
      return None
    j = int(np.argmax(off > 0))
    return int(self.source[1][j, 0]), int(off[j])

  @property
  def areas(self) -> tuple[float, float]:
    """Causal attention area (query-key pairs, diagonal included) of each half: a suffix piece's
    queries see its prefix's keys too."""
    out = []
    for lens, src in zip(self.lens, self.source):
      lo, hi = src[:, 1].astype(np.float64), (src[:, 1] + lens).astype(np.float64)
      out.append(float(((hi - lo) * (hi + lo + 1) / 2).sum()))
    return tuple(out)


def split_pingpong(doc_lens) -> NanoSplit:
  """Greedy equal-token, balanced-attention split of one micro-batch's documents (lengths >= 1)."""
  lens = np.asarray(doc_lens, np.int64).reshape(-1)
  if lens.size and lens.min() < 1:
    raise ValueError(f"split_pingpong: document lengths must be >= 1, found {int(lens.min())}")
  total = int(lens.sum())
  order = np.argsort(-lens, kind="stable")
  pong, cut = _assign(order.tolist(), lens[order].tolist(),
                      (lens[order].astype(np.float64) ** 2).tolist(), -(-total // 2), total // 2)
  in_pong = np.zeros(lens.size, bool)
  in_pong[pong] = True
  ping_docs = np.flatnonzero(~in_pong)
  ping_lens = lens[ping_docs]
  pong_docs = np.flatnonzero(in_pong)
  pong_off = np.zeros(pong_docs.size, np.int64)
  if cut is not None:  # the cut document: its prefix in Ping, its suffix in Pong
    g, x = cut
    ping_lens[np.searchsorted(ping_docs, g)] = x
    at = int(np.searchsorted(pong_docs, g))
    pong_docs, pong_off = np.insert(pong_docs, at, g), np.insert(pong_off, at, x)
  pong_lens = lens[pong_docs] - pong_off
  return NanoSplit(lens=(ping_lens, pong_lens),
                   source=(np.stack([ping_docs, np.zeros_like(ping_docs)], axis=1),
                           np.stack([pong_docs, pong_off], axis=1)))


def _assign(docs: list, lens: list, squares: list, room0: int, room1: int):
  """The greedy's decisions, documents in descending length (`docs`, their `lens` and `squares`
  as floats): (the documents whole in Pong, the cut (document, prefix length) or None). A plain
  Python loop over documents (a micro-batch has at most a few thousand), kept to scalars: each
  step depends on the sums before it."""
  sq0 = sq1 = 0.0
  pong, cut = [], None
  for g, l, l2 in zip(docs, lens, squares):
    if room0 >= l and (sq0 <= sq1 or room1 < l):  # whole, to the half with the smaller Σl²
      room0 -= l                                   # that has room (Ping on a tie)
      sq0 += l2
    elif room1 >= l:
      pong.append(g)
      room1 -= l
      sq1 += l2
    else:
      # Fits in neither: the prefix fills Ping (x >= 1 rows: Pong alone would have room
      # otherwise) and the suffix, whose queries also see the prefix, goes to Pong.
      x = room0
      cut = (g, x)
      room0, room1 = 0, room1 - (l - x)
      sq0 += float(x) ** 2
      sq1 += l2 - float(x) ** 2
  return pong, cut


def pingpong_layouts(doc_lens, num_buffers: int, buffer_len: int) -> tuple[Layout, Layout, NanoSplit]:
  """Ping and Pong layouts over `num_buffers` buffers of `buffer_len // 2` tokens each.

  The micro-batch (at most num_buffers * buffer_len tokens) is split by `split_pingpong` and each
  half packed in order (`data.packing.pack`). Pong's layout always has `prior` shards (none when
  nothing was cut), so both halves of every step have one shape. Raises ValueError if buffer_len
  is odd.
  """
  if buffer_len % 2:
    raise ValueError(f"pingpong_layouts: buffer_len must be even, got {buffer_len}")
  split = split_pingpong(doc_lens)
  half = buffer_len // 2
  ping = pack(split.lens[0], num_buffers, half)
  pong = pack(split.lens[1], num_buffers, half)
  return ping, with_prior(pong, ping, split), split


def with_prior(pong: Layout, ping: Layout, split: NanoSplit) -> Layout:
  """Pong's layout (packed from `split.lens[1]`) with the cut document whole: its length the
  original's, its shards' positions from the cut on, and the prefix's shards in Ping's buffers
  as `prior` shards."""
  empty = np.zeros(0, np.int64)
  doc_lens, doc_offset = pong.doc_lens.copy(), pong.doc_offset.copy()
  prior = dict(buffer=empty, buffer_offset=empty, doc=empty, doc_offset=empty, length=empty)
  cut = split.cut
  if cut is not None:
    g, x = cut
    j = int(np.flatnonzero(split.source[1][:, 0] == g)[0])  # the suffix, in Pong's numbering
    i = int(np.flatnonzero(split.source[0][:, 0] == g)[0])  # the prefix, in Ping's
    doc_lens[j] += x
    doc_offset[pong.doc == j] += x
    mine = ping.doc == i
    prior = dict(buffer=ping.buffer[mine], buffer_offset=ping.buffer_offset[mine],
                 doc=np.full(int(mine.sum()), j, np.int64), doc_offset=ping.doc_offset[mine],
                 length=ping.length[mine])
  return dataclasses.replace(
      pong, doc_lens=doc_lens, doc_offset=doc_offset,
      prior=Layout(num_buffers=pong.num_buffers, buffer_len=pong.buffer_len, doc_lens=doc_lens,
                   **prior))
