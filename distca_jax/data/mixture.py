"""A weighted mixture of sources (`data.mixture`), and what a run's data layout is.

Every batch shares its N x T tokens among the sources by weight. With W_j the cumulative
normalised weight of sources 0..j, the first b batches hold floor(b N T W_j) tokens of sources
0..j, so source j's tokens before batch b are a closed form of b: each batch gives each source
its share to within a token, the running totals never drift, and a resume needs only the batch
number. Each source draws its share's documents: a corpus continues its own stream (its
permuted epochs, `CorpusSource`) where the batch before left it; a synthetic source samples
lengths from (its seed, batch). The documents of all sources are then shuffled together by
(seed, batch), cut at `max_doc_len`, and packed in order, so long and short documents of the
different sources mix on every data rank.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import numpy as np

from .corpus import CorpusSource, corpus_from_config, sidecar_path
from .sources import Batch, cut_documents, packed_batch, synthetic_from_config

# Cumulative weights are kept as integers over 2**32, so the shares are exact integer arithmetic.
_WEIGHT_BITS = 32


def source_seed(seed: int, index: int) -> int:
  """A mixture source's own seed: its documents do not repeat another source's draws."""
  return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


@dataclasses.dataclass
class Mixture:
  """Packed batches of several sources by weight; the interface of `SyntheticSource`.

  draw[j](batch, lo, n) -> (lengths, tokens_at): source j's documents for `batch`, its stream's
  tokens [lo, lo + n) (a corpus reads by `lo`, a synthetic source by `batch`)."""

  names: tuple[str, ...]
  weights: tuple[float, ...]
  draw: tuple[Callable, ...]
  num_buffers: int
  buffer_len: int
  seed: int = 0
  max_doc_len: int | None = None

  def __post_init__(self):
    w = np.asarray(self.weights, np.float64)
    cum = np.cumsum(w / w.sum())
    self._bounds = [int(round(c * 2**_WEIGHT_BITS)) for c in cum[:-1]] + [2**_WEIGHT_BITS]

  def tokens_before(self, batch: int) -> np.ndarray:
    """[sources] int64: each source's tokens in batches 0 .. batch - 1."""
    total = batch * self.num_buffers * self.buffer_len
    upto = [0] + [(total * b) >> _WEIGHT_BITS for b in self._bounds]
    return np.diff(np.asarray(upto, np.int64))

  def tokens_by_source(self, batches: int) -> dict[str, int]:
    """Tokens the first `batches` batches drew from each source, by name."""
    return dict(zip(self.names, map(int, self.tokens_before(batches))))

  def batch(self, step: int, rows=None) -> Batch:
    """Batch `step` (its buffers `rows` only when given): each source's share of documents,
    shuffled together, cut at `max_doc_len`, packed in order."""
    lo = self.tokens_before(step)
    n = self.tokens_before(step + 1) - lo
    lens, src, start, readers = [], [], [], []
    for j in np.flatnonzero(n):
      length, tokens_at = self.draw[j](step, int(lo[j]), int(n[j]))
      lens.append(length)
      src.append(np.full(length.size, j))
      start.append(np.cumsum(length) - length)  # each document's start in the source's draw
      readers.append((j, tokens_at))
    order = np.random.default_rng([self.seed, step, 0x313]).permutation(sum(map(len, lens)))
    lens, src, start = (np.concatenate(a)[order] for a in (lens, src, start))
    doc_end = np.cumsum(lens)

    def tokens_at(p):
      d = np.searchsorted(doc_end, p, side="right")
      local = start[d] + p - (doc_end[d] - lens[d])
      out = np.zeros(np.shape(p), np.int32)
      for j, read in readers:
        mine = src[d] == j
        if mine.any():
          out[mine] = read(local[mine])
      return out

    return packed_batch(cut_documents(lens, self.max_doc_len), tokens_at, self.num_buffers,
                        self.buffer_len, rows)


def mixture_from_config(data_config, vocab_size: int, num_buffers: int) -> Mixture:
  """The `Mixture` of `data_config.mixture`, batches of `num_buffers` buffers."""
  d = data_config
  draw = []
  for j, s in enumerate(d.mixture):
    seed = source_seed(d.seed, j)
    if s.corpus_tokens is not None:
      one = dataclasses.replace(d, corpus_tokens=s.corpus_tokens, corpus_offsets=s.corpus_offsets,
                                seed=seed)
      corpus = corpus_from_config(one, num_buffers, vocab_size)
      draw.append(lambda step, lo, n, c=corpus: c.documents(lo, n))
    else:
      synth = synthetic_from_config(d, vocab_size, num_buffers, distribution=s.distribution,
                                    seed=seed)
      draw.append(lambda step, lo, n, g=synth: g.documents(step, n))
  return Mixture(names=tuple(s.name for s in d.mixture), weights=tuple(s.weight for s in d.mixture),
                 draw=tuple(draw), num_buffers=num_buffers, buffer_len=d.tokens_per_device,
                 seed=d.seed, max_doc_len=d.max_doc_len)


# ----------------------------------------------------------------------------- the data layout


def data_layout(data_config, data_ranks: int, microbatches: int) -> dict[str, Any]:
  """What decides which tokens a step reads, as JSON: the buffers per batch and their length,
  the batches per step, the seed, the cap and the sources (a corpus by its token file's hash,
  so a moved corpus is the same one). A checkpoint keeps it; a resume compares it."""
  d = data_config

  def corpus(tokens_path):
    try:
      return {"corpus_sha256": json.loads(sidecar_path(tokens_path).read_text())["tokens_sha256"]}
    except (OSError, ValueError, KeyError):
      return {"corpus": str(tokens_path)}

  if d.mixture:
    sources = [{"name": s.name, "weight": s.weight,
                **(corpus(s.corpus_tokens) if s.corpus_tokens else {"distribution": s.distribution})}
               for s in d.mixture]
  elif d.source == "corpus":
    sources = [corpus(d.corpus_tokens)]
  else:
    sources = [{"distribution": d.distribution}]
  return {"data_ranks": data_ranks, "tokens_per_device": d.tokens_per_device,
          "microbatches": microbatches, "seed": d.seed, "max_doc_len": d.max_doc_len,
          "sources": sources}


def layout_change(saved: dict[str, Any], now: dict[str, Any]) -> str:
  """What differs between two `data_layout`s, in words ('' if nothing)."""
  names = {"data_ranks": "mesh.data", "tokens_per_device": "data.tokens_per_device",
           "microbatches": "train.microbatches", "seed": "data.seed",
           "max_doc_len": "data.max_doc_len", "sources": "the data sources"}
  return ", ".join(f"{names.get(k, k)} {saved.get(k)!r} -> {now.get(k)!r}"
                   for k in names if saved.get(k) != now.get(k))
