"""Tokenizes text files into a corpus for `data.source=corpus` (format: distca_jax/data/corpus.py).

  python launch/build_corpus.py --tokenizer tokenizer.json --out data/mycorpus a.txt b.txt
  python launch/build_corpus.py --tokenizer tokenizer.json --out data/c --lines --eos '</s>' big.txt
  python launch/build_corpus.py --tokenizer tokenizer.json --out data/c shard-*.jsonl

Inputs: a `.jsonl` file holds one document per line, a JSON object whose `--text-field` (default
"text") is the document; any other file is one document, or one document per non-empty line with
`--lines`. The tokenizer is a local Hugging Face `tokenizers` JSON file (nothing is downloaded).
Writes DIR/tokens.bin, DIR/offsets.bin and DIR/tokens.json; train with
`data.source=corpus data.corpus_tokens=DIR/tokens.bin data.corpus_offsets=DIR/offsets.bin`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator

from distca_jax.data.corpus import CorpusWriter, file_sha256

# Documents are tokenized in groups so `encode_batch` can use every core.
ENCODE_GROUP = 1024


def iter_documents(paths: list[Path], lines: bool, text_field: str) -> Iterator[str]:
  """Yields document texts from the input files, in the order given."""
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


def build(tokenizer_path: Path, out_dir: Path, inputs: list[Path], lines: bool = False,
          text_field: str = "text", bos: str | None = None, eos: str | None = None) -> dict:
  """Tokenizes `inputs` into a corpus in `out_dir`; returns the sidecar (plus `skipped_empty`)."""
  from tokenizers import Tokenizer  # imported here so `--help` works without the package

  if not tokenizer_path.is_file():
    raise SystemExit(f"--tokenizer {tokenizer_path}: file does not exist")
  missing = [str(p) for p in inputs if not p.is_file()]
  if missing:
    raise SystemExit(f"input files do not exist: {', '.join(missing)}")
  try:
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
  except Exception as e:  # the library raises bare Exceptions for malformed files
    raise SystemExit(f"--tokenizer {tokenizer_path}: not a tokenizers JSON file ({e})")
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

  with CorpusWriter(out_dir, vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
                    tokenizer_sha256=file_sha256(tokenizer_path)) as writer:
    group: list[str] = []
    for text in iter_documents(inputs, lines, text_field):
      group.append(text)
      if len(group) == ENCODE_GROUP:
        flush(writer, group)
        group = []
    if group:
      flush(writer, group)
  meta = json.loads((out_dir / "tokens.json").read_text())
  meta["skipped_empty"] = writer.skipped_empty
  return meta


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tokenizer", required=True, type=Path, help="local tokenizers JSON file")
  parser.add_argument("--out", required=True, type=Path, help="output directory")
  parser.add_argument("--lines", action="store_true", help="one document per non-empty line (non-.jsonl inputs)")
  parser.add_argument("--text-field", default="text", help="field holding the text in .jsonl inputs")
  parser.add_argument("--bos", metavar="TOKEN", help="prepend this vocabulary token to every document")
  parser.add_argument("--eos", metavar="TOKEN", help="append this vocabulary token to every document")
  parser.add_argument("inputs", nargs="+", type=Path, help="text or .jsonl files")
  args = parser.parse_args(argv)
  meta = build(args.tokenizer, args.out, args.inputs, lines=args.lines, text_field=args.text_field,
               bos=args.bos, eos=args.eos)
  print(f"wrote {meta['num_docs']} documents, {meta['num_tokens']} tokens ({meta['dtype']}, vocab "
        f"{meta['vocab_size']}) to {args.out}; skipped {meta['skipped_empty']} empty documents")
  return 0


if __name__ == "__main__":
  sys.exit(main())
