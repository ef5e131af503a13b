"""Tokenizes text files, or takes pre-tokenized arrays, into a corpus for `data.source=corpus`
or a `data.mixture` entry (format: distca_jax/data/corpus.py).

  python launch/build_corpus.py --tokenizer tokenizer.json --out data/mycorpus a.txt b.txt
  python launch/build_corpus.py --tokenizer tokenizer.json --out data/c --lines --eos '</s>' big.txt
  python launch/build_corpus.py --tokenizer tokenizer.json --out data/c 'shards/**/*.jsonl'
  python launch/build_corpus.py --vocab-size 128256 --out data/books 'books/*.npy'

Inputs, in the order given; a pattern with * ? or [ (quoted, so the shell leaves it) is every
file it matches, sorted by name. A `.jsonl` file holds one document per line, a JSON object whose
`--text-field` (default "text") is the document; a `.npy` file is pre-tokenized, one document
(1-D integer array) or one per row (2-D); a `.npz` file holds `tokens` (1-D) and `offsets`
(document d is tokens[offsets[d]:offsets[d+1]]); any other file is text, one document, or one
per non-empty line with `--lines`. Text needs `--tokenizer`, a local Hugging Face `tokenizers`
JSON file (nothing is downloaded); arrays alone need `--vocab-size` (or the tokenizer's).
Writes DIR/tokens.bin, DIR/offsets.bin and DIR/tokens.json; train with
`data.source=corpus data.corpus_tokens=DIR/tokens.bin data.corpus_offsets=DIR/offsets.bin`.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from distca_jax.data.corpus import CorpusWriter, file_sha256

# Documents are tokenized in groups so `encode_batch` can use every core.
ENCODE_GROUP = 1024


ARRAY_SUFFIXES = (".npy", ".npz")


def expand_inputs(patterns: list[str]) -> list[Path]:
  """The input files: each argument as a path, or a glob pattern's matches sorted by name; a
  pattern that matches nothing, or a path that is not a file, ends the build."""
  paths: list[Path] = []
  for pattern in patterns:
    if any(ch in pattern for ch in "*?["):
      matches = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
      if not matches:
        raise SystemExit(f"input pattern {pattern!r} matches no file")
      paths += map(Path, matches)
    else:
      paths.append(Path(pattern))
  missing = [str(p) for p in paths if not p.is_file()]
  if missing:
    raise SystemExit(f"input files do not exist: {', '.join(missing)}")
  return paths


def iter_arrays(path: Path) -> Iterator[np.ndarray]:
  """The documents of a pre-tokenized `.npy` (1-D: one; 2-D: one per row) or `.npz` (`tokens`
  and `offsets`) file, as integer arrays."""
  try:
    loaded = np.load(path, mmap_mode="r" if path.suffix == ".npy" else None, allow_pickle=False)
  except (ValueError, OSError) as e:
    raise SystemExit(f"{path}: not a readable {path.suffix} file ({e})")
  if path.suffix == ".npz":
    if "tokens" not in loaded or "offsets" not in loaded:
      raise SystemExit(f"{path}: a .npz input holds `tokens` and `offsets`, found {sorted(loaded)}")
    tokens, offsets = loaded["tokens"], np.asarray(loaded["offsets"], np.int64)
    if (tokens.ndim != 1 or offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0
        or offsets[-1] != tokens.size or (np.diff(offsets) < 0).any()):
      raise SystemExit(f"{path}: `offsets` must rise from 0 to len(tokens) ({tokens.size})")
    docs = (tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:]))
  elif loaded.ndim in (1, 2):
    docs = [loaded] if loaded.ndim == 1 else loaded
  else:
    raise SystemExit(f"{path}: a .npy input is 1-D (one document) or 2-D (one per row), "
                     f"got {loaded.ndim}-D")
  for doc in docs:
    if not np.issubdtype(doc.dtype, np.integer):
      raise SystemExit(f"{path}: token ids must be integers, got {doc.dtype}")
    yield np.asarray(doc)


def iter_documents(paths: list[Path], lines: bool, text_field: str) -> Iterator[str]:
  """Yields document texts from the text inputs, in the order given."""
  for path in paths:
    if path.suffix == ".jsonl":
      with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
          if not line.strip():
            continue
          try:
            record = json.loads(line)
          except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{lineno}: not valid JSON ({e})")
          if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise SystemExit(f"{path}:{lineno}: expected an object with a string field {text_field!r}")
          yield record[text_field]
    elif lines:
      with open(path, encoding="utf-8") as f:
        for line in f:
          if line.strip():
            yield line.rstrip("\n")
    else:
      yield path.read_text(encoding="utf-8")


def _special_id(tokenizer, token: str | None, flag: str) -> int | None:
  if token is None:
    return None
  token_id = tokenizer.token_to_id(token)
  if token_id is None:
    raise SystemExit(f"{flag} {token!r}: not a token of the tokenizer's vocabulary")
  return token_id


def _load_tokenizer(tokenizer_path: Path):
  from tokenizers import Tokenizer  # imported here so `--help` works without the package

  if not tokenizer_path.is_file():
    raise SystemExit(f"--tokenizer {tokenizer_path}: file does not exist")
  try:
    return Tokenizer.from_file(str(tokenizer_path))
  except Exception as e:  # the library raises bare Exceptions for malformed files
    raise SystemExit(f"--tokenizer {tokenizer_path}: not a tokenizers JSON file ({e})")


def build(tokenizer_path: Path | None, out_dir: Path, inputs: list[Path], lines: bool = False,
          text_field: str = "text", bos: str | None = None, eos: str | None = None,
          vocab_size: int | None = None) -> dict:
  """Tokenizes the text `inputs` and takes the pre-tokenized ones as they are, in order, into a
  corpus in `out_dir`; returns the sidecar (plus `skipped_empty`). BOS / EOS go around text
  documents only (arrays are taken as tokenized)."""
  missing = [str(p) for p in inputs if not p.is_file()]
  if missing:
    raise SystemExit(f"input files do not exist: {', '.join(missing)}")
  texts = [p for p in inputs if p.suffix not in ARRAY_SUFFIXES]
  tokenizer = None if tokenizer_path is None else _load_tokenizer(tokenizer_path)
  if tokenizer is None and texts:
    raise SystemExit(f"--tokenizer: needed for the text inputs ({texts[0]}, ...)")
  if vocab_size is None:
    if tokenizer is None:
      raise SystemExit("--vocab-size: needed when no --tokenizer gives it")
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
  if tokenizer is None and (bos or eos):
    raise SystemExit("--bos / --eos: need --tokenizer (they go around text documents)")
  with CorpusWriter(out_dir, vocab_size=vocab_size,
                    tokenizer_sha256=file_sha256(tokenizer_path) if tokenizer else "") as writer:
    run: list[Path] = []  # text files in a row, tokenized together (encode_batch's groups)
    for path in [*inputs, None]:
      if path is not None and path.suffix not in ARRAY_SUFFIXES:
        run.append(path)
        continue
      if run:
        _add_texts(writer, tokenizer, run, lines, text_field, bos, eos)
        run = []
      for doc in iter_arrays(path) if path is not None else ():
        try:
          writer.add(doc)
        except ValueError as e:
          raise SystemExit(f"{path}: {e}")
  meta = json.loads((out_dir / "tokens.json").read_text())
  meta["skipped_empty"] = writer.skipped_empty
  return meta


def _add_texts(writer: CorpusWriter, tokenizer, inputs: list[Path], lines: bool, text_field: str,
               bos: str | None, eos: str | None) -> None:
  """Tokenizes the text files `inputs` into `writer`."""
  bos_id = _special_id(tokenizer, bos, "--bos")
  eos_id = _special_id(tokenizer, eos, "--eos")
  prefix = [] if bos_id is None else [bos_id]
  suffix = [] if eos_id is None else [eos_id]

  def flush(writer: CorpusWriter, texts: list[str]) -> None:
    # add_special_tokens=False: BOS/EOS are exactly what the flags say, whatever the tokenizer's
    # post-processor would add.
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
      if enc.ids:
        writer.add(prefix + enc.ids + suffix)
      else:
        writer.add([])  # counted as skipped: an empty text is not a document

  group: list[str] = []
  for text in iter_documents(inputs, lines, text_field):
    group.append(text)
    if len(group) == ENCODE_GROUP:
      flush(writer, group)
      group = []
  if group:
    flush(writer, group)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tokenizer", type=Path, help="local tokenizers JSON file (for text inputs)")
  parser.add_argument("--vocab-size", type=int, help="the vocabulary's size, for pre-tokenized "
                      "inputs without --tokenizer (default: the tokenizer's)")
  parser.add_argument("--out", required=True, type=Path, help="output directory")
  parser.add_argument("--lines", action="store_true", help="one document per non-empty line (non-.jsonl inputs)")
  parser.add_argument("--text-field", default="text", help="field holding the text in .jsonl inputs")
  parser.add_argument("--bos", metavar="TOKEN", help="prepend this vocabulary token to every document")
  parser.add_argument("--eos", metavar="TOKEN", help="append this vocabulary token to every document")
  parser.add_argument("inputs", nargs="+", help="text, .jsonl, .npy or .npz files, or quoted "
                      "glob patterns ('shards/*.jsonl', 'data/**/*.npy')")
  args = parser.parse_args(argv)
  if args.vocab_size is not None and args.vocab_size < 1:
    parser.error("--vocab-size: must be >= 1")
  meta = build(args.tokenizer, args.out, expand_inputs(args.inputs), lines=args.lines,
               text_field=args.text_field, bos=args.bos, eos=args.eos, vocab_size=args.vocab_size)
  print(f"wrote {meta['num_docs']} documents, {meta['num_tokens']} tokens ({meta['dtype']}, vocab "
        f"{meta['vocab_size']}) to {args.out}; skipped {meta['skipped_empty']} empty documents")
  return 0


if __name__ == "__main__":
  sys.exit(main())
