"""The trainer config's checks that span fields or read the input files (the length
distribution, the corpus, the held-out source), applied by `config.load_config` after every
field's own range (`schema.check`).

Each function takes the loaded sections (`distca_jax/config.py`'s `Config`, `DataConfig`) without
importing that module, so `config.py` can call `validate` and imports still point one way.
Every error is a `ConfigError` that names the dotted field.
"""

from __future__ import annotations

import dataclasses

from distca_jax.schema import ConfigError, check


def validate(config) -> None:
  """Checks that span fields of `config` (a `Config`), and the input files (length distribution,
  corpus). Single fields' ranges are their types' (`schema.check`); mesh-vs-device checks live in
  `mesh.py`."""
  from distca_jax.models.presets import resolve  # lazy: keeps config importable alone

  check(config)
  shape = resolve(config.model)  # raises ConfigError on bad shapes
  d = config.data
  if d.source == "corpus" and (d.corpus_tokens is None or d.corpus_offsets is None):
    raise ConfigError("data.corpus_tokens and data.corpus_offsets: both are required when data.source=corpus")
  m = config.mesh
  if d.packing == "wlb" and (config.attention.impl != "colocated" or m.pipe > 1):
    raise ConfigError("data.packing: wlb runs colocated attention without a pipeline (set "
                      "attention.impl=colocated and mesh.pipe=1)")
  if m.pipe > 1:
    if shape.layers % m.pipe:
      raise ConfigError(f"mesh.pipe: {m.pipe} stages must divide model.layers ({shape.layers})")
    if config.data.tokens_per_device % m.pipe:
      raise ConfigError(f"data.tokens_per_device: {config.data.tokens_per_device} must be a multiple "
                        f"of mesh.pipe ({m.pipe}): the LM head splits each micro-batch's tokens "
                        f"over the stages")
    if config.model.remat not in ("full", "auto"):
      raise ConfigError(f"model.remat: the pipeline keeps only block inputs between a micro-batch's "
                        f"forward and backward ticks and recomputes each block once (full remat); "
                        f"got {config.model.remat!r}, set model.remat=full (or auto, which takes full) with "
                        f"mesh.pipe > 1")
  if shape.tie_embeddings and m.pipe > 1:
    raise ConfigError("model.tie_embeddings: not with mesh.pipe > 1 yet (the embedding and the LM "
                      "head live on different stages); set mesh.pipe=1")
  if config.train.microbatches > 1 and d.packing == "wlb":
    raise ConfigError("train.microbatches: > 1 is not implemented with data.packing=wlb")
  if shape.heads % m.tensor or shape.kv_heads % m.tensor:
    raise ConfigError(
        f"mesh.tensor: {m.tensor} must divide model.heads ({shape.heads}) and model.kv_heads ({shape.kv_heads})")
  if shape.ffn % m.tensor:
    raise ConfigError(f"mesh.tensor: {m.tensor} must divide model.ffn ({shape.ffn})")
  a = config.attention
  if a.gate_profile is not None:
    from distca_jax.gate_profile import read_profile

    try:
      read_profile(a.gate_profile)
    except ValueError as e:
      raise ConfigError(f"attention.gate_profile: {e}") from None
  if a.data_rank_nodes is not None and m.data != -1 and len(a.data_rank_nodes) != m.data:
    raise ConfigError(f"attention.data_rank_nodes: one node number per data rank, got "
                      f"{len(a.data_rank_nodes)} for mesh.data={m.data}")
  if d.mixture:
    _check_mixture(d, shape.vocab_size)
  elif d.source == "corpus":
    _check_corpus(d, shape.vocab_size)
  else:
    _check_distribution(d)
  _check_eval(config, shape.vocab_size)


def _check_eval(config, vocab_size: int) -> None:
  """Evaluation runs where it is configured, and its source loads."""
  e, m = config.eval, config.mesh
  if e.batches and (m.pipe > 1 or config.data.packing == "wlb"):
    raise ConfigError("eval.batches: evaluation does not run with mesh.pipe > 1 or "
                      "data.packing=wlb yet; set eval.batches=0")
  if e.buckets is not None and list(e.buckets) != sorted(set(e.buckets)):
    raise ConfigError(f"eval.buckets: bucket starts must increase, got {list(e.buckets)}")
  if not e.batches:
    return
  if e.source == "corpus":
    if e.corpus_tokens is None or e.corpus_offsets is None:
      raise ConfigError("eval.corpus_tokens and eval.corpus_offsets: both are required when "
                        "eval.source=corpus")
    from distca_jax.data.corpus import CorpusError, check_corpus

    try:
      check_corpus(e.corpus_tokens, e.corpus_offsets, vocab_size)
    except CorpusError as err:
      raise ConfigError(f"eval.corpus_tokens: {err}") from None
  elif e.source == "synthetic" and e.distribution is not None:
    try:
      _check_distribution(dataclasses.replace(config.data, distribution=e.distribution))
    except ConfigError as err:
      raise ConfigError(str(err).replace("data.distribution", "eval.distribution", 1)) from None


def _check_distribution(d) -> None:
  """The length distribution loads, and its documents, scaled as the sampler scales them, are
  longer than one token somewhere (a one-token document has no next-token target)."""
  from distca_jax.data.doclens import MAX_POOL, load_lengths, longest_sampled, pool_size

  try:
    lengths = load_lengths(d.distribution, field="data.distribution")
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if pool_size(lengths, d.long_threshold, d.upsample_long_factor) > MAX_POOL:
    raise ConfigError(f"data.upsample_long_factor: {d.upsample_long_factor} repeats of the long "
                      f"documents of {d.distribution!r} exceed the sampler's pool of {MAX_POOL} "
                      f"documents")
  full_context = d.full_context_replacement
  if full_context is None:
    full_context = d.distribution == "prolong"
  longest = longest_sampled(lengths, d.long_threshold, full_context, d.elongate_factor, d.length_scale)
  if longest < 2:
    raise ConfigError(
        f"data.distribution: every document of {d.distribution!r} is one token long after "
        f"data.elongate_factor ({d.elongate_factor}) and data.length_scale ({d.length_scale:g}), "
        f"so no token has a next-token target; lower data.length_scale")
  if longest >= 2**53:
    raise ConfigError(
        f"data.elongate_factor: documents of {d.distribution!r} reach {longest:.3g} tokens after "
        f"data.elongate_factor ({d.elongate_factor}) and data.length_scale ({d.length_scale:g}); "
        f"too long to count")


def _check_mixture(d, vocab_size: int) -> None:
  """Names are unique, each source's corpus (both files) or distribution checks as a lone
  source's would, and `data.source` is left at its default (the mixture replaces it)."""
  if d.source != "synthetic" or d.corpus_tokens or d.corpus_offsets:
    raise ConfigError("data.mixture: replaces data.source and data.corpus_*; list the corpus as a "
                      "mixture entry instead")
  names = [s.name for s in d.mixture]
  if len(set(names)) != len(names):
    raise ConfigError(f"data.mixture: names must differ, got {names}")
  for i, s in enumerate(d.mixture):
    where = f"data.mixture[{i}] ({s.name})"
    if (s.corpus_tokens is None) != (s.corpus_offsets is None):
      raise ConfigError(f"{where}: corpus_tokens and corpus_offsets: set both or neither")
    try:
      if s.corpus_tokens is not None:
        _check_corpus(dataclasses.replace(d, corpus_tokens=s.corpus_tokens,
                                          corpus_offsets=s.corpus_offsets), vocab_size)
      else:
        _check_distribution(dataclasses.replace(d, distribution=s.distribution))
    except ConfigError as e:
      raise ConfigError(f"{where}: {e}") from None


def _check_corpus(d, vocab_size: int) -> None:
  """The corpus opens (files, sidecar, offsets), fits the model's vocabulary, has a document of
  two tokens or more, and (when small enough to read now) holds only ids below its vocabulary."""
  from distca_jax.data.corpus import CorpusError, check_corpus

  try:
    check_corpus(d.corpus_tokens, d.corpus_offsets, vocab_size)
  except CorpusError as e:
    raise ConfigError(f"data.corpus_tokens: {e}") from None
