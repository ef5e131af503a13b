"""The weighted mixture (`data.mixture`) and the document cap (`data.max_doc_len`), host side:
each source's share of the tokens, counted in the batches themselves; batches that are a pure
function of the step; cut documents whose positions restart; the config's checks."""

import numpy as np
import pytest

from distca_jax.config import ConfigError, load_config
from distca_jax.data.corpus import CorpusWriter
from distca_jax.data.mixture import data_layout, layout_change, mixture_from_config
from distca_jax.data.sources import synthetic_from_config

T, N = 256, 2


def _corpus(directory, lo, hi, seed):
  """A corpus whose token ids all lie in [lo, hi): its tokens in a batch say where they came from."""
  rng = np.random.default_rng(seed)
  with CorpusWriter(directory, vocab_size=512) as w:
    for _ in range(60):
      w.add(rng.integers(lo, hi, rng.integers(2, 400)))
  return str(directory / "tokens.bin"), str(directory / "offsets.bin")


def _mixture_config(tmp_path, weights, *extra):
  entries = []
  for j, w in enumerate(weights):
    tokens, offsets = _corpus(tmp_path / f"c{j}", 100 * j + 1, 100 * j + 100, j)
    entries.append(f"{{name: s{j}, weight: {w}, corpus_tokens: {tokens}, corpus_offsets: {offsets}}}")
  return load_config(None, ["model.vocab_size=512", f"data.tokens_per_device={T}",
                            f"data.mixture=[{', '.join(entries)}]", *extra])


def test_each_source_gets_its_weight_of_the_tokens(tmp_path):
  weights = (0.55, 0.3, 0.15)
  cfg = _mixture_config(tmp_path, weights)
  mix = mixture_from_config(cfg.data, 512, N)
  steps = 300
  counts = np.zeros(len(weights))
  for step in range(steps):
    b = mix.batch(step)
    real = b.tokens[b.segment_ids >= 0]
    counts += np.bincount(real // 100, minlength=len(weights))[:len(weights)]
  assert counts.sum() == steps * N * T
  share = counts / counts.sum()
  assert np.all(np.abs(share - np.asarray(weights)) <= 0.01), share
  # The running totals the checkpoint keeps are the tokens the batches held.
  assert list(mix.tokens_by_source(steps).values()) == counts.tolist()

  # A pure function of the step: a resumed run (a fresh source) builds the same batch, and a
  # process building only its rows gets those rows.
  again = mixture_from_config(cfg.data, 512, N)
  for step in (0, 17, steps - 1):
    a, b = mix.batch(step), again.batch(step)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.positions, b.positions)
    np.testing.assert_array_equal(again.batch(step, rows=[1]).tokens[1], a.tokens[1])


def test_synthetic_sources_mix_and_documents_are_cut(tmp_path):
  cap = 48
  entries = "[{name: short, weight: 3, distribution: pretrain}, {name: long, weight: 1, distribution: prolong}]"
  cfg = load_config(None, [f"data.tokens_per_device={T}", f"data.mixture={entries}",
                           f"data.max_doc_len={cap}", "data.length_scale=4"])
  mix = mixture_from_config(cfg.data, 256, N)
  assert mix.tokens_by_source(4) == {"short": 4 * N * T * 3 // 4, "long": 4 * N * T // 4}
  b = mix.batch(5)
  assert b.layout.doc_lens.max() <= cap and b.positions.max() < cap

  # The cap cuts the same token stream: positions restart at each cut, no target crosses it.
  uncut_cfg = load_config(None, [f"data.tokens_per_device={T}", "data.length_scale=1"])
  src = synthetic_from_config(uncut_cfg.data, 256, N)
  cut = synthetic_from_config(load_config(None, [f"data.tokens_per_device={T}",
                                                 "data.length_scale=1",
                                                 f"data.max_doc_len={cap}"]).data, 256, N)
  a, c = src.batch(3), cut.batch(3)
  assert a.layout.doc_lens.max() > cap
  np.testing.assert_array_equal(a.tokens, c.tokens)
  assert c.positions.max() == cap - 1 and (c.positions <= a.positions).all()
  at_cut = (a.positions % cap == cap - 1) & (a.loss_mask > 0)
  assert at_cut.any() and (c.loss_mask[at_cut] == 0).all()
  assert c.loss_mask.sum() == a.loss_mask.sum() - at_cut.sum()


def test_the_data_layout_names_what_changed(tmp_path):
  cfg = _mixture_config(tmp_path, (1, 1))
  a = data_layout(cfg.data, 4, 1)
  assert layout_change(a, data_layout(cfg.data, 4, 1)) == ""
  assert layout_change(a, data_layout(cfg.data, 2, 2)) == ("mesh.data 4 -> 2, "
                                                          "train.microbatches 1 -> 2")
  other = _mixture_config(tmp_path, (1, 2))
  assert "the data sources" in layout_change(a, data_layout(other.data, 4, 1))


@pytest.mark.parametrize("overrides,match", [
    (["data.mixture=[{name: a}, {name: a}]"], "names must differ"),
    (["data.mixture=[{name: a}]", "data.source=corpus", "data.corpus_tokens=x",
      "data.corpus_offsets=y"], "replaces data.source"),
    (["data.mixture=[{name: a, corpus_tokens: x}]"], r"data.mixture\[0\] \(a\).*set both"),
    (["data.mixture=[{name: a, distribution: nowhere.json}]"], r"data.mixture\[0\] \(a\)"),
    (["data.mixture=[{name: a, weight: 0}]"], "weight"),
    (["data.max_doc_len=0"], "data.max_doc_len"),
])
def test_mixture_config_errors(overrides, match):
  with pytest.raises(ConfigError, match=match):
    load_config(None, overrides)
