"""Batches of packed documents: the synthetic source and the common `Batch` structure.

A source is deterministic per step (`source.batch(step)`), so resuming at step k needs nothing
but k. Every source gives the documents of one global batch as lengths plus their concatenated
token stream, read by position; `packed_batch` packs them into per-device buffers (packing.py)
with next-token targets, reading only the tokens of the buffers it is asked for.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from .doclens import LengthSampler, load_lengths
from .packing import PAD_SEGMENT, Layout, pack, run_values


TOKEN_ARRAYS = ("tokens", "targets", "loss_mask", "positions")
_ARRAYS = (*TOKEN_ARRAYS, "segment_ids")


@dataclasses.dataclass(frozen=True)
class Batch:
  """One global batch, host side. Arrays are [num_buffers, buffer_len]; buffer b goes to device b
  of the `data` axis.

  A process of a multi-process job builds only the buffers its devices hold (`rows`): the other
  rows of its arrays are zero, never written (numpy's zeros are not committed until written, so
  it pays for its own rows) and not to be read; `stream` reads any token of the batch instead
  (`take`), which re-packing the batch (the ping-pong split) needs.

  A source's batch (`packed_batch`) builds its arrays when one is first read (`deferred`): a
  step run as ping-pong's halves trains on arrays re-read from the stream, and never reads the
  batch's own."""

  tokens: np.ndarray       # int32
  targets: np.ndarray      # int32, next token of the same document (0 where there is none)
  loss_mask: np.ndarray    # float32, 1 where `targets` is a real next token
  segment_ids: np.ndarray  # int32 document id, PAD_SEGMENT for padding
  positions: np.ndarray    # int32 in-document position (RoPE)
  layout: Layout
  rows: np.ndarray | None = None  # the buffers the arrays hold, sorted (None: all)
  # Tokens at positions of the documents' concatenated stream (None: read the arrays).
  stream: Callable[[np.ndarray], np.ndarray] | None = None

  @classmethod
  def deferred(cls, layout: Layout, rows, stream, arrays: Callable[[], dict]) -> "Batch":
    """A batch of `layout` whose per-token arrays (`TOKEN_ARRAYS` and `segment_ids`, by name)
    `arrays()` builds when one of them is first read."""
    batch = object.__new__(cls)
    for name, value in (("layout", layout), ("rows", rows), ("stream", stream),
                        ("_build", arrays)):
      object.__setattr__(batch, name, value)
    return batch

  def __getattr__(self, name):
    # Reached only for an attribute the instance lacks: a deferred batch's arrays, not built yet.
    build = self.__dict__.get("_build")
    if build is None or name not in _ARRAYS:
      raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
    for key, value in build().items():
      object.__setattr__(self, key, value)
    object.__setattr__(self, "_build", None)
    return self.__dict__[name]

  @property
  def built(self) -> bool:
    """Whether its arrays exist (a deferred batch's are built on first read)."""
    return self.__dict__.get("_build") is None

  def holds(self, rows) -> bool:
    """Whether the arrays hold buffers `rows` (None: all of them)."""
    if self.rows is None:
      return True
    return rows is not None and bool(np.isin(rows, self.rows).all())

  def take(self, flat: np.ndarray, out: dict | None = None) -> dict[str, np.ndarray]:
    """The `TOKEN_ARRAYS` at flat positions `flat` (buffer * buffer_len + row) of the batch, from
    its arrays when it holds every row and they are built, else from its stream (a batch packed
    in document order: flat position p is the stream's token p). `out`: 1-D arrays of `flat`'s
    size to write them into, by name (default: new ones)."""
    if self.rows is None and (self.stream is None or self.built):
      if out is None:
        return {k: getattr(self, k).reshape(-1)[flat] for k in TOKEN_ARRAYS}
      for k in TOKEN_ARRAYS:
        np.take(getattr(self, k).reshape(-1), flat, out=out[k])
      return out
    if self.stream is None:
      raise ValueError("Batch.take: the batch holds only some rows and has no stream to read "
                       "the others from")
    return packed_arrays(self.layout.doc_lens, self.stream, flat, out)


def packed_arrays(doc_lens: np.ndarray, tokens_at, flat: np.ndarray,
                  out: dict | None = None) -> dict[str, np.ndarray]:
  """The `TOKEN_ARRAYS` at flat positions `flat` of documents packed in order from position 0
  (flat position p is token p of their concatenated stream; past their end, padding), reading
  only the tokens they need: `tokens_at(p)` gives the stream's tokens at positions p. `out`:
  zero 1-D arrays of `flat`'s size to write them into, by name (default: new ones)."""
  shape = np.shape(flat)
  flat = np.asarray(flat, np.int64).reshape(-1)
  doc_lens = np.asarray(doc_lens, np.int64)
  doc_end = np.cumsum(doc_lens)
  if out is None:
    out = {"tokens": np.zeros(flat.shape, np.int32), "targets": np.zeros(flat.shape, np.int32),
           "loss_mask": np.zeros(flat.shape, np.float32),
           "positions": np.zeros(flat.shape, np.int32)}
  # A chunk of positions at a time: whole-size temporaries would be fresh memory on every call
  # (page faults cost about as much as the arithmetic); a chunk's are reused.
  for lo in range(0, flat.size, _CHUNK):
    _packed_chunk(doc_lens, doc_end, tokens_at, flat[lo:lo + _CHUNK],
                  {k: v[lo:lo + _CHUNK] for k, v in out.items()})
  return {k: v.reshape(shape) for k, v in out.items()}


_CHUNK = 1 << 16  # positions: a chunk's int64 temporaries are 512 KiB


def _packed_chunk(doc_lens, doc_end, tokens_at, flat, out) -> None:
  """`packed_arrays` of positions `flat`, written into `out`'s arrays."""
  real = flat < (doc_end[-1] if doc_end.size else 0)
  p = flat if real.all() else flat[real]
  if not p.size:
    return
  start, end = run_values(doc_end, p, doc_end - doc_lens, doc_end)
  got = {"tokens": np.asarray(tokens_at(p), np.int32)}
  has_next = p + 1 < end
  # A position's target is the token at the next position, usually read already (positions
  # are mostly read in order): only the others are read again.
  follows = np.zeros(p.size, bool)
  np.equal(p[1:] - 1, p[:-1], out=follows[:-1])
  targets = np.zeros(p.size, np.int32)
  targets[:-1] = got["tokens"][1:]
  targets *= follows & has_next
  again = np.flatnonzero(has_next > follows)
  targets[again] = tokens_at(p[again] + 1)
  got.update(targets=targets, loss_mask=has_next, positions=p - start)
  for k, v in got.items():
    if p is flat:
      out[k][...] = v
    else:
      out[k][real] = v


def cut_documents(doc_lens: np.ndarray, max_len: int | None) -> np.ndarray:
  """`doc_lens` with each document longer than `max_len` cut into pieces of `max_len` tokens
  (the last one shorter), in order: the same token stream, each piece a document of its own
  (its positions restart). None: unchanged."""
  doc_lens = np.asarray(doc_lens, np.int64)
  if max_len is None or not doc_lens.size or doc_lens.max() <= max_len:
    return doc_lens
  pieces = -(-doc_lens // max_len)
  out = np.full(int(pieces.sum()), max_len, np.int64)
  last = np.cumsum(pieces) - 1
  out[last] = doc_lens - (pieces - 1) * max_len
  return out


def make_batch(doc_lens: np.ndarray, tokens_flat: np.ndarray, num_buffers: int, buffer_len: int) -> Batch:
  """Packs documents (lengths + their concatenated tokens) into buffers with targets."""
  if tokens_flat.size != int(np.sum(doc_lens)):
    raise ValueError(f"make_batch: {tokens_flat.size} tokens for documents totalling {int(np.sum(doc_lens))}")
  return packed_batch(doc_lens, lambda p: tokens_flat[p], num_buffers, buffer_len)


def packed_batch(doc_lens: np.ndarray, tokens_at, num_buffers: int, buffer_len: int,
                 rows=None) -> Batch:
  """Packs documents into buffers with targets, filling buffers `rows` only (default: all), from
  `tokens_at(p)`: the tokens at positions p of the documents' concatenated stream. The arrays
  are built when first read (`Batch.deferred`); the stream is kept for `Batch.take`."""
  layout = pack(doc_lens, num_buffers, buffer_len)
  held = np.arange(num_buffers) if rows is None else np.unique(np.asarray(rows, np.int64))
  if held.size and (held[0] < 0 or held[-1] >= num_buffers):
    raise ValueError(f"packed_batch: rows {rows} outside the batch's {num_buffers} buffers")
  flat = (held[:, None] * buffer_len + np.arange(buffer_len)).reshape(-1)
  shape = (num_buffers, buffer_len)

  def full(a):
    out = np.zeros(shape, a.dtype)
    out[held] = a.reshape(held.size, buffer_len)
    return out

  def arrays():
    out = {k: full(v) for k, v in packed_arrays(layout.doc_lens, tokens_at, flat).items()}
    return {**out, "segment_ids": full(layout.segment_ids(held))}

  return Batch.deferred(layout, None if rows is None else held, tokens_at, arrays)


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
  max_doc_len: int | None = None

  def doc_lengths(self, step: int) -> np.ndarray:
    return self.sampler.sample(self.num_buffers * self.buffer_len, step)

  def batch(self, step: int, rows=None) -> Batch:
    """Global batch `step`, its buffers `rows` only when given (the rest zero); documents longer
    than `max_doc_len` cut into pieces of their own."""
    doc_lens, tokens_at = self.documents(step, self.num_buffers * self.buffer_len)
    return packed_batch(cut_documents(doc_lens, self.max_doc_len), tokens_at, self.num_buffers,
                        self.buffer_len, rows)

  def tokens_by_source(self, batches: int) -> dict[str, int]:
    """Tokens the first `batches` batches drew (one source)."""
    return {"synthetic": batches * self.num_buffers * self.buffer_len}

  def documents(self, step: int, total: int):
    """(lengths, tokens_at): documents of `total` tokens drawn from (seed, step), and the
    reader of their concatenated tokens by position."""
    doc_lens = self.sampler.sample(total, step)
    rng = np.random.default_rng([self.sampler.seed, step, 1])
    start = rng.integers(0, self.vocab_size, doc_lens.size)
    stride = rng.choice(np.asarray(self.strides), doc_lens.size)
    doc_end = np.cumsum(doc_lens)
    # Token p of document d is start[d] + stride[d] * (p - its first position), mod the
    # vocabulary: with the first position folded into a per-document shift, a read is two
    # gathers per token.
    shift = (start - stride * (doc_end - doc_lens)) % self.vocab_size

    def tokens_at(p):
      shift_p, stride_p = run_values(doc_end, p, shift, stride)
      stride_p *= p
      stride_p += shift_p
      return (stride_p % self.vocab_size).astype(np.int32)

    return doc_lens, tokens_at


def synthetic_from_config(data_config, vocab_size: int, num_buffers: int,
                          distribution: str | None = None, seed: int | None = None) -> SyntheticSource:
  """The synthetic source of `data_config` (`distribution`, `seed`: another's, for a mixture's
  source)."""
  d = data_config
  distribution = d.distribution if distribution is None else distribution
  full_context = d.full_context_replacement
  if full_context is None:
    full_context = distribution == "prolong"
  sampler = LengthSampler(
      lengths=load_lengths(distribution), long_threshold=d.long_threshold,
      upsample_long_factor=d.upsample_long_factor, elongate_factor=d.elongate_factor,
      full_context_replacement=full_context, length_scale=d.length_scale,
      seed=d.seed if seed is None else seed)
  return SyntheticSource(sampler=sampler, vocab_size=vocab_size, num_buffers=num_buffers,
                         buffer_len=d.tokens_per_device, max_doc_len=d.max_doc_len)
