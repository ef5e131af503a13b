"""The tokenized corpus: build tool, on-disk format checks, and the batch stream.

A tiny WordLevel tokenizer is trained here on an in-test corpus and saved to a temp file; the
corpus is built by calling `launch/build_corpus.py`'s `main`. The stream is checked against a
plain Python reference that concatenates documents in each epoch's order and slices it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")

from distca_jax.config import ConfigError, DataConfig  # noqa: E402
from distca_jax.data.corpus import (  # noqa: E402
    Corpus, CorpusError, CorpusSource, CorpusWriter, corpus_from_config, sidecar_path)
from distca_jax.data.packing import PAD_SEGMENT  # noqa: E402
from helpers import launch_script  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]


build_corpus = launch_script("build_corpus")


def _texts(n: int, seed: int) -> list[str]:
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, rng.integers(1, 60))) for _ in range(n)]


def _make_tokenizer(path: Path) -> "tokenizers.Tokenizer":
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"])
  tok.train_from_iterator([" ".join(WORDS)], trainer=trainer)
  tok.save(str(path))
  return tok


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """A corpus from three input kinds: one-document files, a --lines file, and a .jsonl file.
  Returns (tokenizer, out_dir, texts in corpus order)."""
  tmp = tmp_path_factory.mktemp("corpus")
  tok = _make_tokenizer(tmp / "tokenizer.json")
  texts = _texts(60, seed=0)
  inputs = []
  for i, text in enumerate(texts[:10]):
    (tmp / f"doc{i}.txt").write_text(text)
    inputs.append(tmp / f"doc{i}.txt")
  jsonl = tmp / "docs.jsonl"
  jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts[10:])))
  inputs.append(jsonl)
  out = tmp / "out"
  assert build_corpus.main(["--tokenizer", str(tmp / "tokenizer.json"), "--out", str(out),
                            "--eos", "</s>", *map(str, inputs)]) == 0
  return tok, out, texts


def _source(out: Path, num_buffers: int, buffer_len: int, seed: int = 0) -> CorpusSource:
  return CorpusSource(out / "tokens.bin", out / "offsets.bin", num_buffers, buffer_len, seed)


# ----------------------------------------------------------------------------- build + format


def test_tokens_round_trip(built):
  tok, out, texts = built
  corpus = Corpus.open(out / "tokens.bin", out / "offsets.bin")
  corpus.verify()
  eos = tok.token_to_id("</s>")
  assert corpus.num_docs == len(texts)
  assert corpus.meta["dtype"] == "uint16" and corpus.tokens.dtype == np.uint16
  assert corpus.vocab_size == tok.get_vocab_size()
  for d, text in enumerate(texts):
    ids = corpus.document(d)
    assert ids[-1] == eos
    np.testing.assert_array_equal(ids[:-1], tok.encode(text).ids)
    assert tok.decode(ids[:-1].tolist()) == text
  assert corpus.num_tokens == int(corpus.doc_lens.sum())


def test_lines_mode_and_bos(tmp_path):
  tok = _make_tokenizer(tmp_path / "tok.json")
  texts = _texts(5, seed=1)
  (tmp_path / "all.txt").write_text("\n".join(texts[:2]) + "\n\n" + "\n".join(texts[2:]) + "\n")
  build_corpus.main(["--tokenizer", str(tmp_path / "tok.json"), "--out", str(tmp_path / "c"),
                     "--lines", "--bos", "<s>", str(tmp_path / "all.txt")])
  corpus = Corpus.open(tmp_path / "c" / "tokens.bin", tmp_path / "c" / "offsets.bin")
  assert corpus.num_docs == 5  # the blank line is not a document
  for d, text in enumerate(texts):
    np.testing.assert_array_equal(corpus.document(d), [tok.token_to_id("<s>")] + tok.encode(text).ids)


def test_uint32_for_large_vocab(tmp_path):
  docs = [np.array([0, 70_000, 65_535]), np.array([69_999])]
  with CorpusWriter(tmp_path, vocab_size=70_001) as w:
    for d in docs:
      w.add(d)
  corpus = Corpus.open(tmp_path / "tokens.bin", tmp_path / "offsets.bin")
  assert corpus.tokens.dtype == np.uint32
  for d, ids in enumerate(docs):
    np.testing.assert_array_equal(corpus.document(d), ids)


def test_build_errors(tmp_path):
  _make_tokenizer(tmp_path / "tok.json")
  (tmp_path / "a.txt").write_text("w1 w2")
  base = ["--tokenizer", str(tmp_path / "tok.json"), "--out", str(tmp_path / "c")]
  with pytest.raises(SystemExit, match="--eos '<nope>': not a token"):
    build_corpus.main(base + ["--eos", "<nope>", str(tmp_path / "a.txt")])
  with pytest.raises(SystemExit, match="input files do not exist: .*missing.txt"):
    build_corpus.main(base + [str(tmp_path / "missing.txt")])
  (tmp_path / "bad.jsonl").write_text('{"body": "w1"}\n')
  with pytest.raises(SystemExit, match=r"bad.jsonl:1: expected an object with a string field 'text'"):
    build_corpus.main(base + [str(tmp_path / "bad.jsonl")])
  with pytest.raises(SystemExit, match="not a tokenizers JSON file"):
    build_corpus.main(["--tokenizer", str(tmp_path / "a.txt"), "--out", str(tmp_path / "c"),
                       str(tmp_path / "a.txt")])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    CorpusWriter(tmp_path / "w", vocab_size=10).add([3, 10])


def test_glob_and_pretokenized_inputs(tmp_path):
  """Quoted glob patterns expand to their files sorted by name; .npy (one document, or one per
  row) and .npz (tokens + offsets) are taken as tokenized, text beside them is tokenized, in the
  order given."""
  tok = _make_tokenizer(tmp_path / "tok.json")
  shards = tmp_path / "shards"
  shards.mkdir()
  np.save(shards / "b.npy", np.array([[5, 6, 7], [8, 9, 10]], np.int32))
  np.save(shards / "a.npy", np.array([1, 2, 3, 4], np.int64))
  np.savez(tmp_path / "c.npz", tokens=np.array([11, 12, 13, 14, 15]), offsets=np.array([0, 2, 5]))
  (tmp_path / "d.txt").write_text("w1 w2 w3")
  out = tmp_path / "c"
  build_corpus.main(["--tokenizer", str(tmp_path / "tok.json"), "--out", str(out),
                     str(shards / "*.npy"), str(tmp_path / "c.npz"), str(tmp_path / "d.txt")])
  corpus = Corpus.open(out / "tokens.bin", out / "offsets.bin")
  docs = [corpus.document(d).tolist() for d in range(corpus.num_docs)]
  assert docs == [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10], [11, 12], [13, 14, 15],
                  tok.encode("w1 w2 w3").ids]
  # Arrays alone need only the vocabulary's size.
  build_corpus.main(["--vocab-size", "16", "--out", str(tmp_path / "arr"), str(shards / "a.npy")])
  assert Corpus.open(tmp_path / "arr" / "tokens.bin", tmp_path / "arr" / "offsets.bin").vocab_size == 16
  with pytest.raises(SystemExit, match="matches no file"):
    build_corpus.main(["--vocab-size", "16", "--out", str(tmp_path / "x"), str(tmp_path / "*.nope")])
  with pytest.raises(SystemExit, match="--tokenizer: needed for the text inputs"):
    build_corpus.main(["--vocab-size", "16", "--out", str(tmp_path / "x"), str(tmp_path / "d.txt")])
  with pytest.raises(SystemExit, match="b.npy: .*outside the vocabulary"):
    build_corpus.main(["--vocab-size", "8", "--out", str(tmp_path / "x"), str(shards / "b.npy")])
  np.save(tmp_path / "f.npy", np.ones(3, np.float32))
  with pytest.raises(SystemExit, match="f.npy: token ids must be integers"):
    build_corpus.main(["--vocab-size", "8", "--out", str(tmp_path / "x"), str(tmp_path / "f.npy")])


def _copy_corpus(out: Path, dst: Path) -> tuple[Path, Path]:
  dst.mkdir()
  for name in ("tokens.bin", "offsets.bin", "tokens.json"):
    (dst / name).write_bytes((out / name).read_bytes())
  return dst / "tokens.bin", dst / "offsets.bin"


def test_bad_files_raise_clear_errors(built, tmp_path):
  _, out, _ = built
  tokens, offsets = _copy_corpus(out, tmp_path / "c")

  with pytest.raises(CorpusError, match="offsets file .*nowhere.bin does not exist"):
    Corpus.open(tokens, tmp_path / "nowhere.bin")

  raw = tokens.read_bytes()
  tokens.write_bytes(raw[:-2])
  with pytest.raises(CorpusError, match="token file .*truncated or belongs to another corpus"):
    Corpus.open(tokens, offsets)

  # Same size, one id flipped past the vocabulary: only the full check and the batch see it.
  bad = bytearray(raw)
  bad[0:2] = np.array([60_000], "<u2").tobytes()
  tokens.write_bytes(bytes(bad))
  corpus = Corpus.open(tokens, offsets)
  with pytest.raises(CorpusError, match="token file .*hash differs"):
    corpus.verify()
  with pytest.raises(CorpusError, match="id 60000 >= vocab_size .* corrupt"):
    for step in range(100):  # the stream reaches token 0 within the first epoch
      CorpusSource(tokens, offsets, 2, 16).batch(step).tokens  # read with the batch's arrays
  tokens.write_bytes(raw)

  # An offsets file from another corpus of the same size: the hash check catches it.
  other = np.frombuffer(offsets.read_bytes(), "<i8").copy()
  other[1] += 1
  offsets.write_bytes(other.tobytes())
  with pytest.raises(CorpusError, match="offsets file .*hash differs.*another corpus"):
    Corpus.open(tokens, offsets)
  offsets.write_bytes((out / "offsets.bin").read_bytes())

  side = sidecar_path(tokens)
  meta = json.loads(side.read_text())
  side.write_text("{not json")
  with pytest.raises(CorpusError, match="sidecar .*not valid JSON"):
    Corpus.open(tokens, offsets)
  side.write_text(json.dumps({**meta, "dtype": "int8"}))
  with pytest.raises(CorpusError, match="dtype 'int8'; choose one of"):
    Corpus.open(tokens, offsets)
  side.unlink()
  with pytest.raises(CorpusError, match="sidecar .*tokens.json does not exist.*build_corpus"):
    Corpus.open(tokens, offsets)


def test_vocab_and_config_checks(built):
  _, out, _ = built
  with pytest.raises(CorpusError, match="vocab_size .* larger than the model's 5"):
    CorpusSource(out / "tokens.bin", out / "offsets.bin", 2, 16, vocab_size=5)
  with pytest.raises(ConfigError, match="data.corpus_tokens and data.corpus_offsets"):
    corpus_from_config(DataConfig(source="corpus"), num_buffers=2)
  with pytest.raises(ConfigError, match="data.corpus_tokens / data.corpus_offsets: .*does not exist"):
    corpus_from_config(DataConfig(corpus_tokens="/nonexistent/t.bin", corpus_offsets="/nonexistent/o.bin"), 2)
  cfg = DataConfig(source="corpus", corpus_tokens=str(out / "tokens.bin"),
                   corpus_offsets=str(out / "offsets.bin"), tokens_per_device=128, seed=3)
  source = corpus_from_config(cfg, num_buffers=4)
  assert (source.num_buffers, source.buffer_len, source.seed) == (4, 128, 3)
  np.testing.assert_array_equal(source.batch(2).tokens, _source(out, 4, 128, seed=3).batch(2).tokens)


# ----------------------------------------------------------------------------- the stream


def _reference_indices(source: CorpusSource, step: int) -> tuple[np.ndarray, list[int]]:
  """Token-file indices of batch `step` and its piece lengths, by building the epochs' streams
  document by document and slicing; pieces split at document and batch boundaries."""
  corpus = source.corpus
  nt = source.tokens_per_batch
  lo, hi = step * nt, (step + 1) * nt
  stream, doc_of = [], []
  epoch = 0
  while len(stream) < hi:
    perm = source._epoch(epoch)[0]
    for d in perm:
      stream.extend(range(corpus.offsets[d], corpus.offsets[d + 1]))
      doc_of.extend([(epoch, d)] * int(corpus.offsets[d + 1] - corpus.offsets[d]))
    epoch += 1
  pieces = []
  for i in range(lo, hi):
    if i == lo or doc_of[i] != doc_of[i - 1]:
      pieces.append(0)
    pieces[-1] += 1
  return np.asarray(stream[lo:hi]), pieces


@settings(max_examples=25, deadline=None)
@given(num_buffers=st.integers(1, 4), buffer_len=st.integers(1, 300), seed=st.integers(0, 3),
       step=st.integers(0, 40))
def test_stream_matches_reference(built, num_buffers, buffer_len, seed, step):
  _, out, _ = built
  source = _source(out, num_buffers, buffer_len, seed)
  want_idx, want_lens = _reference_indices(source, step)
  np.testing.assert_array_equal(source.token_indices(step), want_idx)
  np.testing.assert_array_equal(source.doc_lengths(step), want_lens)


def test_every_token_once_per_epoch(built):
  _, out, _ = built
  source = _source(out, 2, 96, seed=5)
  total = source.corpus.num_tokens
  steps = int(np.ceil(3 * total / source.tokens_per_batch))
  stream = np.concatenate([source.token_indices(k) for k in range(steps)])
  orders = []
  for e in range(3):
    epoch = stream[e * total:(e + 1) * total]
    np.testing.assert_array_equal(np.sort(epoch), np.arange(total))
    # Documents stay whole and in order inside an epoch: the stream only jumps at document starts.
    jumps = np.flatnonzero(np.diff(epoch) != 1) + 1
    assert np.isin(epoch[jumps], source.corpus.offsets[:-1]).all()
    orders.append(epoch[np.isin(epoch, source.corpus.offsets[:-1])])
  assert not np.array_equal(orders[0], orders[1])  # each epoch has its own permutation


def test_a_process_reads_only_its_rows(built):
  """`batch(step, rows)` holds those buffers as the whole batch does, the others zero, and reads
  any other token of the batch from the file on demand (`take`, which the ping-pong split uses)."""
  _, out, _ = built
  source = _source(out, 4, 64, seed=2)
  rows = np.array([0, 3])
  for step in range(3):
    whole, part = source.batch(step), source.batch(step, rows)
    for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids"):
      np.testing.assert_array_equal(getattr(part, k)[rows], getattr(whole, k)[rows], err_msg=k)
    assert not part.tokens[[1, 2]].any()
    flat = np.arange(64, 192)  # buffers 1 and 2, not held
    got, want = part.take(flat), whole.take(flat)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_batch_packing_and_cut_documents(built):
  _, out, _ = built
  source = _source(out, 3, 64, seed=1)
  nt = source.tokens_per_batch
  for step in range(6):
    batch = source.batch(step)
    doc, doc_offset, length, _ = source.pieces(step)
    flat = batch.tokens.reshape(-1)
    np.testing.assert_array_equal(flat, source.corpus.tokens[source.token_indices(step)])
    seg = batch.segment_ids.reshape(-1)
    assert (seg != PAD_SEGMENT).all()  # batches are always full
    # Positions count from 0 within each piece, across buffer boundaries (packing continues
    # documents into the next buffer) but restarting at each piece.
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    assert starts.size == length.size
    want_pos = np.arange(nt) - np.repeat(starts, np.diff(np.r_[starts, nt]))
    np.testing.assert_array_equal(batch.positions.reshape(-1), want_pos)
    # Targets: the next token of the same piece; the last token of each piece predicts nothing.
    assert batch.loss_mask.sum() == nt - length.size
    mask = batch.loss_mask.reshape(-1).astype(bool)
    np.testing.assert_array_equal(batch.targets.reshape(-1)[:-1][mask[:-1]], flat[1:][mask[:-1]])
    # A document cut at this batch's end continues at the start of the next, as its own piece.
    nxt_doc, nxt_off, _, _ = source.pieces(step + 1)
    if doc_offset[-1] + length[-1] < source.corpus.doc_lens[doc[-1]]:
      assert nxt_doc[0] == doc[-1] and nxt_off[0] == doc_offset[-1] + length[-1]
    else:
      assert nxt_off[0] == 0


def test_deterministic_and_resumable(built):
  _, out, _ = built
  a = _source(out, 2, 128, seed=7)
  want = [a.batch(k) for k in range(8)]
  # A fresh source started at step 5 (resume) and one visiting steps out of order agree.
  b = _source(out, 2, 128, seed=7)
  for k in [5, 6, 7, 0, 3]:
    got = b.batch(k)
    for field in ("tokens", "targets", "loss_mask", "segment_ids", "positions"):
      np.testing.assert_array_equal(getattr(got, field), getattr(want[k], field), err_msg=field)
  c = _source(out, 2, 128, seed=8)
  assert not np.array_equal(c.batch(0).tokens, want[0].tokens)


# ----------------------------------------------------------------------------- checks at config load


def _corpus_overrides(tokens: Path, offsets: Path) -> list[str]:
  return ["data.source=corpus", f"data.corpus_tokens={tokens}", f"data.corpus_offsets={offsets}"]


def test_config_load_checks_the_corpus(built, tmp_path):
  """Before JAX starts: a good corpus loads; ids past the vocabulary, a vocabulary larger than
  the model's, and missing files are config errors naming the corpus."""
  from distca_jax.config import load_config
  from distca_jax.data.corpus import check_corpus

  _, out, _ = built
  tokens, offsets = _copy_corpus(out, tmp_path / "c")
  assert load_config(None, _corpus_overrides(tokens, offsets)).data.source == "corpus"

  raw = tokens.read_bytes()
  bad = bytearray(raw)
  bad[-2:] = np.array([60_000], "<u2").tobytes()
  tokens.write_bytes(bytes(bad))
  with pytest.raises(ConfigError, match=f"data.corpus_tokens: corpus {tokens}: token id 60000 >= "):
    load_config(None, _corpus_overrides(tokens, offsets))
  # A token file too large to read at start-up is checked batch by batch, as a ConfigError too.
  check_corpus(tokens, offsets, vocab_size=512, scan_bytes=16)
  with pytest.raises(ConfigError, match="id 60000 >= vocab_size"):
    for step in range(100):
      CorpusSource(tokens, offsets, 2, 16).batch(step).tokens  # read with the batch's arrays
  tokens.write_bytes(raw)

  with pytest.raises(CorpusError, match=f"corpus {tokens} has vocab_size .* larger than the model's 5"):
    check_corpus(tokens, offsets, vocab_size=5)
  with pytest.raises(ConfigError, match="data.corpus_tokens: corpus offsets file .*does not exist"):
    load_config(None, _corpus_overrides(tokens, tmp_path / "nowhere.bin"))


def test_config_load_refuses_a_corpus_without_targets(tmp_path):
  """Every document one token long: no token has a next-token target, so nothing would train."""
  from distca_jax.config import load_config

  with CorpusWriter(tmp_path, vocab_size=10) as w:
    for i in range(20):
      w.add([i % 10])
  with pytest.raises(ConfigError, match="data.corpus_tokens: .*every document is one token long"):
    load_config(None, _corpus_overrides(tmp_path / "tokens.bin", tmp_path / "offsets.bin"))
