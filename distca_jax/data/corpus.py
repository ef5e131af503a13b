"""A real tokenized corpus on disk, and the source that streams it into packed batches.

On-disk format (written by `CorpusWriter`, i.e. `launch/build_corpus.py`):

  tokens.bin    every document's token ids back to back, little-endian uint16 when the vocabulary
                has <= 65535 entries, else uint32. Memory-mapped, never read whole.
  offsets.bin   little-endian int64, num_docs + 1 entries: document d is tokens[offsets[d]:
                offsets[d+1]]. offsets[0] = 0, offsets[-1] = num_tokens, every document >= 1 token.
  tokens.json   the sidecar (always the token file's name with the suffix `.json`): format and
                version, dtype, num_docs, num_tokens, vocab_size, the SHA-256 of the tokenizer file,
                of the offsets file and of the token file.

`Corpus.open` checks the sidecar against both files (sizes, dtype, offsets' hash and shape) so a
missing, truncated or mismatched file fails at start-up, naming the file. The token file's hash is
only checked by `Corpus.verify()` (it reads every token); each batch checks its ids < vocab_size.

`CorpusSource` turns the corpus into batches, deterministic per step with no other state:

  * The corpus is a stream of documents. Epoch e is every document once, in the order of a
    permutation drawn from `(seed, e)`; the stream is epoch 0, then epoch 1, ...
  * Global batch k is the token range [k*N*T, (k+1)*N*T) of that stream (N buffers of T tokens),
    crossing into the next epoch when it runs past the end of one. Batches are therefore always
    full (no padding) and every token of the corpus appears exactly once per epoch.
  * Inside a batch, documents are packed in stream order by `packing.pack`: a document that
    overflows a buffer continues in the next buffer with its positions continuing.
  * A document cut at a *batch* boundary (or an epoch boundary) becomes two independent pieces:
    the part in batch k+1 is a document of its own whose positions restart at 0 and whose first
    token is never a target. This keeps batch k+1 computable from k alone; the price is losing
    the context of the cut (at most one document per batch boundary).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from distca_jax.schema import ConfigError

from .packing import ranges
from .sources import Batch, cut_documents, packed_batch

FORMAT = "distca-corpus"
VERSION = 1
# Vocabularies of up to 65535 ids are stored as uint16, larger ones as uint32.
UINT16_MAX_VOCAB = 65_535
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_OFFSET_DTYPE = np.dtype("<i8")


class CorpusError(ConfigError):
  """A corpus file is missing, truncated, corrupt, or does not belong with the others. A
  ConfigError: the corpus is the user's input, so a launcher reports it as one (exit status 2)."""


def token_dtype(vocab_size: int) -> str:
  """Name of the smallest token dtype for a vocabulary of `vocab_size` ids."""
  if vocab_size < 1:
    raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
  if vocab_size <= UINT16_MAX_VOCAB:
    return "uint16"
  if vocab_size <= 2**32:
    return "uint32"
  raise ValueError(f"vocab_size {vocab_size} does not fit uint32 token ids")


def sidecar_path(tokens_path: str | os.PathLike) -> Path:
  """The sidecar JSON of a token file: `DIR/tokens.bin` -> `DIR/tokens.json`."""
  return Path(tokens_path).with_suffix(".json")


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(chunk_bytes):
      h.update(chunk)
  return h.hexdigest()


# ----------------------------------------------------------------------------- writing


class CorpusWriter:
  """Streams documents to `out_dir/tokens.bin` and `out_dir/offsets.bin`, then writes the sidecar.

  Files are written under temporary names and renamed on `close()`, sidecar last, so an
  interrupted build leaves no sidecar and `Corpus.open` refuses the directory.

    with CorpusWriter(out, vocab_size=tok.get_vocab_size(), tokenizer_sha256=h) as w:
      for ids in documents:
        w.add(ids)
  """

  def __init__(self, out_dir: str | os.PathLike, vocab_size: int, tokenizer_sha256: str = "",
               tokens_name: str = "tokens.bin", offsets_name: str = "offsets.bin"):
    self.out_dir = Path(out_dir)
    self.out_dir.mkdir(parents=True, exist_ok=True)
    self.vocab_size = int(vocab_size)
    self.dtype_name = token_dtype(self.vocab_size)
    self.dtype = _DTYPES[self.dtype_name]
    self.tokenizer_sha256 = tokenizer_sha256
    self.tokens_path = self.out_dir / tokens_name
    self.offsets_path = self.out_dir / offsets_name
    if self.tokens_path.suffix == ".json" or sidecar_path(self.tokens_path) == self.offsets_path:
      raise ValueError(f"token file name {tokens_name!r} collides with its sidecar or the offsets file")
    self._tmp_tokens = self.tokens_path.with_name(self.tokens_path.name + ".tmp")
    self._file = open(self._tmp_tokens, "wb")
    self._hash = hashlib.sha256()
    self._lengths: list[int] = []
    self.num_tokens = 0
    self.skipped_empty = 0

  def add(self, ids) -> None:
    """Appends one document (a sequence of int token ids). Empty documents are skipped (counted)."""
    ids = np.asarray(ids)
    if ids.size == 0:
      self.skipped_empty += 1
      return
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"document {len(self._lengths)}: expected a 1-D sequence of integer ids")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= self.vocab_size:
      raise ValueError(
          f"document {len(self._lengths)}: token id {lo if lo < 0 else hi} outside the vocabulary "
          f"[0, {self.vocab_size})")
    data = ids.astype(self.dtype).tobytes()
    self._file.write(data)
    self._hash.update(data)
    self._lengths.append(int(ids.size))
    self.num_tokens += int(ids.size)

  def close(self) -> dict:
    """Finalises the files and returns the sidecar's contents."""
    self._file.close()
    if not self._lengths:
      self._tmp_tokens.unlink(missing_ok=True)
      raise ValueError(f"{self.out_dir}: no non-empty documents to write")
    offsets = np.zeros(len(self._lengths) + 1, _OFFSET_DTYPE)
    np.cumsum(np.asarray(self._lengths, np.int64), out=offsets[1:])
    offsets_bytes = offsets.tobytes()
    tmp_offsets = self.offsets_path.with_name(self.offsets_path.name + ".tmp")
    tmp_offsets.write_bytes(offsets_bytes)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": self.dtype_name,
        "num_docs": len(self._lengths),
        "num_tokens": self.num_tokens,
        "vocab_size": self.vocab_size,
        "tokenizer_sha256": self.tokenizer_sha256,
        "tokens_file": self.tokens_path.name,
        "offsets_file": self.offsets_path.name,
        "tokens_sha256": self._hash.hexdigest(),
        "offsets_sha256": hashlib.sha256(offsets_bytes).hexdigest(),
    }
    side = sidecar_path(self.tokens_path)
    tmp_side = side.with_name(side.name + ".tmp")
    tmp_side.write_text(json.dumps(meta, indent=2) + "\n")
    # Sidecar last: its presence marks a complete corpus. Remove a stale one first so a crash
    # between the renames cannot pair an old sidecar with new data.
    side.unlink(missing_ok=True)
    os.replace(self._tmp_tokens, self.tokens_path)
    os.replace(tmp_offsets, self.offsets_path)
    os.replace(tmp_side, side)
    return meta

  def __enter__(self) -> "CorpusWriter":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
    else:
      self._file.close()
      self._tmp_tokens.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- reading


class Corpus:
  """An opened, validated corpus. `tokens` is a read-only memmap, `offsets` int64 in memory."""

  def __init__(self, tokens_path: Path, offsets_path: Path, meta: dict, tokens: np.memmap,
               offsets: np.ndarray):
    self.tokens_path = tokens_path
    self.offsets_path = offsets_path
    self.meta = meta
    self.tokens = tokens
    self.offsets = offsets

  @property
  def num_docs(self) -> int:
    return int(self.meta["num_docs"])

  @property
  def num_tokens(self) -> int:
    return int(self.meta["num_tokens"])

  @property
  def vocab_size(self) -> int:
    return int(self.meta["vocab_size"])

  @property
  def doc_lens(self) -> np.ndarray:
    """[num_docs] int64 document lengths in tokens."""
    return np.diff(self.offsets)

  def document(self, d: int) -> np.ndarray:
    """Token ids of document `d` as int64."""
    if not 0 <= d < self.num_docs:
      raise IndexError(f"document {d} out of range [0, {self.num_docs})")
    return np.asarray(self.tokens[self.offsets[d]:self.offsets[d + 1]], np.int64)

  @classmethod
  def open(cls, tokens_path: str | os.PathLike, offsets_path: str | os.PathLike) -> "Corpus":
    """Opens and validates a corpus; raises CorpusError naming the file and what is wrong."""
    tokens_path, offsets_path = Path(tokens_path), Path(offsets_path)
    side = sidecar_path(tokens_path)
    for path, what in ((tokens_path, "token file"), (offsets_path, "offsets file"), (side, "sidecar")):
      if not path.is_file():
        hint = " (is the corpus built? see launch/build_corpus.py)" if what == "sidecar" else ""
        raise CorpusError(f"corpus {what} {path} does not exist{hint}")
    meta = _read_sidecar(side)
    dtype = _DTYPES[meta["dtype"]]
    num_docs, num_tokens = meta["num_docs"], meta["num_tokens"]
    if meta["dtype"] != token_dtype(meta["vocab_size"]):
      raise CorpusError(f"{side}: dtype {meta['dtype']} does not match vocab_size {meta['vocab_size']}")
    want = num_tokens * dtype.itemsize
    got = tokens_path.stat().st_size
    if got != want:
      raise CorpusError(
          f"token file {tokens_path}: {got} bytes, but the sidecar {side.name} says {num_tokens} "
          f"{meta['dtype']} tokens ({want} bytes); the file is truncated or belongs to another corpus")
    want = (num_docs + 1) * _OFFSET_DTYPE.itemsize
    got = offsets_path.stat().st_size
    if got != want:
      raise CorpusError(
          f"offsets file {offsets_path}: {got} bytes, but the sidecar {side.name} says {num_docs} "
          f"documents ({want} bytes of int64); the file is truncated or belongs to another corpus")
    raw = offsets_path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != meta["offsets_sha256"]:
      raise CorpusError(
          f"offsets file {offsets_path}: content does not match the sidecar {side} (hash differs); "
          f"it is corrupt or belongs to another corpus")
    offsets = np.frombuffer(raw, _OFFSET_DTYPE).astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != num_tokens or (np.diff(offsets) < 1).any():
      raise CorpusError(
          f"offsets file {offsets_path}: must start at 0, end at num_tokens={num_tokens} and increase "
          f"strictly (every document >= 1 token)")
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(num_tokens,))
    return cls(tokens_path, offsets_path, meta, tokens, offsets)

  def verify(self) -> None:
    """Full check that reads every token: the token file's hash and every id < vocab_size."""
    if file_sha256(self.tokens_path) != self.meta["tokens_sha256"]:
      raise CorpusError(
          f"token file {self.tokens_path}: content does not match its sidecar (hash differs); it is "
          f"corrupt or belongs to another corpus")
    chunk = 1 << 24
    for start in range(0, self.num_tokens, chunk):
      top = int(self.tokens[start:start + chunk].max())
      if top >= self.vocab_size:
        raise CorpusError(f"token file {self.tokens_path}: id {top} >= vocab_size {self.vocab_size}")


def _read_sidecar(side: Path) -> dict:
  try:
    meta = json.loads(side.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CorpusError(f"corpus sidecar {side}: not valid JSON ({e})") from e
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise CorpusError(f"corpus sidecar {side}: not a {FORMAT} sidecar (missing 'format': {FORMAT!r})")
  if meta.get("version") != VERSION:
    raise CorpusError(f"corpus sidecar {side}: version {meta.get('version')!r}, this code reads {VERSION}")
  for key in ("num_docs", "num_tokens", "vocab_size"):
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise CorpusError(f"corpus sidecar {side}: {key} must be a positive integer, got {value!r}")
  if meta.get("dtype") not in _DTYPES:
    raise CorpusError(f"corpus sidecar {side}: dtype {meta.get('dtype')!r}; choose one of {list(_DTYPES)}")
  for key in ("offsets_sha256", "tokens_sha256"):
    if not isinstance(meta.get(key), str):
      raise CorpusError(f"corpus sidecar {side}: missing {key}")
  return meta


# ----------------------------------------------------------------------------- batches


class CorpusSource:
  """Packed batches from a corpus; same interface as `SyntheticSource` (see the module docstring
  for the stream, epoch and cut-document semantics).

  Args:
    tokens_path, offsets_path: the corpus files (the sidecar sits beside the token file).
    num_buffers: N, buffers per global batch (devices of the `data` axis).
    buffer_len: T, tokens per buffer.
    seed: seeds the per-epoch document permutations.
    vocab_size: when given, the model's vocabulary; a corpus with a larger one is refused.
  """

  def __init__(self, tokens_path, offsets_path, num_buffers: int, buffer_len: int, seed: int = 0,
               vocab_size: int | None = None, max_doc_len: int | None = None):
    if num_buffers < 1 or buffer_len < 1:
      raise ValueError(f"CorpusSource: need num_buffers >= 1 and buffer_len >= 1, got {num_buffers}, {buffer_len}")
    self.corpus = Corpus.open(tokens_path, offsets_path)
    if vocab_size is not None and self.corpus.vocab_size > vocab_size:
      raise CorpusError(
          f"corpus {tokens_path} has vocab_size {self.corpus.vocab_size}, larger than the model's "
          f"{vocab_size}; set model.vocab_size >= {self.corpus.vocab_size}")
    self.num_buffers = num_buffers
    self.buffer_len = buffer_len
    self.seed = seed
    self.max_doc_len = max_doc_len
    self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  @property
  def tokens_per_batch(self) -> int:
    return self.num_buffers * self.buffer_len

  @property
  def steps_per_epoch(self) -> float:
    return self.corpus.num_tokens / self.tokens_per_batch

  def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(perm [D], starts [D+1]): document order of `epoch` and each one's stream offset in it."""
    if epoch not in self._epochs:
      perm = np.random.default_rng([self.seed, epoch, 0xC0]).permutation(self.corpus.num_docs)
      starts = np.zeros(perm.size + 1, np.int64)
      np.cumsum(self.corpus.doc_lens[perm], out=starts[1:])
      # A batch touches at most a few consecutive epochs; keep only the latest two.
      while len(self._epochs) >= 2:
        self._epochs.pop(min(self._epochs))
      self._epochs[epoch] = (perm, starts)
    return self._epochs[epoch]

  def pieces(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The document pieces of global batch `step`, in stream order.

    Returns (doc [P], doc_offset [P], length [P], epoch [P]), int64: piece p is tokens
    [doc_offset, doc_offset + length) of corpus document `doc`, in epoch `epoch`.
    Sum of lengths is N*T.
    """
    if step < 0:
      raise ValueError(f"CorpusSource: step must be >= 0, got {step}")
    return self.stream_pieces(step * self.tokens_per_batch, (step + 1) * self.tokens_per_batch)

  def stream_pieces(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`pieces` of the stream's tokens [lo, hi) (hi > lo)."""
    total = self.corpus.num_tokens
    parts = []
    for epoch in range(lo // total, (hi - 1) // total + 1):
      perm, starts = self._epoch(epoch)
      a = max(lo - epoch * total, 0)
      b = min(hi - epoch * total, total)
      first = np.searchsorted(starts, a, side="right") - 1
      last = np.searchsorted(starts, b, side="left")  # first document starting at or after b
      idx = np.arange(first, last)
      begin = np.maximum(starts[idx], a)
      end = np.minimum(starts[idx + 1], b)
      parts.append((perm[idx], begin - starts[idx], end - begin, np.full(idx.size, epoch)))
    return tuple(np.concatenate(col).astype(np.int64) for col in zip(*parts))

  def doc_lengths(self, step: int) -> np.ndarray:
    """[P] int64 lengths of the pieces (documents) of global batch `step`; sums to N*T."""
    return self.pieces(step)[2]

  def token_indices(self, step: int) -> np.ndarray:
    """[N*T] int64 positions in the token file of the tokens of batch `step`, in order."""
    doc, doc_offset, length, _ = self.pieces(step)
    return ranges(self.corpus.offsets[doc] + doc_offset, length)

  def batch(self, step: int, rows=None) -> Batch:
    """Global batch `step`, packed into N buffers of T tokens (no padding); its buffers `rows`
    only when given (the rest zero), reading only their tokens from the file. Documents longer
    than `max_doc_len` are cut into pieces of their own."""
    length, tokens_at = self.documents(step * self.tokens_per_batch, self.tokens_per_batch)
    return packed_batch(cut_documents(length, self.max_doc_len), tokens_at, self.num_buffers,
                        self.buffer_len, rows)

  def tokens_by_source(self, batches: int) -> dict[str, int]:
    """Tokens the first `batches` batches read (one source)."""
    return {"corpus": batches * self.tokens_per_batch}

  def documents(self, lo: int, n: int):
    """(lengths [P], tokens_at): the document pieces of the stream's tokens [lo, lo + n) and
    the reader of their concatenated tokens by position (0 .. n - 1)."""
    doc, doc_offset, length, _ = self.stream_pieces(lo, lo + n)
    piece_end = np.cumsum(length)
    file_start = self.corpus.offsets[doc] + doc_offset

    def tokens_at(p):
      k = np.searchsorted(piece_end, p, side="right")
      tokens = np.asarray(self.corpus.tokens[file_start[k] + p - piece_end[k] + length[k]])
      top = int(tokens.max(initial=0))
      if top >= self.corpus.vocab_size:
        raise CorpusError(
            f"token file {self.corpus.tokens_path}: id {top} >= vocab_size {self.corpus.vocab_size} "
            f"in stream tokens [{lo}, {lo + n}); the file is corrupt")
      return tokens.astype(np.int32)

    return length, tokens_at


# A token file up to this size is read whole when the config is checked, for ids >= vocab_size;
# a larger one is checked batch by batch as it is read (`CorpusSource.batch`).
SCAN_AT_LOAD_BYTES = 256 << 20


def check_corpus(tokens_path, offsets_path, vocab_size: int,
                 scan_bytes: int = SCAN_AT_LOAD_BYTES) -> None:
  """The checks a run's start-up can make, before any device work: the corpus opens
  (`Corpus.open`), its vocabulary fits the model's `vocab_size`, some document has a next-token
  target (two tokens or more), and, for a token file of at most `scan_bytes`, every id is below
  the corpus's vocabulary. Raises CorpusError naming the file."""
  corpus = Corpus.open(tokens_path, offsets_path)
  if corpus.vocab_size > vocab_size:
    raise CorpusError(
        f"corpus {tokens_path} has vocab_size {corpus.vocab_size}, larger than the model's "
        f"{vocab_size}; set model.vocab_size >= {corpus.vocab_size}")
  if int(corpus.doc_lens.max()) < 2:
    raise CorpusError(f"corpus {tokens_path}: every document is one token long, so no token has a "
                      f"next-token target")
  if corpus.tokens_path.stat().st_size <= scan_bytes:
    top = int(corpus.tokens.max())
    if top >= corpus.vocab_size:
      raise CorpusError(f"corpus {tokens_path}: token id {top} >= the corpus's vocab_size "
                        f"{corpus.vocab_size}; the file is corrupt or was built with another tokenizer")


def corpus_from_config(data_config, num_buffers: int, vocab_size: int | None = None) -> CorpusSource:
  """A CorpusSource from `DataConfig` (`corpus_tokens`, `corpus_offsets`, `seed`,
  `tokens_per_device`), with `num_buffers` buffers (the data-axis size)."""
  d = data_config
  if d.corpus_tokens is None or d.corpus_offsets is None:
    raise ConfigError("data.corpus_tokens and data.corpus_offsets: both are required for a corpus source")
  try:
    return CorpusSource(d.corpus_tokens, d.corpus_offsets, num_buffers=num_buffers,
                        buffer_len=d.tokens_per_device, seed=d.seed, vocab_size=vocab_size,
                        max_doc_len=d.max_doc_len)
  except CorpusError as e:
    raise ConfigError(f"data.corpus_tokens / data.corpus_offsets: {e}") from e
