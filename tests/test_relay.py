"""Relayed K/V requests (`schedule/relay.py`) and the planner's pruning, checked independently of
the planner's bookkeeping: every server's K/V rows are traced back to (document, position)
through the layout, round by round.
"""


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_jax.data.packing import pack
from distca_jax.schedule import planner
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.items import Tasks, initial_tasks
from distca_jax.schedule.planner import balance
from distca_jax.schedule.traffic import kv_requests, pair_rows, traffic
from distca_jax.schedule.relay import Relay

COMM = CommModel(heads=4, kv_heads=1, head_dim=16)


def random_layout(seed: int):
  """A packed layout of 4-48 buffers: short documents, and now and then documents spanning many
  buffers (whose shards many servers need once balanced)."""
  rng = np.random.default_rng(seed)
  n = int(rng.integers(4, 49))
  t = int(rng.choice([256, 512, 1024]))
  lens = []
  while sum(lens) < n * t:
    lens.append(int(rng.integers(t, 6 * t)) if rng.random() < 0.15 else int(rng.integers(1, t)))
  lens[-1] -= sum(lens) - n * t
  return pack([l for l in lens if l > 0], n, t)


def fanned_out_layout(n: int = 32, t: int = 1024):
  """One document over buffers 0 and 1 whose second shard's queries are computed on every other
  device, and one-buffer documents elsewhere: devices 1..n-1 all need buffer 0's 1024 rows."""
  layout = pack([2 * t] + [t] * (n - 2), n, t)
  base = initial_tasks(layout)
  piece = t // (n - 1)
  lo = t + piece * np.arange(n - 1)
  hi = np.r_[lo[1:], 2 * t]
  keep = base.doc != 0
  return layout, Tasks(
      home=np.r_[base.home[keep], [0], np.ones(n - 1, np.int64)],
      doc=np.r_[base.doc[keep], np.zeros(n, np.int64)],
      q_lo=np.r_[base.q_lo[keep], [0], lo], q_hi=np.r_[base.q_hi[keep], [t], hi],
      home_off=np.r_[base.home_off[keep], [0], lo - t],
      server=np.r_[base.server[keep], [0], np.arange(1, n)]).sorted()


def check_relays(kv, relay: Relay):
  """The exchange's contract: a relayed piece's relay received the same rows of the same shard,
  or more, directly from the holder; it is neither the child nor the holder; a holder sends a
  shard's rows to at most `fanout` relays (one slice each). Returns the number of relayed
  slices per shard, keyed by (holder, document, the shard's first row on the holder)."""
  via = kv.piece_via
  assert via.dtype == np.int64 and via.shape == kv.piece_rows.shape
  server = kv.pair_server[kv.piece_pair]
  doc = kv.pair_doc[kv.piece_pair]
  direct = {}
  for k in np.flatnonzero(via < 0):
    direct[(int(server[k]), int(doc[k]), int(kv.piece_src[k]), int(kv.piece_src_off[k]),
            int(kv.piece_doc_off[k]))] = int(kv.piece_rows[k])
  slices = {}
  for k in np.flatnonzero(via >= 0):
    r, c = int(via[k]), int(server[k])
    assert r != c and r != kv.piece_src[k] and c != kv.piece_src[k]
    key = (r, int(doc[k]), int(kv.piece_src[k]), int(kv.piece_src_off[k]), int(kv.piece_doc_off[k]))
    assert key in direct and direct[key] >= kv.piece_rows[k]
    # The shard: its holder, document and where its rows start on the holder.
    shard = (int(kv.piece_src[k]), int(doc[k]), int(kv.piece_src_off[k] - kv.piece_doc_off[k]))
    slices.setdefault(shard, set()).add(key)
  assert max((len(s) for s in slices.values()), default=0) <= relay.fanout
  return {shard: len(s) for shard, s in slices.items()}


def received_rows(kv, layout):
  """Per (server, document): the document positions of the K/V rows it gets (from a holder, a
  relay or its own buffer), traced through the layout's buffers, in ascending order."""
  seg, pos = layout.segment_ids(), layout.positions()
  t = layout.buffer_len
  got = {}
  for k in range(kv.piece_rows.size):
    s, g = int(kv.pair_server[kv.piece_pair[k]]), int(kv.pair_doc[kv.piece_pair[k]])
    src, off, rows = int(kv.piece_src[k]), int(kv.piece_src_off[k]), int(kv.piece_rows[k])
    if off >= t:  # a ping-pong prior shard: not in these tests' layouts
      raise AssertionError("unexpected prior shard")
    assert (seg[src, off:off + rows] == g).all()
    assert (pos[src, off:off + rows] == kv.piece_doc_off[k] + np.arange(rows)).all()
    got.setdefault((s, g), []).append(pos[src, off:off + rows])
  return {key: np.sort(np.concatenate(v)) for key, v in got.items()}


@pytest.mark.parametrize("seed", range(12))
def test_relay_invariants_on_random_layouts(seed):
  layout = random_layout(seed)
  tasks, _ = balance(layout, COMM, 0.0)
  plain = kv_requests(tasks, layout)
  assert (plain.piece_via == -1).all()
  for relay in (Relay(1), Relay(2), Relay(3), Relay(8)):
    kv = kv_requests(tasks, layout, relay)
    check_relays(kv, relay)
    # Relays change who sends (and cut relayed shards' pieces at slices), nothing else: the same
    # pairs, and every server gets the same rows of the same holders.
    for f in ("pair_server", "pair_doc", "pair_need"):
      assert np.array_equal(getattr(kv, f), getattr(plain, f)), f
    assert received_rows(kv, layout).keys() == received_rows(plain, layout).keys()
    for key, rows in received_rows(kv, layout).items():
      assert np.array_equal(rows, received_rows(plain, layout)[key]), key


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10 ** 6), fanout=st.integers(1, 6))
def test_every_server_receives_its_rows_once(seed, fanout):
  """With relays, each server still gets exactly doc[0:need) of every document it serves, once,
  and the bytes each device receives are those of the direct exchange."""
  layout = random_layout(seed)
  tasks, _ = balance(layout, COMM, 0.0)
  relay = Relay(fanout)
  kv = kv_requests(tasks, layout, relay)
  check_relays(kv, relay)
  need = {}
  for s, g, hi in zip(tasks.server, tasks.doc, tasks.q_hi):
    need[(int(s), int(g))] = max(need.get((int(s), int(g)), 0), int(hi))
  got = received_rows(kv, layout)
  assert got.keys() == need.keys()
  for key, rows in got.items():
    assert np.array_equal(rows, np.arange(need[key])), key
  q, kv1, kv2 = pair_rows(tasks, layout, kv)
  q0, kv0, zero = pair_rows(tasks, layout)
  assert np.array_equal(q, q0) and not zero.any()
  assert np.array_equal((kv1 + kv2).sum(0), kv0.sum(0))  # per server: the same rows received
  assert (np.diag(kv1) == 0).all() and (np.diag(kv2) == 0).all()
  direct, relayed = traffic(tasks, layout, COMM), traffic(tasks, layout, COMM, relay=relay)
  assert np.allclose(relayed.recv, direct.recv)
  assert np.isclose(relayed.send.sum(), direct.send.sum())
  # A relay forwards only rows it received in round 1, to each other server at most once.
  assert (kv2.sum(1) <= (layout.num_buffers - 2) * kv1.sum(0)).all()
  # Holders send no more than directly.
  assert (kv1.sum(1) <= kv0.sum(1)).all()


def test_relay_none_is_the_direct_exchange():
  """`relay=None`: pieces come from their holders (traced independently), round 2 is empty, and
  traffic counts each holder's rows to each server."""
  layout = random_layout(3)
  tasks, _ = balance(layout, COMM, 0.0)
  kv = kv_requests(tasks, layout, None)
  assert (kv.piece_via == -1).all()
  n = layout.num_buffers
  expect = np.zeros((n, n), np.int64)
  seg, pos = layout.segment_ids(), layout.positions()
  need = {}
  for s, g, hi in zip(tasks.server, tasks.doc, tasks.q_hi):
    need[(int(s), int(g))] = max(need.get((int(s), int(g)), 0), int(hi))
  for (s, g), hi in need.items():
    holders = np.nonzero((seg == g) & (pos < hi))[0]
    np.add.at(expect, (holders[holders != s], s), 1)
  q, kv1, kv2 = pair_rows(tasks, layout, kv)
  assert np.array_equal(kv1, expect) and not kv2.any()
  tr = traffic(tasks, layout, COMM, relay=None)
  assert np.allclose(tr.kv_rows_out, expect.sum(1))
  assert np.allclose(tr.send, q.sum(1) * COMM.q_row_bytes + expect.sum(1) * COMM.kv_row_bytes)


@pytest.mark.parametrize("fanout", [1, 2, 5, 8, 30])
def test_relays_cut_the_holders_sends(fanout):
  """Devices 1..31 all need buffer 0's 1024 rows: sent directly, device 0 sends 31 copies;
  relayed, each row once, in min(fanout, 1024 / 128) slices to as many distinct relays, each of
  which forwards its slice to the other 30. (Buffer 1's rows, which devices 2..31 need in part,
  are relayed too; the counts below are buffer 0's.)"""
  layout, tasks = fanned_out_layout()
  t = layout.buffer_len
  direct = traffic(tasks, layout, COMM).kv_rows_out
  assert direct[0] == 31 * t
  relay = Relay(fanout)
  kv = kv_requests(tasks, layout, relay)
  slices = min(fanout, t // 128)
  assert check_relays(kv, relay)[(0, 0, 0)] == slices
  out = traffic(tasks, layout, COMM, relay=relay).kv_rows_out
  assert out[0] == t
  forwarded = (kv.piece_via >= 0) & (kv.piece_src == 0)
  per_relay = np.bincount(kv.piece_via[forwarded], weights=kv.piece_rows[forwarded])
  relays = np.flatnonzero(per_relay)
  assert relays.size == slices and 0 not in relays
  widest = max(np.diff(sorted({t * i // slices // 8 * 8 for i in range(slices)} | {t})))
  assert per_relay.max() == 30 * widest
  assert out.sum() == direct.sum()


def test_relays_spread_a_long_documents_shards():
  """Eight shards of one document, each needed by the same 24 servers (the last in part): relays
  are chosen by the rows they already send, so the forwards spread over the servers. With one
  slice per shard every shard has its own relay; with eight no device sends much more than the
  mean server."""
  n, t = 32, 1024
  layout = pack([8 * t] + [t] * (n - 8), n, t)
  base = initial_tasks(layout)
  keep = base.doc != 0
  # The document's last 1024 queries, in 24 pieces on devices 8..31; the rest stay home.
  piece = t // 24 // 8 * 8
  lo = 7 * t + piece * np.arange(24)
  hi = np.r_[lo[1:], 8 * t]
  home_doc = base.doc == 0
  tasks = Tasks(
      home=np.r_[base.home[keep], base.home[home_doc][:7], np.full(24, 7)],
      doc=np.r_[base.doc[keep], np.zeros(31, np.int64)],
      q_lo=np.r_[base.q_lo[keep], base.q_lo[home_doc][:7], lo],
      q_hi=np.r_[base.q_hi[keep], base.q_hi[home_doc][:7], hi],
      home_off=np.r_[base.home_off[keep], base.home_off[home_doc][:7], lo - 7 * t],
      server=np.r_[base.server[keep], base.server[home_doc][:7], np.arange(8, 32)]).sorted()
  direct = traffic(tasks, layout, COMM).kv_rows_out
  assert (direct[:7] == (30 - np.arange(7)) * t).all()  # to 24 servers and the later holders
  one = kv_requests(tasks, layout, Relay(1))
  assert set(check_relays(one, Relay(1)).values()) == {1}
  assert np.unique(one.piece_via[one.piece_via >= 0]).size == 8
  relay = Relay(8)
  kv = kv_requests(tasks, layout, relay)
  counts = check_relays(kv, relay)
  assert counts[(0, 0, 0)] == 8  # the shard most servers need: 8 slices, each relayed
  out = traffic(tasks, layout, COMM, relay=relay).kv_rows_out
  assert out[0] == t
  # Later shards relay fewer slices once the relays are as busy as their holders would be.
  assert out.max() == out[8:].max() <= 1.5 * out[8:].mean()
  assert out.max() <= direct.max() / 3


def test_relay_arguments():
  with pytest.raises(ValueError, match="fanout"):
    Relay(0)


# ----------------------------------------------------------------------------- planner pruning


@settings(max_examples=200, deadline=None)
@given(a0=st.integers(0, 3000), rows=st.integers(1, 600), beta=st.floats(0.02, 4.0))
def test_subrange_bound_bounds_every_subrange(a0, rows, beta):
  """The bound the planner skips split candidates by: at least E of every sub-range [x, y) of a
  piece [a0, e0), and nearly attained on pieces of a granule or more (so it prunes about as much
  as a bound can)."""
  e0 = a0 + rows
  qb, kvb = 1000.0, 1000.0 * beta
  y = np.arange(a0 + 1, e0 + 1, dtype=np.float64)[:, None]
  x = np.arange(a0, e0, dtype=np.float64)[None, :]
  ok = x < y
  e = np.where(ok, (y - x) * (y + x + 1) / 2 / np.where(ok, (y - x) * qb + y * kvb, 1.0), 0.0)
  bound = planner._subrange_bound(float(a0), float(e0), qb, kvb, planner._clip)
  vec = planner._subrange_bound(np.array([a0], float), np.array([e0], float), qb, kvb, np.clip)[0]
  assert np.isclose(bound, vec, rtol=1e-12)
  assert e.max() <= bound
  if rows >= 128:  # tight: the peak in m, taken as continuous, lies between two integers
    assert bound <= e.max() * (1 + 1e-3)


@pytest.mark.parametrize("seed", range(6))
def test_pruning_changes_no_plan(seed, monkeypatch):
  """Skipping the candidates the bound rules out gives the plan that scoring every one gives, on
  layouts of many short documents (where most are skipped) and of long ones."""
  rng = np.random.default_rng(seed)
  n, t = 64, 2048
  short = np.maximum(1, rng.lognormal(np.log(60), 1.0, 4 * n * t // 60)).astype(np.int64)
  lens = np.r_[rng.integers(t, 8 * t, seed % 3), short] if seed % 2 else short
  lens = lens[np.cumsum(lens) <= n * t]
  layout = pack(lens, n, t)
  pruned, stats = balance(layout, COMM, 0.05)
  monkeypatch.setattr(planner, "_subrange_bound", lambda a0, e0, qb, kvb, clip: a0 * 0 + np.inf)
  full, full_stats = balance(layout, COMM, 0.05)
  for f in ("home", "doc", "q_lo", "q_hi", "home_off", "server"):
    assert np.array_equal(getattr(pruned, f), getattr(full, f)), f
  assert stats.moves == full_stats.moves
  slack = 2 * 128 * float(lens.max())  # a move is cut at 128-token granularity
  assert stats.load_after.max() <= 1.05 * stats.load_after.mean() + slack


def test_bench_hotspot_table(capsys):
  """bench_scheduler.py --hotspot on a small mesh: one row per distribution, planner and relay
  setting."""
  from helpers import launch_script

  bench = launch_script("bench_scheduler")
  bench.main(["--hotspot", "pretrain", "long", "--devices", "16", "--tokens", "16384",
              "--batches", "1", "--repeats", "1", "--fanouts", "2", "4"])
  rows = [l.split("|") for l in capsys.readouterr().out.splitlines() if l.startswith("| pretrain")
          or l.startswith("| long")]
  assert [tuple(c.strip() for c in r[1:4]) for r in rows] == [
      (d, p, s) for d in ("pretrain", "long") for p in ("flat", "nodes")
      for s in ("off", "fanout 2", "fanout 4")]
  assert all(r[-2].strip().endswith("%") for r in rows)
