"""Ping-pong: split a micro-batch into two nano-batches of equal tokens and balanced Σl².

DESIGN.md §1 "Ping-pong execution". Each nano-batch gets its own plan, and the dispatch of one
overlaps the compute of the other; for that to hide communication both halves must cost the same:
equal tokens (the linear layers and memory) and about equal Σl² (core attention).

Greedy: documents in descending length go to the half with the smaller Σl² that still has room.
When the chosen half has less room than the document, the document is *cut*: its prefix
[0, room) fills that half and the suffix [room, l) goes to the other half **as its own document**
(its positions restart at 0 and it does not attend to the prefix). At most one document per
micro-batch is cut (after the cut one half is full and everything else goes to the other), so
the change to training semantics is one document boundary per micro-batch; `NanoSplit.source`
records the original document and offset of every piece, for a caller that prefers to keep the
original RoPE positions. Halves get ceil(total/2) and floor(total/2) tokens (exactly equal when
the total is even, which it is for N buffers of an even length).
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
    open_ = [h for h in (0, 1) if room[h] > 0]
    h = min(open_, key=lambda i: sq[i]) if len(open_) == 2 else open_[0]
    take = min(l, room[h])
    pieces[h].append((g, 0, take))
    room[h] -= take
    sq[h] += float(take) ** 2
    if take < l:  # cut: the suffix becomes its own document in the other half
      o = 1 - h
      pieces[o].append((g, take, l - take))
      room[o] -= l - take
      sq[o] += float(l - take) ** 2
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
