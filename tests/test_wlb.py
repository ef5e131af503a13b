"""The WLB-LLM-style baseline: its packing (the trainer's and the simulator's one code), and the
trainer's re-packed steps against a single-device run of the same documents."""

import jax
import numpy as np
import pytest

from distca_jax import mesh as mesh_lib
from distca_jax import wlb_attention
from distca_jax.data.packing import pack
from distca_jax.data.sources import make_batch
from distca_jax.models.presets import resolve
from distca_jax.schedule import wlb
from distca_jax.schedule.cost import range_area
from distca_jax.schedule.items import validate_layout
from distca_jax.train.step import Trainer
from helpers import pure_params, reference_value_and_grad, small_config, tree_rel_err


def _lens(rng, n, t, long_docs=1):
  """Random lengths filling n * t tokens: `long_docs` documents longer than a rank's share."""
  out = list(rng.integers(t + 1, min(2 * t, n * t // max(long_docs, 1)) + 1, long_docs))
  while sum(out) < n * t:
    out.append(int(rng.integers(1, t // 2)))
  out[-1] -= sum(out) - n * t
  out = [x for x in out if x > 0]
  rng.shuffle(out)
  return np.asarray(out, np.int64)


# ------------------------------------------------------------------------------ packing


@pytest.mark.parametrize("n,cp,cap", [(4, 1, 1.5), (8, 2, 1.5), (8, 4, 1.25), (16, 16, 1.5),
                                      (8, 1, 1.0), (6, 3, 1.5)])
def test_packing_conserves_documents_and_respects_the_cap(n, cp, cap):
  rng = np.random.default_rng(n * 10 + cp)
  t = 1024
  for seed in range(4):
    lens = _lens(np.random.default_rng(seed), n, t, long_docs=seed % 3)
    p = wlb.wlb_pack(lens, n, t, cp=cp, token_cap=cap, token_weight=float(rng.uniform(0, 2000)))
    validate_layout(p.layout)  # every document position exactly once, shards inside buffers
    assert p.layout.buffer_len == wlb.wlb_buffer_len(t, cap) >= cap * t
    assert p.tokens.max() <= p.layout.buffer_len
    assert p.tokens.sum() == lens.sum()
    assert np.isclose(p.area.sum(), range_area(0, lens).sum())
    assert p.cp >= cp and n % p.cp == 0 and (p.cp == cp) == ("cp=" not in p.repacked and
                                                               p.repacked != "in-order")
    # A document's shards stay inside one group of p.cp consecutive ranks.
    group = p.layout.buffer // p.cp
    first = np.full(lens.size, -1)
    first[p.layout.doc] = group
    assert (group == first[p.layout.doc]).all()


def test_head_tail_chunks_balance_causal_cost():
  L, cp = 8000, 4
  chunks = wlb.cp_chunks(L, cp)
  assert sorted(x for c in chunks for x in c) == [(j * L // 8, (j + 1) * L // 8) for j in range(8)]
  areas = [sum(range_area(lo, hi) for lo, hi in c) for c in chunks]
  assert max(areas) / min(areas) < 1.001
  assert chunks[0] == [(0, 1000), (7000, 8000)]


def test_wlb_balances_what_in_order_packing_cannot():
  # One long document over ranks 0-1 in order (imbalance 5); WLB splits it head+tail over a
  # group (cp=2: that group still holds 2/3 of the work; cp=8: balanced).
  n, t = 8, 4096
  lens = np.array([2 * t] + [512] * (6 * t // 512))
  before = wlb.WlbPacking(pack(lens, n, t), n, n).area
  assert before.max() / before.mean() > 5
  p2, p8 = (wlb.wlb_pack(lens, n, t, cp=cp, token_cap=1.5) for cp in (2, 8))
  assert p2.exchanging_groups().tolist() == [True, False, False, False] and p2.repacked == ""
  assert p2.area.max() == pytest.approx(range_area(0, 2 * t) / 2, rel=1e-3)
  assert p8.area.max() / p8.area.mean() < 1.1


def test_too_tight_a_cap_repacks_never_truncates():
  # Cap 1.0: every rank exactly full, which the workload greedy rarely finds; a larger group or
  # the in-order layout takes over, all tokens kept.
  n, t = 4, 1024
  lens = np.array([1500, 1500, 700, 300, 96])
  p = wlb.wlb_pack(lens, n, t, cp=1, token_cap=1.0)
  assert p.repacked and p.tokens.sum() == lens.sum() and p.tokens.max() <= t
  validate_layout(p.layout)
  with pytest.raises(ValueError, match="exceed"):
    wlb.wlb_pack([5000], n, t, cp=1)


def test_packing_is_deterministic():
  lens = _lens(np.random.default_rng(3), 8, 2048, long_docs=2)
  cost = wlb_attention.wlb_cost(resolve(small_config().model), 1)
  a = wlb.best_packing(lens, 8, 2048, cost)
  b = wlb.best_packing(lens.copy(), 8, 2048, cost)
  for f in ("buffer", "buffer_offset", "doc", "doc_offset", "length"):
    assert np.array_equal(getattr(a.layout, f), getattr(b.layout, f))
  assert a.cp == b.cp


def test_auto_takes_the_size_the_cost_model_prices_fastest():
  from distca_jax.models.presets import PRESETS

  cost = wlb.wlb_cost_for_model(PRESETS["llama3_8b"], 8, linear_tflops=450, attention_tflops=300,
                                nvlink_gbps=200, network_gbps=50, gpus_per_node=8, cp_overlap=0.5)
  n, t = 16, 65536
  lens = _lens(np.random.default_rng(0), n, t, long_docs=3)
  best = wlb.best_packing(lens, n, t, cost)
  for cp in wlb.cp_sizes(n):
    assert cost.step_ms(best) <= cost.step_ms(wlb.wlb_pack(lens, n, t, cp=cp,
                                                           token_weight=cost.token_weight))


def test_simulator_prices_the_same_packing():
  """The simulator's wlb rows are `wlb_pack`'s packings at its price (`WlbCost`)."""
  from distca_jax.schedule.baselines import wlb_packing
  from distca_jax.sim.config import load_sim_config
  from distca_jax.sim.engine import Point, Simulator

  cfg = load_sim_config(None, ["gpus=[64]", "tokens_per_rank=[65536]"])
  sim = Simulator(cfg, Point("llama3_8b", 64, 65536, "pretrain"))
  h, cost = cfg.hardware, sim.wlb_cost
  # The trainer's price (`wlb_cost_for_model`, what data.wlb_cp=auto minimises) is the sim's.
  assert cost == wlb.wlb_cost_for_model(
      sim.shape, cfg.tensor_parallel, linear_tflops=h.linear_tflops,
      attention_tflops=h.attention_tflops, nvlink_gbps=h.nvlink_gbps, network_gbps=h.network_gbps,
      gpus_per_node=h.gpus_per_node, cp_overlap=cfg.cp_overlap, kernel=sim.kernel)
  results, _ = sim.batch(0)
  lens = sim.sampler.sample(sim.ranks * sim.t, 0)
  times = {}
  for cp in sim._cp_sizes():
    p = wlb.adaptive_pack(lens, sim.ranks, sim.t, cost, cp=cp, token_cap=cfg.wlb_token_cap)
    load = wlb_packing(lens, sim.ranks, sim.t, sim.comm, cp=cp, token_cap=cfg.wlb_token_cap,
                       kernel=sim.kernel, cost=cost)
    assert np.array_equal(load.area, p.area) and np.array_equal(load.tokens, p.tokens)
    times[cp] = cost.step_ms(p) * sim.shape.layers / 1e3
  assert results["wlb"].iter_s == pytest.approx(times[1], rel=1e-9)
  assert results["wlb_best"].iter_s == pytest.approx(min(times.values()), rel=1e-9)
  best = wlb.best_packing(lens, sim.ranks, sim.t, cost, token_cap=cfg.wlb_token_cap,
                          sizes=sim._cp_sizes())
  assert results["wlb_best"].cp == best.cp


# ------------------------------------------------------------------------------ training


def _trainer_loss_and_grads(cfg, batch, packing):
  devices = jax.devices()[: cfg.mesh.data * cfg.mesh.tensor]
  trainer = Trainer(cfg, mesh_lib.make_mesh(cfg.mesh, devices))
  state = trainer.init_state(0)
  wb = wlb_attention.repack_batch(batch, packing.layout)
  arrays, ctx = trainer.put_batch(wb, wlb_attention.wlb_context(packing))
  (loss, _), grads = jax.jit(jax.value_and_grad(trainer.loss_fn, has_aux=True))(
      state.params, arrays, ctx)
  return float(loss), pure_params(grads), pure_params(state.params), trainer.shape


@pytest.mark.parametrize("n,cp,tensor,long_docs,cap", [
    (2, 1, 1, 0, 1.5),   # whole documents only: no exchange
    (2, 2, 1, 1, 1.5),   # one document head+tail over both ranks
    (4, 2, 1, 2, 1.5),   # two CP groups
    (4, 4, 2, 1, 1.25),  # heads split over tensor as well
    (8, 8, 1, 3, 1.5),
    (4, 1, 1, 1, 1.0),   # cannot fit: re-packed (a larger group or the in-order layout)
])
def test_wlb_step_matches_single_device(n, cp, tensor, long_docs, cap):
  t = 128
  cfg = small_config(f"mesh.data={n}", f"mesh.tensor={tensor}", f"data.tokens_per_device={t}",
                     "model.layers=1", "data.packing=wlb", f"data.wlb_cp={cp}",
                     f"data.wlb_token_cap={cap}")
  rng = np.random.default_rng(100 * n + 10 * cp + long_docs)
  lens = _lens(rng, n, t, long_docs)
  batch = make_batch(lens, rng.integers(0, 512, int(lens.sum())).astype(np.int32), n, t)
  packing = wlb.wlb_pack(lens, n, t, cp=cp, token_cap=cap, token_weight=float(rng.uniform(0, 64)))
  if long_docs and cp > 1:
    assert packing.exchanging_groups().any()  # the case exercises the K/V all-gather
  loss, grads, params, shape = _trainer_loss_and_grads(cfg, batch, packing)
  ref_loss, ref_grads = reference_value_and_grad(params, shape, batch)  # in order, one device
  assert abs(loss - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
  assert tree_rel_err(grads, ref_grads) < 1e-5


def test_in_order_fallback_matches_single_device():
  """The last re-packing, the in-order layout in cap-length buffers: a document spanning three
  ranks reads its prefix from both earlier ones through the group's gather."""
  import dataclasses

  n, t = 4, 128
  lens = np.array([2 * t + 60, 100, 40, 50, 6])  # 512 tokens; the first spans ranks 0-2
  cap = wlb.wlb_buffer_len(t, 1.25)
  p = wlb.WlbPacking(dataclasses.replace(pack(lens, n, t), buffer_len=cap), n, 1, "in-order")
  assert p.exchanging_groups().all() and p.layout.buffer_len == 256
  cfg = small_config(f"mesh.data={n}", f"data.tokens_per_device={t}", "model.layers=1",
                     "data.packing=wlb", "data.wlb_cp=4")
  rng = np.random.default_rng(7)
  batch = make_batch(lens, rng.integers(0, 512, int(lens.sum())).astype(np.int32), n, t)
  loss, grads, params, shape = _trainer_loss_and_grads(cfg, batch, p)
  ref_loss, ref_grads = reference_value_and_grad(params, shape, batch)
  assert abs(loss - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
  assert tree_rel_err(grads, ref_grads) < 1e-5


def test_wlb_run_resumes_exactly_and_reports_its_packing(tmp_path):
  """Packing is a function of the step's documents, so a resumed run trains on the same packed
  batches: its losses equal the uninterrupted run's. The summary names the packing."""
  from distca_jax.train import loop
  from distca_jax.train.summary import format_summary

  def config(out, *overrides):
    return small_config("model.layers=1", "model.hidden=64", "model.ffn=128",
                        "model.vocab_size=256", "data.length_scale=8", "data.seed=1",
                        "data.packing=wlb", "data.wlb_cp=2", "train.steps=4",
                        "checkpoint.every=2", f"train.out_dir={out}", *overrides)

  devices = jax.devices()[:4]
  quiet = lambda *a: None
  straight = loop.run(config(tmp_path / "straight"), devices=devices, log=quiet)
  loop.run(config(tmp_path / "half", "train.stop_at_step=2"), devices=devices, log=quiet)
  resumed = loop.run(config(tmp_path / "half"), devices=devices, log=quiet)
  assert resumed.start_step == 2 and resumed.losses == straight.losses[2:]
  assert straight.packing == "wlb" and straight.token_imbalance >= 1.0
  # CP groups of 2, none (1: no document split), or 4 where a document did not fit a pair's cap.
  assert sum(straight.wlb_cp_steps.values()) == 4 and set(straight.wlb_cp_steps) <= {1, 2, 4}
  assert "packing wlb" in format_summary(straight)


def test_static_price_counts_every_buffer_row():
  """The trainer's price: every rank computes its whole buffer (padding too), so the linear
  part is the same on every rank; the variable-length price counts real tokens."""
  import dataclasses

  from distca_jax.models.presets import PRESETS

  var = wlb.wlb_cost_for_model(PRESETS["llama3_8b"], 8, linear_tflops=450, attention_tflops=300,
                               nvlink_gbps=200, network_gbps=50, gpus_per_node=8, cp_overlap=0.5)
  static = dataclasses.replace(var, static=True)
  n, t = 8, 65536
  lens = _lens(np.random.default_rng(5), n, t, long_docs=2)
  p = wlb.wlb_pack(lens, n, t, cp=2, token_cap=1.25)
  attn = static.attn_ms(p)
  assert np.allclose(var.rank_ms(p) - static.rank_ms(p),
                     (p.tokens - p.layout.buffer_len) * var.lin_ms_per_token
                     - 0.5 * (np.minimum(var.comm_ms(p), p.tokens * var.lin_ms_per_token + attn)
                              - np.minimum(static.comm_ms(p),
                                           p.layout.buffer_len * var.lin_ms_per_token + attn)))
  # Under static shapes a tighter cap wastes fewer rows: the auto choice at 1.03125 beats 1.5.
  tight, loose = (wlb.best_packing(lens, n, t, static, token_cap=c) for c in (1.03125, 1.5))
  assert static.step_ms(tight) < static.step_ms(loose)


@pytest.mark.parametrize("dist, rows", [("pretrain", [1, 2]), ("prolong", [0, 5, 7])])
def test_a_process_re_packs_only_its_rows(dist, rows):
  """`repack_batch` of a batch holding some rows only (one process's, tokens of the others from
  its stream) fills exactly the asked rows of the new layout, as the whole batch's re-packing
  does; the others stay zero. A batch not packed in document order is refused. `wlb_context`
  for those rows fills their gather index as the whole one does."""
  from distca_jax.data.sources import synthetic_from_config

  n, t = 8, 1024
  cfg = small_config(f"mesh.data={n}", f"data.tokens_per_device={t}", f"data.distribution={dist}")
  source = synthetic_from_config(cfg.data, 512, n)
  whole = source.batch(3)
  packing = wlb.wlb_pack(whole.layout.doc_lens, n, t, cp=4, token_cap=1.5)
  want = wlb_attention.repack_batch(whole, packing.layout)
  got = wlb_attention.repack_batch(source.batch(3, rows), packing.layout, rows)
  others = np.setdiff1d(np.arange(n), rows)
  assert np.array_equal(got.rows, rows)
  for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids"):
    np.testing.assert_array_equal(getattr(got, k)[rows], getattr(want, k)[rows], err_msg=k)
  assert not got.tokens[others].any() and not got.loss_mask[others].any()
  # The tokens really moved: some of the asked rows' tokens sat in other rows before.
  assert not np.array_equal(want.tokens[rows], whole.tokens[rows])
  with pytest.raises(ValueError, match="not packed in document order"):
    wlb_attention.repack_batch(want, packing.layout)
  # Its context: the same shapes and task tables, the gather index of its ranks only.
  full, part = wlb_attention.wlb_context(packing), wlb_attention.wlb_context(packing, rows=rows)
  assert (part.group, part.window) == (full.group, full.window) and full.window > 0
  for k in ("q_start", "q_len", "kv_start", "kv_len"):
    np.testing.assert_array_equal(getattr(part, k), getattr(full, k), err_msg=k)
  np.testing.assert_array_equal(part.kv_index[rows], full.kv_index[rows])
  assert not part.kv_index[others].any() and full.kv_index[others].any()
