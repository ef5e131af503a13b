"""Relayed K/V requests (`schedule/relay.py`) and the planner's pruning, checked independently of
the planner's bookkeeping: every server's K/V rows are traced back to (document, position)
through the layout, round by round.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_jax.data.packing import pack
from distca_jax.schedule import planner
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.items import Tasks, initial_tasks
from distca_jax.schedule.planner import balance, kv_requests, pair_rows, traffic
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
  or more, directly; it is neither the child nor the holder; a relay forwards a shard to at most
  `fanout` children."""
  via = kv.piece_via
  assert via.dtype == np.int64 and via.shape == kv.piece_rows.shape
  server = kv.pair_server[kv.piece_pair]
  doc = kv.pair_doc[kv.piece_pair]
  direct = {}
  for k in np.flatnonzero(via < 0):
    direct[(int(server[k]), int(doc[k]), int(kv.piece_src[k]), int(kv.piece_src_off[k]),
            int(kv.piece_doc_off[k]))] = int(kv.piece_rows[k])
  children = {}
  for k in np.flatnonzero(via >= 0):
    r, c = int(via[k]), int(server[k])
    assert r != c and r != kv.piece_src[k] and c != kv.piece_src[k]
    key = (r, int(doc[k]), int(kv.piece_src[k]), int(kv.piece_src_off[k]), int(kv.piece_doc_off[k]))
    assert key in direct and direct[key] >= kv.piece_rows[k]
    children[key] = children.get(key, 0) + 1
  assert max(children.values(), default=0) <= relay.fanout
  return len(children)


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
  for relay in (Relay(1), Relay(2, 4), Relay(3, 1), Relay(8)):
    kv = kv_requests(tasks, layout, relay)
    check_relays(kv, relay)
    # Relays change who sends, nothing else.
    for f in ("pair_server", "pair_doc", "pair_need", "piece_pair", "piece_src", "piece_src_off",
              "piece_doc_off", "piece_rows"):
      assert np.array_equal(getattr(kv, f), getattr(plain, f)), f


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10 ** 6), fanout=st.integers(1, 6), per_node=st.sampled_from([1, 2, 8]))
def test_every_server_receives_its_rows_once(seed, fanout, per_node):
  """With relays, each server still gets exactly doc[0:need) of every document it serves, once,
  and the bytes each device receives are those of the direct exchange."""
  layout = random_layout(seed)
  tasks, _ = balance(layout, COMM, 0.0)
  relay = Relay(fanout, per_node)
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
  # Round 2 is sent by devices that got those rows in round 1: a relay forwards at most what
  # it received directly.
  assert (kv2.sum(1) <= fanout * kv1.sum(0)).all()


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


@pytest.mark.parametrize("fanout", [2, 5, 8, 30])
def test_relays_cut_the_holders_sends(fanout):
  """Devices 1..31 all need buffer 0's 1024 rows: sent directly, device 0 sends 31 copies; relayed,
  about sqrt(31) (at most `fanout`), and no relay forwards more than `fanout`."""
  layout, tasks = fanned_out_layout()
  t = layout.buffer_len
  direct = traffic(tasks, layout, COMM).kv_rows_out
  assert direct[0] == 31 * t
  relay = Relay(fanout, devices_per_node=8)
  kv = kv_requests(tasks, layout, relay)
  check_relays(kv, relay)
  out = traffic(tasks, layout, COMM, relay=relay).kv_rows_out
  copies = max(math.ceil(31 / (fanout + 1)), min(fanout, math.ceil(math.sqrt(31))))
  assert out[0] == copies * t
  assert out.max() <= max(copies, fanout) * t
  assert out.sum() == direct.sum()


def test_relays_prefer_the_childs_node():
  """On 4 nodes of 8 devices, a child whose node has a relay gets the rows over the node's links:
  fewer bytes cross nodes than with relays chosen without regard to nodes."""
  layout, tasks = fanned_out_layout()
  node = np.arange(layout.num_buffers) // 8

  def across(relay):
    pair = traffic(tasks, layout, COMM, pairwise=True, relay=relay).pair_bytes
    return pair[node[:, None] != node[None, :]].sum()

  aware = Relay(8, devices_per_node=8)
  kv = kv_requests(tasks, layout, aware)
  # Buffer 0's rows (every child needs all of them, so any relay can serve any child): a child
  # is served from another node only when each relay on its node has its even share of children.
  assert check_relays(kv, aware) > 0
  server = kv.pair_server[kv.piece_pair]
  shard0 = (kv.piece_src == 0) & (server != 0)
  relays = server[shard0 & (kv.piece_via < 0)]
  share = -(-(shard0.sum() - relays.size) // relays.size)
  children = {int(r): int((kv.piece_via[shard0] == r).sum()) for r in relays}
  for c, r in zip(server[shard0 & (kv.piece_via >= 0)], kv.piece_via[shard0 & (kv.piece_via >= 0)]):
    if node[r] != node[c]:
      assert all(k >= share for d, k in children.items() if node[d] == node[c])
  assert sum(node[r] == node[c] for c, r in zip(server[shard0], kv.piece_via[shard0]) if r >= 0) > 0
  assert across(aware) < across(Relay(8, devices_per_node=1))
  assert across(aware) < across(None)


def test_relay_arguments():
  with pytest.raises(ValueError, match="fanout"):
    Relay(0)
  with pytest.raises(ValueError, match="devices_per_node"):
    Relay(4, devices_per_node=0)


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
  """bench_scheduler.py --hotspot on a small mesh: one row per distribution and relay setting."""
  from helpers import launch_script

  bench = launch_script("bench_scheduler")
  bench.main(["--hotspot", "pretrain", "long", "--devices", "16", "--tokens", "16384",
              "--batches", "1", "--repeats", "1", "--fanouts", "2", "4"])
  rows = [l.split("|") for l in capsys.readouterr().out.splitlines() if l.startswith("| pretrain")
          or l.startswith("| long")]
  assert [(r[1].strip(), r[2].strip()) for r in rows] == [
      (d, s) for d in ("pretrain", "long") for s in ("off", "fanout 2", "fanout 4", "fanout 4, node-blind")]
  assert all(r[-2].strip().endswith("%") for r in rows)
