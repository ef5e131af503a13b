"""Batches of packed documents: the synthetic source and the common `Batch` structure.

A source is deterministic per step (`source.batch(step)`), so resuming at step k needs nothing
but k. Every source returns the documents of one global batch as lengths plus a flat token stream;
`make_batch` packs them into per-device buffers (packing.py) and builds next-token targets.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .doclens import LengthSampler, load_lengths
from .packing import PAD_SEGMENT, Layout, pack


@dataclasses.dataclass(frozen=True)
class Batch:
  """One global batch, host side. Arrays are [num_buffers, buffer_len]; buffer b goes to device b
  of the `data` axis."""

  tokens: np.ndarray       # int32
  targets: np.ndarray      # int32, next token of the same document (0 where there is none)
  loss_mask: np.ndarray    # float32, 1 where `targets` is a real next token
  segment_ids: np.ndarray  # int32 document id, PAD_SEGMENT for padding
  positions: np.ndarray    # int32 in-document position (RoPE)
  layout: Layout


def make_batch(doc_lens: np.ndarray, tokens_flat: np.ndarray, num_buffers: int, buffer_len: int) -> Batch:
  """Packs documents (lengths + their concatenated tokens) into buffers with targets."""
  layout = pack(doc_lens, num_buffers, buffer_len)
  total = num_buffers * buffer_len
  if tokens_flat.size != int(np.sum(doc_lens)):
    raise ValueError(f"make_batch: {tokens_flat.size} tokens for documents totalling {int(np.sum(doc_lens))}")
  tokens = np.zeros(total, np.int32)
  tokens[: tokens_flat.size] = tokens_flat
  segment_ids = layout.segment_ids()
  seg = segment_ids.reshape(-1)
  same_doc = np.zeros(total, bool)
  same_doc[:-1] = (seg[1:] == seg[:-1]) & (seg[:-1] != PAD_SEGMENT)
  targets = np.zeros(total, np.int32)
  targets[:-1] = np.where(same_doc[:-1], tokens[1:], 0)
  shape = (num_buffers, buffer_len)
  return Batch(tokens=tokens.reshape(shape), targets=targets.reshape(shape),
               loss_mask=same_doc.astype(np.float32).reshape(shape), segment_ids=segment_ids,
               positions=layout.positions(), layout=layout)


@dataclasses.dataclass
class SyntheticSource:
  """Document lengths from a distribution, tokens with learnable structure.

  Each document is an arithmetic progression modulo the vocabulary with a random start and a
  stride from a small set: predicting the next token needs the previous two of the same document,
  so loss falls only if attention works and stays inside documents.
  """

  sampler: LengthSampler
  vocab_size: int
  num_buffers: int
  buffer_len: int
  strides: tuple[int, ...] = (1, 2, 3, 5, 7)

  def doc_lengths(self, step: int) -> np.ndarray:
    return self.sampler.sample(self.num_buffers * self.buffer_len, step)

  def batch(self, step: int) -> Batch:
    doc_lens = self.doc_lengths(step)
    rng = np.random.default_rng([self.sampler.seed, step, 1])
    start = rng.integers(0, self.vocab_size, doc_lens.size)
    stride = rng.choice(np.asarray(self.strides), doc_lens.size)
    pos = np.arange(int(doc_lens.sum())) - np.repeat(np.cumsum(doc_lens) - doc_lens, doc_lens)
    tokens = (np.repeat(start, doc_lens) + np.repeat(stride, doc_lens) * pos) % self.vocab_size
    return make_batch(doc_lens, tokens.astype(np.int32), self.num_buffers, self.buffer_len)


def synthetic_from_config(data_config, vocab_size: int, num_buffers: int) -> SyntheticSource:
  d = data_config
  full_context = d.full_context_replacement
  if full_context is None:
    full_context = d.distribution == "prolong"
  sampler = LengthSampler(
      lengths=load_lengths(d.distribution), long_threshold=d.long_threshold,
      upsample_long_factor=d.upsample_long_factor, elongate_factor=d.elongate_factor,
      full_context_replacement=full_context, length_scale=d.length_scale, seed=d.seed)
  return SyntheticSource(sampler=sampler, vocab_size=vocab_size, num_buffers=num_buffers,
                         buffer_len=d.tokens_per_device)
