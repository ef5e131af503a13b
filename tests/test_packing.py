"""Packing invariants (packing.py, sources.make_batch) against a token-by-token reference, and the
paper's length sampling (doclens.py)."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from distca_jax.data.doclens import FULL_CONTEXT_TOKENS, LengthSampler, load_lengths
from distca_jax.data.packing import PAD_SEGMENT, index_in_runs, pack, ranges, run_of
from distca_jax.data.sources import SyntheticSource, make_batch, packed_batch

FAST = settings(max_examples=60, deadline=None)


@st.composite
def packings(draw):
  """(doc_lens, num_buffers, buffer_len) with the documents fitting, padding or not."""
  num_buffers = draw(st.integers(1, 5))
  buffer_len = draw(st.integers(1, 40))
  capacity = num_buffers * buffer_len
  lens = []
  total = 0
  while total < capacity:
    n = draw(st.integers(1, max(1, min(capacity - total, 2 * buffer_len + 3))))
    lens.append(n)
    total += n
    if draw(st.integers(0, 9)) == 0:  # stop early now and then: trailing padding
      break
  return np.asarray(lens, np.int64), num_buffers, buffer_len


def reference(doc_lens, num_buffers, buffer_len):
  """Token by token: the flat stream holds the documents in order, then padding."""
  seg = np.full(num_buffers * buffer_len, PAD_SEGMENT)
  pos = np.zeros(num_buffers * buffer_len, np.int64)
  g = 0
  for d, n in enumerate(doc_lens):
    for p in range(n):
      seg[g], pos[g] = d, p
      g += 1
  return seg.reshape(num_buffers, buffer_len), pos.reshape(num_buffers, buffer_len)


@FAST
@given(packings())
def test_segment_ids_and_positions_match_reference(case):
  lens, nb, bl = case
  layout = pack(lens, nb, bl)
  seg, pos = reference(lens, nb, bl)
  np.testing.assert_array_equal(layout.segment_ids(), seg)
  np.testing.assert_array_equal(layout.positions(), pos)
  assert layout.segment_ids().dtype == np.int32 and layout.positions().dtype == np.int32


@FAST
@given(packings())
def test_shards_tile_documents_inside_buffers(case):
  lens, nb, bl = case
  L = pack(lens, nb, bl)
  assert (L.length >= 1).all()
  assert ((L.buffer >= 0) & (L.buffer < nb)).all()
  assert (L.buffer_offset + L.length <= bl).all()  # a shard never crosses a buffer
  # Ordered by (buffer, offset), which is document order; shards are back to back in the stream.
  flat_start = L.buffer * bl + L.buffer_offset
  np.testing.assert_array_equal(flat_start, np.concatenate([[0], np.cumsum(L.length)[:-1]]) if L.num_shards else [])
  assert (np.diff(L.doc) >= 0).all()
  for d, n in enumerate(lens):
    mine = L.doc == d
    # Consecutive buffers, positions continuing from shard to shard, covering the document.
    assert (np.diff(L.buffer[mine]) == 1).all()
    np.testing.assert_array_equal(L.doc_offset[mine], np.cumsum(L.length[mine]) - L.length[mine])
    assert L.length[mine].sum() == n
    # Only a document's first shard may start mid-buffer; only its last may end mid-buffer.
    assert (L.buffer_offset[mine][1:] == 0).all()
    assert (L.buffer_offset[mine] + L.length[mine])[:-1].tolist() == [bl] * (mine.sum() - 1)


def _tokens(lens, seed=0):
  return np.random.default_rng(seed).integers(1, 1000, int(np.sum(lens))).astype(np.int32)


@FAST
@given(packings())
def test_targets_are_next_token_of_same_document(case):
  lens, nb, bl = case
  toks = _tokens(lens)
  b = make_batch(lens, toks, nb, bl)
  seg, pos = reference(lens, nb, bl)
  np.testing.assert_array_equal(b.segment_ids, seg)
  np.testing.assert_array_equal(b.positions, pos)
  flat_tok, flat_tgt, flat_mask = b.tokens.reshape(-1), b.targets.reshape(-1), b.loss_mask.reshape(-1)
  n = int(lens.sum())
  np.testing.assert_array_equal(flat_tok[:n], toks)
  assert (flat_tok[n:] == 0).all()
  ends = set((np.cumsum(lens) - 1).tolist())
  for g in range(nb * bl):
    real_next = g < n and g not in ends
    assert flat_mask[g] == float(real_next), g
    # Across a buffer boundary too: the target of a buffer's last row is the next buffer's first.
    assert flat_tgt[g] == (flat_tok[g + 1] if real_next else 0), g
  assert b.loss_mask.sum() == n - len(lens)


def test_positions_read_in_chunks_match_reference(monkeypatch):
  """Positions read a few at a time (`sources._CHUNK`), chunks ending inside documents and
  positions out of order among them: each token's target, loss weight and position as the
  token-by-token reference has them."""
  from distca_jax.data import sources

  monkeypatch.setattr(sources, "_CHUNK", 3)
  rng = np.random.default_rng(5)
  lens = rng.integers(1, 9, 12)
  toks = _tokens(lens, seed=1)
  n = int(lens.sum())
  seg, pos = reference(lens, 1, n + 4)
  ends = set((np.cumsum(lens) - 1).tolist())
  for flat in (np.arange(n + 4), rng.permutation(n + 4), np.sort(rng.integers(0, n + 4, 40))):
    got = sources.packed_arrays(lens, lambda p: toks[p], flat)
    for i, g in enumerate(flat.tolist()):
      real_next = g < n and g not in ends
      assert got["tokens"][i] == (toks[g] if g < n else 0)
      assert got["targets"][i] == (toks[g + 1] if real_next else 0)
      assert got["loss_mask"][i] == float(real_next)
      assert got["positions"][i] == pos[0, g]


def test_one_token_documents_have_no_target():
  lens = np.ones(8, np.int64)
  b = make_batch(lens, _tokens(lens), 2, 4)
  assert b.loss_mask.sum() == 0 and (b.targets == 0).all()
  np.testing.assert_array_equal(b.segment_ids.reshape(-1), np.arange(8))
  assert (b.positions == 0).all()


def test_documents_ending_exactly_at_buffer_boundaries():
  L = pack([4, 4, 2, 2], 3, 4)
  np.testing.assert_array_equal(L.buffer, [0, 1, 2, 2])
  np.testing.assert_array_equal(L.doc_offset, [0, 0, 0, 0])  # nothing continues
  b = make_batch(np.array([4, 4, 2, 2]), _tokens([12]), 3, 4)
  # A document's last token has no target even though the next buffer starts right after it.
  np.testing.assert_array_equal(b.loss_mask[:, -1], [0, 0, 0])


def test_one_document_spans_every_buffer():
  lens = np.array([4 * 16])
  b = make_batch(lens, _tokens(lens), 4, 16)
  assert b.layout.num_shards == 4
  np.testing.assert_array_equal(b.positions, np.arange(64).reshape(4, 16))  # continuing
  assert (b.segment_ids == 0).all()
  # Only the very last token lacks a next token: buffer ends inside the document keep theirs.
  assert b.loss_mask.sum() == 63 and b.loss_mask[-1, -1] == 0
  np.testing.assert_array_equal(b.targets[:-1, -1], b.tokens[1:, 0])


def test_continuation_across_buffers_keeps_positions():
  b = make_batch(np.array([3, 10, 3]), _tokens([16]), 2, 8)
  np.testing.assert_array_equal(b.positions, [[0, 1, 2, 0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 0, 1, 2]])
  np.testing.assert_array_equal(b.segment_ids, [[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 2, 2, 2]])
  assert b.loss_mask[0, -1] == 1 and b.targets[0, -1] == b.tokens[1, 0]


def test_padding_at_the_end():
  b = make_batch(np.array([5, 2]), _tokens([7]), 2, 8)
  assert (b.segment_ids.reshape(-1)[7:] == PAD_SEGMENT).all()
  assert (b.loss_mask.reshape(-1)[6:] == 0).all()
  assert (b.positions.reshape(-1)[7:] == 0).all() and (b.tokens.reshape(-1)[7:] == 0).all()


def test_no_documents_is_all_padding():
  L = pack([], 2, 4)
  assert L.num_shards == 0 and (L.segment_ids() == PAD_SEGMENT).all()


@pytest.mark.parametrize("lens, nb, bl", [([5, 4], 2, 4), ([0, 3], 1, 8), ([-1], 1, 8), ([1], 0, 8)])
def test_pack_rejects_bad_input(lens, nb, bl):
  with pytest.raises(ValueError, match="pack"):
    pack(lens, nb, bl)


def test_make_batch_rejects_token_count_mismatch():
  with pytest.raises(ValueError, match="make_batch"):
    make_batch(np.array([3, 3]), np.zeros(5, np.int32), 1, 8)


# ----------------------------------------------------------------------------- doclens


@pytest.fixture(scope="module")
def pretrain():
  return load_lengths("pretrain")


@FAST
@given(total=st.integers(1, 300_000), step=st.integers(0, 10_000), scale=st.sampled_from([1.0, 16.0]))
def test_sample_sums_exactly_to_budget(pretrain, total, step, scale):
  out = LengthSampler(pretrain, length_scale=scale).sample(total, step)
  assert out.sum() == total and (out >= 1).all() and out.dtype == np.int64


def test_sample_deterministic_per_seed_and_step(pretrain):
  s = LengthSampler(pretrain, seed=3)
  np.testing.assert_array_equal(s.sample(100_000, 7), LengthSampler(pretrain, seed=3).sample(100_000, 7))
  assert not np.array_equal(s.sample(100_000, 7), s.sample(100_000, 8))
  assert not np.array_equal(s.sample(100_000, 7), LengthSampler(pretrain, seed=4).sample(100_000, 7))


def test_elongation_multiplies(pretrain):
  one = LengthSampler(pretrain).sample(200_000, 5)
  four = LengthSampler(pretrain, elongate_factor=4).sample(800_000, 5)
  np.testing.assert_array_equal(four, 4 * one)


def test_length_scale_divides(pretrain):
  one = LengthSampler(pretrain).sample(1_000_000, 2)
  small = LengthSampler(pretrain, length_scale=10).sample(100_000, 2)
  n = min(one.size, small.size) - 1
  np.testing.assert_array_equal(small[:n], np.maximum(1, np.round(one[:n] / 10)))


def test_threshold_and_upsampling():
  # A budget of exactly the pool's total returns the whole pool, permuted.
  lengths = [5, 7, 20, 30]
  s = LengthSampler(np.asarray(lengths), long_threshold=10, upsample_long_factor=3)
  pool = [5, 7] + [20, 30] * 3
  assert sorted(s.sample(sum(pool), 0).tolist()) == sorted(pool)
  s = LengthSampler(np.asarray(lengths), long_threshold=25, upsample_long_factor=2)
  pool = [5, 7, 20, 30, 30]
  assert sorted(s.sample(sum(pool), 1).tolist()) == sorted(pool)


def test_pool_smaller_than_budget_draws_again():
  out = LengthSampler(np.asarray([3, 4]), long_threshold=100).sample(1000, 0)
  assert out.sum() == 1000 and set(out[:-1].tolist()) <= {3, 4}


@pytest.mark.parametrize("elongate", [1, 2])
def test_prolong_full_context_replacement(elongate):
  lengths = np.asarray([100] * 50 + [20_000] * 50)
  full = FULL_CONTEXT_TOKENS * elongate
  budget = 10 * full
  on = LengthSampler(lengths, full_context_replacement=True, elongate_factor=elongate)
  off = LengthSampler(lengths, full_context_replacement=False, elongate_factor=elongate)
  replaced = [int((on.sample(budget, step)[:-1] == full).sum()) for step in range(4)]
  assert min(replaced) > 0
  assert all(int((off.sample(budget, step) == full).sum()) == 0 for step in range(4))
  # Only long documents are replaced: short ones survive unchanged.
  assert (on.sample(budget, 0) == 100 * elongate).any()


def test_prolong_builtin_loads():
  lengths = load_lengths("prolong")
  assert lengths.size > 1000 and lengths.min() >= 1


@pytest.mark.parametrize("text, message", [
    ("not json", "not valid JSON"),
    ("{}", "non-empty JSON list"),
    ("[]", "non-empty JSON list"),
    ("[1, 2.5]", "integer"),
    ("[1, true]", "integer"),
    ("[3, -2]", ">= 1"),
    ("[0]", ">= 1"),
])
def test_bad_length_files_raise(tmp_path, text, message):
  path = tmp_path / "lens.json"
  path.write_text(text)
  with pytest.raises(ValueError, match=message):
    load_lengths(str(path))


def test_user_length_file(tmp_path):
  path = tmp_path / "lens.json"
  path.write_text(json.dumps([10, 20, 30]))
  np.testing.assert_array_equal(load_lengths(str(path)), [10, 20, 30])


def test_missing_distribution_names_field(tmp_path):
  with pytest.raises(ValueError, match="data.distribution"):
    load_lengths(str(tmp_path / "absent.json"))


@FAST
@given(packings(), st.data())
def test_rows_and_lookups_match_the_whole_layout(case, data):
  """A process reads only its rows: segment ids and positions of some buffers, and `locate` of
  single rows, equal the whole layout's."""
  lens, nb, bl = case
  layout = pack(lens, nb, bl)
  seg, pos = reference(lens, nb, bl)
  rows = np.asarray(data.draw(st.lists(st.integers(0, nb - 1), min_size=1, unique=True)))
  np.testing.assert_array_equal(layout.segment_ids(rows), seg[rows])
  np.testing.assert_array_equal(layout.positions(rows), pos[rows])
  b = np.asarray(data.draw(st.lists(st.integers(0, nb - 1), min_size=1, max_size=20)))
  o = np.asarray(data.draw(st.lists(st.integers(0, bl - 1), min_size=b.size, max_size=b.size)))
  doc, p = layout.locate(b, o)
  np.testing.assert_array_equal(doc, seg[b, o])
  np.testing.assert_array_equal(p, pos[b, o])


@FAST
@given(packings(), st.data())
def test_a_batch_of_some_rows_is_the_whole_batch_s(case, data):
  """`packed_batch(rows=...)` fills exactly those buffers, as the whole batch has them, and leaves
  the others zero; `take` reads any token of the batch, held or not, as the whole batch does."""
  lens, nb, bl = case
  tokens = np.random.default_rng(int(lens.sum())).integers(1, 1000, int(lens.sum())).astype(np.int32)
  whole = make_batch(lens, tokens, nb, bl)
  rows = np.asarray(data.draw(st.lists(st.integers(0, nb - 1), min_size=1, unique=True)))
  part = packed_batch(lens, lambda p: tokens[p], nb, bl, rows)
  others = np.setdiff1d(np.arange(nb), rows)
  assert part.holds(rows) and not (others.size and part.holds(others)) and whole.holds(others)
  for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids"):
    np.testing.assert_array_equal(getattr(part, k)[rows], getattr(whole, k)[rows], err_msg=k)
    assert not getattr(part, k)[others].any(), k
  flat = np.asarray(data.draw(st.lists(st.integers(0, nb * bl - 1), min_size=1, max_size=30)))
  got, want = part.take(flat), whole.take(flat)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_synthetic_source_builds_the_rows_asked_for():
  src = SyntheticSource(LengthSampler(lengths=load_lengths("pretrain"), seed=3), 1000, 6, 4096)
  whole, rows = src.batch(2), np.array([1, 4])
  part = src.batch(2, rows)
  for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids"):
    np.testing.assert_array_equal(getattr(part, k)[rows], getattr(whole, k)[rows], err_msg=k)
  assert not part.tokens[[0, 2, 3, 5]].any() and whole.tokens[[0, 2, 3, 5]].any()
  with pytest.raises(ValueError, match="outside"):
    src.batch(2, [6])


def test_a_source_batch_builds_its_arrays_when_first_read():
  """A source's batch builds its arrays when one is first read: ping-pong's split reads the
  tokens it re-packs from the stream and leaves them unbuilt (a step run as two nano-batches
  never reads them); `take` reads the same tokens from the stream as from the built arrays."""
  from distca_jax.dispatch import split_pingpong_batch

  src = SyntheticSource(LengthSampler(lengths=load_lengths("pretrain"), seed=3), 1000, 4, 4096)
  flat = np.random.default_rng(0).integers(0, 4 * 4096, 500)
  for rows in (None, np.array([1, 2])):
    batch = src.batch(2, rows)
    split_pingpong_batch(batch)
    from_stream = batch.take(flat)
    assert not batch.built
    segment_ids = batch.segment_ids
    assert batch.built and batch.segment_ids is segment_ids
    held = np.arange(4) if rows is None else rows
    np.testing.assert_array_equal(segment_ids[held], batch.layout.segment_ids(held))
    from_arrays = batch.take(flat)
    for k in from_stream:
      np.testing.assert_array_equal(from_arrays[k], from_stream[k], err_msg=k)
  with pytest.raises(AttributeError, match="nope"):
    src.batch(0).nope


def test_ranges_and_index_in_runs_match_loops():
  """`ranges`, `index_in_runs` and `run_of`, the vectorised helpers the host paths share, equal
  their Python loops on random runs, empty runs and no runs included (`run_of` on positions in
  order, its fast path, and out of order)."""
  rng = np.random.default_rng(0)
  for size in (0, 1, 7, 50):
    counts = rng.integers(0, 5, size)
    starts = rng.integers(-3, 100, size)
    want_idx = [k for c in counts for k in range(c)]
    want_ranges = [s + k for s, c in zip(starts, counts) for k in range(c)]
    np.testing.assert_array_equal(index_in_runs(counts), np.array(want_idx, np.int64))
    np.testing.assert_array_equal(ranges(starts, counts), np.array(want_ranges, np.int64))
    ends = np.cumsum(counts)
    for p in (np.arange(-2, int(ends[-1] if size else 0) + 3), rng.integers(-2, 120, 300)):
      np.testing.assert_array_equal(run_of(ends, p), [sum(e <= x for e in ends) for x in p])
