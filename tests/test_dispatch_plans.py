"""The host side of CAD: the ping-pong split, the step's capacities that only grow, the dispatch
arrays a process builds (`dispatch/format.py`), and the checks that refuse a plan that does not
belong to its batch (`dispatch/checks.py`)."""

import dataclasses

import jax
import numpy as np
import pytest

from distca_jax import attention as attn
from distca_jax import dispatch
from distca_jax import mesh as mesh_lib
from distca_jax.data.sources import synthetic_from_config
from distca_jax.schedule.capacities import Capacities
from distca_jax.schedule.pingpong import split_pingpong
from distca_jax.schedule.traffic import kv_requests, pair_rows
from distca_jax.train.step import Trainer
from helpers import global_plan, layout_batch, plan_for_layout, small_config

T = 256  # buffer length


def _with(plan, name: str, value):
  """`plan` with its array `name` (a round's as `q.send_idx`, `DispatchPlan.arrays`) replaced."""
  if "." not in name:
    return dataclasses.replace(plan, **{name: value})
  rnd, field = name.split(".")
  return dataclasses.replace(plan, **{rnd: dataclasses.replace(getattr(plan, rnd), **{field: value})})


@pytest.mark.parametrize("source", ["span_all", "pretrain", "prolong"])
def test_pingpong_halves_hold_the_batch(source):
  """Ping and Pong together hold every token of the batch once, each with its own target, loss
  weight and position; Pong's prior shards name rows of Ping that hold exactly the cut
  document's prefix."""
  n = 4
  if source == "span_all":
    batch = layout_batch(source, n, seed=1, T=128)
  else:
    batch = synthetic_from_config(small_config(f"mesh.data={n}", "data.tokens_per_device=512",
                                               f"data.distribution={source}").data, 512, n).batch(7)
  ping, pong = dispatch.split_pingpong_batch(batch)
  key = lambda b: sorted(zip(*(a[b.segment_ids >= 0].tolist() for a in
                               (b.tokens, b.targets, b.loss_mask, b.positions))))
  whole = key(batch)
  assert sorted(key(ping) + key(pong)) == whole
  assert ping.layout.prior is None and pong.layout.prior is not None
  prior = pong.layout.prior
  cut = split_pingpong(batch.layout.doc_lens).cut
  assert (prior.num_shards > 0) == (cut is not None)
  if cut is not None:  # the prefix's rows in Ping: positions 0 .. x-1 of that document, in order
    g, x = cut
    rows = np.concatenate([np.arange(o, o + l) + b * ping.layout.buffer_len for b, o, l in
                           zip(prior.buffer, prior.buffer_offset, prior.length)])
    assert ping.positions.reshape(-1)[rows].tolist() == list(range(x))
    start = int(np.sum(batch.layout.doc_lens[:g]))
    assert ping.tokens.reshape(-1)[rows].tolist() == batch.tokens.reshape(-1)[start:start + x].tolist()


def _step_shape(ctx):
  """What the step compiles for: its kind, every context array's shape, and the static sizes the
  dispatch plans carry beside their arrays (receive rows, blocks; the window)."""
  if isinstance(ctx, attn.ColocatedContext):
    return ("colocated", ctx.q_start.shape, ctx.window)
  static = tuple(d.static() for d in ctx.dispatch)
  return (f"cad x{len(ctx.batches)}",) + tuple(jax.tree.leaves(jax.tree.map(np.shape, ctx.dispatch))) + (static,)


@pytest.mark.parametrize("pingpong", [False, True])
def test_step_shapes_only_grow(pingpong):
  """Over a run's sampled batches, a trainer's StepShapes gives every step capacities no smaller
  than any earlier step's: no shape repeats after it was left, one new shape per growth, fewer
  shapes than steps planned alone (each taking its own buckets) -- and the same CAD plans."""
  cfg = small_config("mesh.data=4", "data.tokens_per_device=2048", "data.distribution=pretrain",
                     "attention.impl=distca", "attention.gate=false", "model.layers=1",
                     f"attention.pingpong={str(pingpong).lower()}")
  shape = Trainer(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4])).shape
  source = synthetic_from_config(cfg.data, 512, 4)
  shapes = dispatch.StepShapes()
  grown, alone = [], []
  for step in range(16):
    batch = source.batch(step)
    ctx = attn.host_context(cfg.attention, batch, shape, shapes=shapes)
    grown.append(_step_shape(ctx))
    alone_ctx = attn.host_context(cfg.attention, batch, shape)
    alone.append(_step_shape(alone_ctx))
    if isinstance(ctx, dispatch.StepContext):  # same tasks, larger arrays
      assert [p.tasks.server.tolist() for p in ctx.plans] == [p.tasks.server.tolist() for p in alone_ctx.plans]
  firsts = [s for i, s in enumerate(grown) if s not in grown[:i]]
  # Within each kind (colocated, CAD in one or two streams), each new shape is elementwise >=
  # the previous one.
  kinds = {s[0] for s in grown}
  for kind in kinds:
    seq = [s for s in firsts if s[0] == kind]
    for a, b in zip(seq, seq[1:]):
      assert all(np.all(np.array(y) >= np.array(x)) for x, y in zip(a[1:], b[1:]))
  # A step reuses the latest shape of its kind: no return to a shape it had left.
  for kind in kinds:
    seq = [s for s in grown if s[0] == kind]
    assert all(seq[i] == seq[i + 1] or seq[i + 1] not in seq[:i + 1] for i in range(len(seq) - 1))
  assert len(firsts) == shapes.growths
  assert len(firsts) < len(set(alone)), (len(firsts), len(set(alone)))


def test_pong_plan_is_checked_against_its_ping():
  """Pong's plan reads its cut document's prefix from Ping's rows: checked against the Ping it was
  split with it passes, against a Ping whose rows hold other positions it is refused."""
  from distca_jax.models.presets import resolve

  cfg = small_config("mesh.data=2", f"data.tokens_per_device={T}", "attention.impl=distca")
  ping, pong = dispatch.split_pingpong_batch(layout_batch("span_all", 2, seed=2, T=T))
  assert pong.layout.prior.num_shards
  _, plan = plan_for_layout(cfg.attention, pong.layout, resolve(cfg.model))
  dispatch.validate_plan(plan, pong.layout, batch=pong, prior_batch=ping)
  shifted = dataclasses.replace(ping, positions=np.roll(ping.positions, 1, axis=1))
  with pytest.raises(dispatch.PlanMismatchError, match="earlier stream"):
    dispatch.validate_plan(plan, pong.layout, batch=pong, prior_batch=shifted)


def test_plan_for_another_batch_is_refused():
  cfg = small_config("mesh.data=4", f"data.tokens_per_device={T}", "attention.impl=distca",
                     "attention.pingpong=false")
  a = synthetic_from_config(cfg.data, 512, 4).batch(0)
  b = synthetic_from_config(cfg.data, 512, 4).batch(1)
  from distca_jax.models.presets import resolve

  _, plan_a = plan_for_layout(cfg.attention, a.layout, resolve(cfg.model))
  with pytest.raises(dispatch.PlanMismatchError, match="does not match the batch"):
    dispatch.validate_plan(plan_a, b.layout)
  with pytest.raises(dispatch.PlanMismatchError, match="batch has"):
    dispatch.validate_plan(plan_a, layout_batch("equal", 2, 0).layout)
  bad = dataclasses.replace(plan_a, q_start=plan_a.q_start + 10 * T)
  with pytest.raises(dispatch.PlanMismatchError, match="past its capacities"):
    dispatch.validate_plan(bad, a.layout)
  dropped = plan_a.local_q_valid.copy()  # a real token in no query slot
  dropped[tuple(np.argwhere(dropped)[0])] = False
  with pytest.raises(dispatch.PlanMismatchError, match="in 0 query slots"):
    dispatch.validate_plan(dataclasses.replace(plan_a, local_q_valid=dropped), a.layout)
  # The backward's transposes: a wrong K/V inverse, or a query row placed on two servers.
  inv = plan_a.server_kv_inv.copy()
  slot = np.argwhere(plan_a.server_kv_inv_valid)[0]
  inv[tuple(slot)] += 1
  with pytest.raises(dispatch.PlanMismatchError, match="inverse"):
    dispatch.validate_plan(dataclasses.replace(plan_a, server_kv_inv=inv), a.layout)
  counts = plan_a.q.send_count.copy()  # the exchange's counts must describe its blocks
  off = np.argwhere(counts > 0)[0]
  counts[tuple(off)] -= 1
  with pytest.raises(dispatch.PlanMismatchError, match=r"q\.send_count"):
    dispatch.validate_plan(_with(plan_a, "q.send_count", counts), a.layout)
  with pytest.raises(dispatch.PlanMismatchError, match=r"kv\.recv_count"):
    dispatch.validate_plan(_with(plan_a, "kv.recv_count", plan_a.kv.send_count), a.layout)
  with pytest.raises(dispatch.PlanMismatchError, match=r"kv\.send_idx outside"):
    dispatch.validate_plan(_with(plan_a, "kv.send_idx", plan_a.kv.send_idx - T), a.layout)
  kv_idx = plan_a.server_kv_idx.copy()  # one K/V row gathered into two slots of server 0
  used = np.flatnonzero(plan_a.server_kv_valid[0])
  kv_idx[0, used[1]] = kv_idx[0, used[0]]
  with pytest.raises(dispatch.PlanMismatchError, match="two server slots"):
    dispatch.validate_plan(dataclasses.replace(plan_a, server_kv_idx=kv_idx), a.layout)
  sent = np.argwhere(~plan_a.local_q_valid & (a.layout.segment_ids() >= 0))
  assert sent.size, "want a batch where some rows move"
  twice = plan_a.local_q_valid.copy()  # a row sent away and read in place too
  twice[tuple(sent[0])] = True
  with pytest.raises(dispatch.PlanMismatchError, match="in 2 query slots"):
    dispatch.validate_plan(dataclasses.replace(plan_a, local_q_valid=twice), a.layout)


def test_build_dispatch_refuses_a_kv_row_gathered_twice():
  """The K/V inverse is written as the gather's ranges turned around: K/V requests that gather one
  row of a server into two slots (a piece of its own rows listed twice, at another document
  position) have no inverse and are refused, as the same requests once are not."""
  batch, plan = global_plan(4, "pretrain")
  kv = kv_requests(plan.tasks, batch.layout)
  caps = plan.capacities
  dispatch.build_dispatch(plan.tasks, batch.layout, caps, kv=kv)
  own = np.flatnonzero((kv.piece_src == kv.pair_server[kv.piece_pair]) & (kv.piece_rows > 1))
  assert own.size, "want a server reading rows of its own buffer"
  k = own[0]
  pieces = {f: getattr(kv, f) for f in ("piece_pair", "piece_src", "piece_src_off",
                                        "piece_doc_off", "piece_rows", "piece_via")}
  extra = {f: np.r_[a, a[k]] for f, a in pieces.items()}
  extra["piece_doc_off"][-1] += 1  # another slot, overlapping rows
  twice = dataclasses.replace(kv, **extra)
  with pytest.raises(dispatch.PlanMismatchError, match="two server slots"):
    dispatch.build_dispatch(plan.tasks, batch.layout, caps, kv=twice)


def _a_run(idx, valid, rows=1):
  """(device, first slot, slots) of the first run of at least `rows` + 1 valid slots holding
  consecutive rows in an index array."""
  for d in range(idx.shape[0]):
    slots = np.flatnonzero(valid[d])
    if slots.size <= rows:
      continue
    breaks = np.flatnonzero((np.diff(slots) != 1) | (np.diff(idx[d, slots]) != 1)) + 1
    for run in np.split(slots, breaks):
      if run.size > rows:
        return d, int(run[0]), int(run.size)
  raise AssertionError("no run to mutate")


def test_validate_plan_refuses_a_mutated_range():
  """The checks follow rows as ranges: a whole run of an index array moved by one row (still
  consecutive, so only the run's first row gives it away), or two runs swapped, is refused, in
  the query, K/V and round-2 arrays, and a run of the rows read in place moved by one."""
  layout, tasks, kv, _ = _relay_case()
  plan = dispatch.build_dispatch(tasks, layout, Capacities(), kv=kv)
  dispatch.validate_plan(plan, layout)
  arrays = plan.arrays()
  for name in ("q.send_idx", "kv.send_idx", "kv2.send_idx", "server_kv_idx"):
    idx = arrays[name]
    d, start, size = _a_run(idx, arrays[name.replace("idx", "valid")])
    moved = idx.copy()
    moved[d, start:start + size] += 1 if idx[d, start + size - 1] + 1 < idx.shape[-1] else -1
    bad = _with(plan, name, moved)
    with pytest.raises(dispatch.PlanMismatchError, match="match the batch|inverse|outside"):
      dispatch.validate_plan(bad, layout)
    # Refused by the process that reads the run: a sent row's server's (a query row's home's
    # too), any other array's own device's.
    if name.endswith(".send_idx"):
      rnd = getattr(plan, name.split(".")[0])
      count, off = rnd.send_count[d], rnd.send_off[d]
      d = int(np.flatnonzero((off <= start) & (count > 0))[-1])
    with pytest.raises(dispatch.PlanMismatchError):
      dispatch.validate_plan(bad, layout, [d])
  local = plan.local_q_valid
  d = int(np.flatnonzero(local.any(1) & ~local.all(1))[0])
  moved = local.copy()
  moved[d] = np.roll(local[d], 1)
  for devices in (None, [d]):
    with pytest.raises(dispatch.PlanMismatchError, match="query slots"):
      dispatch.validate_plan(dataclasses.replace(plan, local_q_valid=moved), layout, devices)
  # Two equal runs of a server's K/V gather swapped (the inverse swapped with it): each slot still
  # holds a row, the wrong one.
  idx, inv = plan.server_kv_idx.copy(), plan.server_kv_inv.copy()
  d, start, size = _a_run(idx, plan.server_kv_valid, rows=4)
  a, b = slice(start, start + 2), slice(start + 2, start + 4)
  idx[d, a], idx[d, b] = plan.server_kv_idx[d, b], plan.server_kv_idx[d, a]
  inv[d, idx[d, start:start + 4]] = np.arange(start, start + 4)
  with pytest.raises(dispatch.PlanMismatchError, match="match the batch"):
    dispatch.validate_plan(dataclasses.replace(plan, server_kv_idx=idx, server_kv_inv=inv), layout)


def test_validate_plan_checks_the_given_devices_rows():
  """A process checks the query slots and tasks of the rows it feeds: a real token of device 0 in
  no slot is refused when device 0 is among them, and is left to device 0's process otherwise."""
  cfg = small_config("mesh.data=4", f"data.tokens_per_device={T}", "attention.impl=distca",
                     "attention.pingpong=false")
  a = synthetic_from_config(cfg.data, 512, 4).batch(0)
  from distca_jax.models.presets import resolve

  _, mine = plan_for_layout(cfg.attention, a.layout, resolve(cfg.model), devices=[0, 2])
  with pytest.raises(dispatch.PlanMismatchError, match="does not match the batch"):
    dispatch.validate_plan(mine, a.layout)  # built for devices 0 and 2 only
  _, plan = plan_for_layout(cfg.attention, a.layout, resolve(cfg.model))
  dropped = plan.local_q_valid.copy()
  dropped[0, np.flatnonzero(dropped[0])[0]] = False
  bad = dataclasses.replace(plan, local_q_valid=dropped)
  for devices in (None, [0], [0, 3]):
    with pytest.raises(dispatch.PlanMismatchError, match="query slots"):
      dispatch.validate_plan(bad, a.layout, devices)
  dispatch.validate_plan(bad, a.layout, [1, 2, 3])
  assert mesh_lib.local_rows(mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4])) is None  # one process


@pytest.mark.parametrize("dist", ["pretrain", "prolong"])
def test_a_process_builds_only_its_devices_plan(dist, monkeypatch):
  """build_dispatch(devices=D): D's rows and the rows others send D equal the whole plan's,
  every other row stays zero, the counts and offsets are the whole plan's, and it passes D's
  checks. The arrays are mapped as a large job's are (`format.sparse_zeros`), however small."""
  from distca_jax.dispatch import format as format_lib

  monkeypatch.setattr(format_lib, "_HUGE_PAGE", 0)
  n = 8
  batch, plan = global_plan(n, dist)
  assert (plan.tasks.server != plan.tasks.home).any()
  caps = Capacities(skv=plan.capacities.skv, ctask=plan.capacities.ctask)
  args = (plan.tasks, batch.layout, caps)
  whole = dispatch.build_dispatch(*args)
  req = plan.requirements  # capacities one short of what the plan needs: refused
  moved_q = int(pair_rows(plan.tasks, batch.layout)[0].max())
  for small in ({"skv": req.skv - 1}, {"ctask": req.ctask - 1}, {"c": moved_q - 1},
                {"send_q": req.send_q - 1}, {"recv_q": req.recv_q - 1},
                {"send_kv": req.send_kv - 1}, {"recv_kv": req.recv_kv - 1}):
    with pytest.raises(dispatch.PlanMismatchError, match="capacit"):
      dispatch.build_dispatch(*args[:2], dataclasses.replace(caps, **small))
  blocks = ("q.send_idx", "q.send_valid", "kv.send_idx", "kv.send_valid")
  for D in (np.array([0]), np.array([2, 5, 7]), np.arange(4, 8)):
    part = dispatch.build_dispatch(*args, devices=D)
    dispatch.validate_plan(part, batch.layout, D)
    others = np.setdiff1d(np.arange(n), D)
    for f, x in whole.arrays().items():
      y = part.arrays()[f]
      if f.endswith("_count") or f.endswith("_off"):
        np.testing.assert_array_equal(y, x, err_msg=f)
      elif f in blocks:  # packed send buffers: D's own, and the ranges others send D
        np.testing.assert_array_equal(y[D], x[D], err_msg=f)
        rnd = getattr(whole, f.split(".")[0])
        count, off = rnd.send_count, rnd.send_off
        for o in others:
          to_d = np.zeros(y.shape[-1], bool)
          for srv in D:
            to_d[off[o, srv]: off[o, srv] + count[o, srv]] = True
          np.testing.assert_array_equal(y[o][to_d], x[o][to_d], err_msg=f)
          assert not y[o][~to_d].any(), f
      else:
        np.testing.assert_array_equal(y[D], x[D], err_msg=f)
        assert not y[others].any(), f


def test_step_shapes_restore_a_checkpoint_s_sizes():
  """`StepShapes.sizes` is what a checkpoint keeps: restored, a run starts from those capacities
  (a step needing less gets them; one needing more grows them)."""
  saved = dispatch.StepShapes()
  grown = Capacities(c=256, ckv=512, skv=1024, ctask=16)
  saved.fit("cad@128", grown)
  restored = dispatch.StepShapes()
  restored.sizes.update(saved.sizes)
  small = Capacities(c=128, ckv=128, skv=512, ctask=8)
  assert restored.fit("cad@128", small) == grown and restored.growths == 1
  larger = dataclasses.replace(small, c=512, skv=2048)
  assert restored.fit("cad@128", larger) == dataclasses.replace(grown, c=512, skv=2048)


# ----------------------------------------------------------------------------- relayed K/V


def _relay_case(n=8, T=256, fanout=2, seed=8):
  """(layout, tasks, K/V requests with relays, without) of a `wide_prefix` batch (helpers)."""
  from distca_jax import gate as gate_lib
  from distca_jax.models.presets import resolve
  from distca_jax.schedule.plan import make_plan
  from distca_jax.schedule.traffic import kv_requests
  from distca_jax.schedule.relay import Relay

  cfg = small_config(f"mesh.data={n}", f"data.tokens_per_device={T}", "attention.impl=distca")
  layout = layout_batch("wide_prefix", n, seed=seed, T=T).layout
  plan = make_plan(layout, gate_lib.comm_model(resolve(cfg.model), cfg.attention), epsilon=0.05)
  return (layout, plan.tasks, kv_requests(plan.tasks, layout, Relay(fanout)),
          kv_requests(plan.tasks, layout))


@pytest.mark.parametrize("n,T,fanout", [(4, 512, 1), (8, 256, 2), (8, 512, 4)])
def test_relayed_plan_moves_the_same_rows_from_fewer_per_sender(n, T, fanout):
  """With relays every server receives the rows it did without (in two rounds), the busiest K/V
  sender sends fewer, the query side and the task tables are unchanged, the numpy specification
  computes exact attention, and relays off leave round 2 empty."""
  from helpers import simulate_dispatch

  layout, tasks, kv, direct = _relay_case(n, T, fanout)
  assert (kv.piece_via >= 0).any()
  off = dispatch.build_dispatch(tasks, layout, Capacities(), kv=direct)
  on = dispatch.build_dispatch(tasks, layout, Capacities(), kv=kv)
  assert off.kv2.send_idx.shape == (n, 0) and off.kv2.recv_rows == 0 and off.kv2.block == 0
  assert not any(a.any() for f, a in off.arrays().items() if f.startswith("kv2."))
  assert on.kv2.recv_rows > 0 and on.kv2.send_valid.sum() == on.kv2.send_count.sum() > 0
  for d in (off, on):
    dispatch.validate_plan(d, layout)
    assert simulate_dispatch(d, layout) < 1e-9
  for f, a in off.arrays().items():
    if "kv" not in f:
      np.testing.assert_array_equal(on.arrays()[f], a, err_msg=f)
  np.testing.assert_array_equal(on.kv_start, off.kv_start)
  got = on.kv.send_count.sum(0) + on.kv2.send_count.sum(0)  # rows each server receives
  np.testing.assert_array_equal(got, off.kv.send_count.sum(0))
  sent = lambda d: (d.kv.send_count.sum(1) + d.kv2.send_count.sum(1)).max()
  assert sent(on) < sent(off)
  part = dispatch.build_dispatch(tasks, layout, Capacities(), kv=kv, devices=np.array([1, 2]))
  dispatch.validate_plan(part, layout, np.array([1, 2]))


def test_relayed_plan_with_a_wrong_round_two_is_refused():
  """A round-2 send index that names another row of the relay, round-2 counts that do not
  describe its buffers, or a relay that never received the rows: refused."""
  layout, tasks, kv, _ = _relay_case()
  plan = dispatch.build_dispatch(tasks, layout, Capacities(), kv=kv)
  idx = plan.kv2.send_idx.copy()
  r, j = np.argwhere(plan.kv2.send_valid)[3]
  idx[r, j] = (idx[r, j] + 1) % (plan.kv_rows + plan.kv.recv_rows)
  with pytest.raises(dispatch.PlanMismatchError, match="one document"):
    dispatch.validate_plan(_with(plan, "kv2.send_idx", idx), layout)
  count = plan.kv2.send_count.copy()
  count[r, (r + 1) % layout.num_buffers] += 1
  with pytest.raises(dispatch.PlanMismatchError, match=r"kv2\.send_count"):
    dispatch.validate_plan(_with(plan, "kv2.send_count", count), layout)
  via = kv.piece_via.copy()
  relayed = np.flatnonzero(via >= 0)
  same = relayed[(kv.piece_src[relayed] == kv.piece_src[relayed[0]])
                 & (kv.piece_src_off[relayed] == kv.piece_src_off[relayed[0]])]
  assert same.size >= 2
  via[same[0]] = kv.pair_server[kv.piece_pair[same[1]]]  # a child: it gets the rows in round 2
  with pytest.raises(dispatch.PlanMismatchError, match="did not receive"):
    dispatch.build_dispatch(tasks, layout, Capacities(), kv=dataclasses.replace(kv, piece_via=via))


def test_relays_on_the_host_path():
  """attention.kv_relay_fanout: the step's plans carry the relayed capacities and traffic (the
  busiest device sends fewer K/V rows), its arrays a second round, and the gate's exchange
  bytes count round 2's blocks."""
  from distca_jax import gate as gate_lib
  from distca_jax.models.presets import resolve

  n = 8
  base = [f"mesh.data={n}", "data.tokens_per_device=256", "attention.impl=distca",
          "attention.pingpong=false", "attention.gate=false", "attention.exchange=tiled"]
  batch = layout_batch("wide_prefix", n, seed=n, T=256)
  shape = resolve(small_config(*base).model)
  off = dispatch.plan_step(small_config(*base).attention, batch, shape)
  cfg = small_config(*base, "attention.kv_relay_fanout=2")
  on = dispatch.plan_step(cfg.attention, batch, shape)
  assert off.capacities.recv_kv2 == 0 and on.capacities.recv_kv2 > 0
  assert on.dispatch[0].kv2.send_valid.any()
  assert on.plans[0].traffic.kv_rows_out.max() < off.plans[0].traffic.kv_rows_out.max()
  assert on.plans[0].requirements.recv_kv2 > 0
  d = on.dispatch[0]  # the rows the arrays send are the ones the planner's traffic counts
  np.testing.assert_array_equal(d.kv.send_count.sum(1) + d.kv2.send_count.sum(1),
                                on.plans[0].traffic.kv_rows_out)
  caps = on.capacities
  assert caps.ckv2 > 0
  plain = dataclasses.replace(caps, ckv2=0)
  with_round2 = gate_lib.exchange_bytes(cfg.attention, shape, on.plans, caps)
  assert (with_round2 > gate_lib.exchange_bytes(cfg.attention, shape, on.plans, plain)).any()


@pytest.mark.parametrize("exchange", ["tiled", "ragged"])
def test_relays_by_default_where_the_servers_span_nodes(exchange):
  """attention.kv_relay_fanout=auto (the default) relays with AUTO_FANOUT slices when the
  servers span more than one node and the transport carries only moving rows; on one node, or
  on tiled (whose second round pads every pair), the step is the direct exchange's."""
  from distca_jax.dispatch.host import relay_of
  from distca_jax.models.presets import resolve
  from distca_jax.schedule.relay import AUTO_FANOUT

  n = 8
  base = [f"mesh.data={n}", "data.tokens_per_device=256", "attention.impl=distca",
          "attention.pingpong=false", "attention.gate=false", f"attention.exchange={exchange}"]
  batch = layout_batch("wide_prefix", n, seed=n, T=256)
  shape = resolve(small_config(*base).model)
  assert small_config(*base).attention.kv_relay_fanout == "auto"
  plan = lambda *extra: dispatch.plan_step(small_config(*base, *extra).attention, batch, shape)
  one_node = plan(f"attention.data_rank_nodes=[{','.join(['0'] * n)}]")
  two_nodes = plan("attention.data_rank_nodes=[0,0,0,0,1,1,1,1]")
  assert one_node.capacities.recv_kv2 == plan().capacities.recv_kv2 == 0
  if exchange == "tiled":
    assert two_nodes.capacities.recv_kv2 == 0
  else:
    assert relay_of(small_config(*base, "attention.data_rank_nodes=[0,0,0,0,1,1,1,1]")
                    .attention).fanout == AUTO_FANOUT
    assert two_nodes.capacities.recv_kv2 > 0
    assert (two_nodes.plans[0].traffic.kv_rows_out.max()
            < one_node.plans[0].traffic.kv_rows_out.max())


@pytest.mark.parametrize("dist, n", [("pretrain", 8), ("prolong", 16)])
def test_a_process_plans_from_its_rows_alone(dist, n):
  """A process's step from the batch of its own buffers (`source.batch(step, rows)`) equals, on
  those rows, the step planned from the whole batch: the same plans, the same nano-batch rows
  (the ping-pong split reads the tokens it moves in from elsewhere), the same dispatch arrays;
  a batch that does not hold the checked rows, or whose rows hold other positions, is refused."""
  from distca_jax.models.presets import resolve

  cfg = small_config(f"mesh.data={n}", "data.tokens_per_device=1024", "attention.impl=distca",
                     f"data.distribution={dist}", "attention.gate=false",
                     "attention.min_imbalance=1")
  shape, source = resolve(cfg.model), synthetic_from_config(cfg.data, 512, n)
  rows = np.array([1, n // 2, n - 1])
  whole = dispatch.plan_step(cfg.attention, source.batch(0), shape, rows)
  mine = dispatch.plan_step(cfg.attention, source.batch(0, rows), shape, rows)
  assert whole.cad and mine.cad and len(mine.batches) == 2
  for a, b in zip(whole.batches, mine.batches):
    assert b.rows is not None and np.array_equal(b.rows, rows)
    for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids"):
      np.testing.assert_array_equal(getattr(b, k)[rows], getattr(a, k)[rows], err_msg=k)
  for a, b in zip(whole.dispatch, mine.dispatch):
    for f, x in a.arrays().items():
      np.testing.assert_array_equal(b.arrays()[f], x, err_msg=f)
  with pytest.raises(ValueError, match="does not hold the rows"):
    dispatch.plan_step(cfg.attention, source.batch(0, rows[:1]), shape, rows)
  ping = mine.batches[0]
  moved = dataclasses.replace(ping, positions=np.roll(ping.positions, 1, axis=1))
  with pytest.raises(dispatch.PlanMismatchError, match="rows hold other"):
    dispatch.validate_plan(mine.dispatch[0], ping.layout, rows, moved)


def test_the_step_plans_with_the_data_ranks_nodes():
  """`attention.data_rank_nodes` reaches the planner: each nano-batch's plan is `make_plan` with
  those nodes (which here differs from the flat plan), checked like any other; a layout of
  another size (a pipelined tick's) is planned as one node."""
  from distca_jax import gate as gate_lib
  from distca_jax.dispatch.host import planner_nodes
  from distca_jax.models.presets import resolve
  from distca_jax.schedule.plan import make_plan

  n, nodes = 16, tuple(i // 4 for i in range(16))
  cfg = small_config(f"mesh.data={n}", "data.tokens_per_device=2048", "attention.impl=distca",
                     "data.distribution=pretrain", "attention.gate=false",
                     "attention.min_imbalance=1", f"attention.data_rank_nodes={list(nodes)}")
  shape, source = resolve(cfg.model), synthetic_from_config(cfg.data, 512, n)
  comm = gate_lib.comm_model(shape, cfg.attention)
  differs = False
  for step in range(3):
    ctx = dispatch.plan_step(cfg.attention, source.batch(step), shape)
    assert ctx.cad
    for plan, b in zip(ctx.plans, ctx.batches):
      want = make_plan(b.layout, comm, cfg.attention.epsilon, nodes=nodes)
      flat = make_plan(b.layout, comm, cfg.attention.epsilon)
      assert np.array_equal(plan.tasks.server, want.tasks.server)
      differs |= plan.tasks.server.shape != flat.tasks.server.shape or not np.array_equal(
          plan.tasks.server, flat.tasks.server)
  assert differs
  assert planner_nodes(cfg.attention, ctx.batches[0].layout) == nodes
  tick = dataclasses.replace(ctx.batches[0].layout, num_buffers=2 * n)
  assert planner_nodes(cfg.attention, tick) is None
