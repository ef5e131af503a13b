"""Ping-pong: split a micro-batch into two nano-batches of equal tokens and balanced Σl².

DESIGN.md §1 "Ping-pong execution". Each nano-batch gets its own plan, and the dispatch of one
overlaps the compute of the other; for that to hide communication both halves must cost the same:
equal tokens (the linear layers and memory) and about equal Σl² (core attention).

Greedy: documents in descending length go whole to the half with the smaller Σl² that has room
for them, else whole to the other half. Only a document that fits in neither half is *cut*: a
prefix fills one half and the suffix goes to the other **as its own document** (its positions
restart at 0 and it does not attend to the prefix: `NanoSplit.cut_pairs` query-key pairs are
lost). The cut point is the one, of the two that fill a half, that loses fewer pairs. At most
one document per micro-batch is cut (after the cut one half is full and everything else goes
to the other), usually a short one near the end of the greedy order; a document longer than a
half is always cut (`attention.pingpong_max_drop` makes the trainer run such a step as one
stream instead). `NanoSplit.source` records the original document and offset of every piece,
for a caller that prefers to keep the original RoPE positions. Halves get ceil(total/2) and
floor(total/2) tokens (exactly equal when the total is even, which it is for N buffers of an
even length).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distca_jax.data.packing import Layout, pack


@dataclasses.dataclass(frozen=True)
class NanoSplit:
  """Two nano-batches. lens[i]: document lengths of half i (0 = Ping, 1 = Pong), in original
  document order; source[i]: [len(lens[i]), 2] int64 (original document id, offset in it)."""

  lens: tuple[np.ndarray, np.ndarray]
  source: tuple[np.ndarray, np.ndarray]

  @property
  def tokens(self) -> tuple[int, int]:
    return int(self.lens[0].sum()), int(self.lens[1].sum())

  @property
  def cut_pairs(self) -> int:
    """Query-key pairs of causal attention the split loses: a document cut at x keeps its
    suffix's l - x queries from the x keys of its prefix."""
    pieces = np.concatenate(self.source)
    cut = pieces[pieces[:, 1] > 0]  # suffixes: (document, offset x)
    lens = np.concatenate(self.lens)[pieces[:, 1] > 0]
    return int(np.sum(cut[:, 1] * lens))

  @property
  def sum_sq(self) -> tuple[float, float]:
    return tuple(float((x.astype(np.float64) ** 2).sum()) for x in self.lens)


def split_pingpong(doc_lens) -> NanoSplit:
  """Greedy equal-token, balanced-Σl² split of one micro-batch's documents (lengths >= 1)."""
  lens = np.asarray(doc_lens, np.int64).reshape(-1)
  if lens.size and lens.min() < 1:
    raise ValueError(f"split_pingpong: document lengths must be >= 1, found {int(lens.min())}")
  total = int(lens.sum())
  room = [-(-total // 2), total // 2]
  sq = [0.0, 0.0]
  pieces: list[list[tuple[int, int, int]]] = [[], []]  # (doc, offset, length)
  # Python loop over documents, not tokens: a micro-batch has at most a few thousand documents.
  for g in np.argsort(-lens, kind="stable").tolist():
    l = int(lens[g])
    fits = [h for h in (0, 1) if room[h] >= l]
    if fits:  # whole, to the half with the smaller sum of squares that has room
      h = min(fits, key=lambda i: sq[i])
      pieces[h].append((g, 0, l))
      room[h] -= l
      sq[h] += float(l) ** 2
      continue
    # Fits in neither: cut. The prefix fills half h (x = room[h] rows) and the suffix goes to
    # the other; of the two halves to fill, the one whose cut loses fewer pairs x * (l - x).
    h = min((0, 1), key=lambda i: room[i] * (l - room[i]))
    x = room[h]
    for half, offset, n in ((h, 0, x), (1 - h, x, l - x)):
      if n:
        pieces[half].append((g, offset, n))
        room[half] -= n
        sq[half] += float(n) ** 2
  out_lens, out_src = [], []
  for h in (0, 1):
    p = sorted(pieces[h])
    out_lens.append(np.asarray([x[2] for x in p], np.int64))
    out_src.append(np.asarray([[x[0], x[1]] for x in p], np.int64).reshape(-1, 2))
  return NanoSplit(lens=tuple(out_lens), source=tuple(out_src))


def pingpong_layouts(doc_lens, num_buffers: int, buffer_len: int) -> tuple[Layout, Layout, NanoSplit]:
  """Ping and Pong layouts over `num_buffers` buffers of `buffer_len // 2` tokens each.

  The micro-batch (at most num_buffers * buffer_len tokens) is split by `split_pingpong` and each
  half packed in order (`data.packing.pack`). Raises ValueError if buffer_len is odd.
  """
  if buffer_len % 2:
    raise ValueError(f"pingpong_layouts: buffer_len must be even, got {buffer_len}")
  split = split_pingpong(doc_lens)
  half = buffer_len // 2
  return pack(split.lens[0], num_buffers, half), pack(split.lens[1], num_buffers, half), split
