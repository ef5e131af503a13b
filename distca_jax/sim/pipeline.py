"""Pipeline parallelism (4D) in the simulator: the paper's lock-step 1F1B, CAD over every stage.

docs/METHOD.md, "4D parallelism". GPUs = DP × PP × TP; rank r = stage · DP + replica is one
tensor-parallel group (stage-major, as Megatron orders its ranks), and every stage holds
layers / PP layers. Each DP replica runs M micro-batches of `tokens_per_rank` tokens per step.

Schedule (`lockstep_schedule`): the paper's modified 1F1B, in which every stage runs forward in
the same tick, or every stage runs backward. Forward tick t (0 ≤ t < M + PP − 1): stage s runs
micro-batch t − s when 0 ≤ t − s < M, otherwise it has nothing (warm-up and drain). Backward
tick t: stage s runs micro-batch t − (PP − 1 − s) (the last stage first, as gradients flow back).
Both directions hold the *same* micro-batches in tick t, only on mirrored stages; stages are
identical (same layers, same per-token cost) and with TP = one node every rank is its own node,
so forward tick t and backward tick t are costed together as one fwd + bwd tick of that set, per
rank as the 3D model does per layer (`engine.py`). The schedule's bubble fraction is the idle
(stage, tick) slots over all slots: (PP − 1) / (M + PP − 1) (`bubble_fraction`).

Per tick, time = layers / PP × max over the tick's ranks of (linear + attention + exposed
communication) per layer, lock-step: the slowest (replica, stage) sets it, so DP and PP
stragglers both show, and an idle stage adds nothing but waits. Step = Σ over ticks.

* Baselines (colocated, wlb, wlb_best, per_doc_cp): each active (replica, stage) runs its own
  micro-batch's stage exactly as one 3D rank. colocated and per_doc_cp pack / CP-split each
  micro-batch over the DP replicas of its stage, as the 3D model does for one batch. wlb packs
  the step's documents over all DP × M (replica, micro-batch) buffers at once, as WLB-LLM packs
  across micro-batches against pipeline stragglers (CP groups of cp replicas inside one
  micro-batch); wlb_best keeps the CP size with the best *step* time.
* CAD: the tick's Ping (and Pong) nano-batches of every active (replica, stage) are laid side by
  side as the buffers of one layout over all DP × PP ranks, idle stages as empty buffers, and the
  trainer's tick planner (`schedule.tick.plan_tick`: the real scheduler, the tick gate, one node
  per tick) balances their attention: idle stages serve attention only (the paper's "dummy"
  pass), linear work stays with its stage, and a warm-up or drain tick whose even spread would
  lengthen it is spread over fewer idle ranks. Streams per
  tick are the trainer's (`train/pipeline_host.py`): two plans with `pingpong` (Ping and Pong, each
  exchange hidden under the other's compute), one without (its exchange exposed whole: the
  tick's one core attention call per block waits for it); never the unpipelined step's
  single-stream fallback (`pingpong_allow_single`), which the pipeline does not take. Exposed
  communication and the ping-pong cut are charged as in the 3D model. The backward re-sends
  Q, K, V (`CommModel(resend=True)`, docs/METHOD.md, "Backward: keep or resend": the mode used
  with pipelines, where a micro-batch's forward and backward are ticks apart and servers keep no
  state).

Sampling: micro-batch k of step b holds `sampler.sample(DP · T, b · M + k)` packed over the DP
replicas, the 3D model's batch for one micro-batch; PP = 1 and M = 1 is therefore the 3D model
(tests/test_sim.py checks every number).

Not modelled beyond the 3D list: stage-to-stage activation sends (the same for every system),
memory of in-flight micro-batches, and the difference between max(fwd) + max(bwd) and
max(fwd + bwd) per tick pair (the 3D model makes the same approximation per layer).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from distca_jax.data.packing import Layout, pack
from distca_jax.schedule.baselines import colocated, per_document_cp, wlb_packing
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.items import initial_tasks
from distca_jax.schedule.pingpong import pingpong_layouts
from distca_jax.schedule.plan import make_plan
from distca_jax.schedule.tick import TickCosts, plan_tick
from distca_jax.schedule.traffic import traffic
from distca_jax.sim.config import SimConfig
from distca_jax.sim.engine import Point, Simulator, SystemResult


def make_simulator(cfg: SimConfig, point: Point) -> Simulator:
  """The 3D `Simulator` for one stage and one micro-batch, else the pipeline model. It lives here,
  above both models, so that the 3D model (`engine.py`) never imports the pipeline's."""
  if point.pipeline == 1 and cfg.microbatches_for(1) == 1:
    return Simulator(cfg, point)
  return PipelineSimulator(cfg, point)


def lockstep_schedule(pp: int, microbatches: int, backward: bool = False) -> list[list[tuple[int, int]]]:
  """Ticks of the lock-step 1F1B: per tick, the (stage, micro-batch) pairs that run, stage order.

  Forward: stage s runs micro-batch t − s in tick t; backward: t − (PP − 1 − s). M + PP − 1 ticks.
  """
  if pp < 1 or microbatches < 1:
    raise ValueError(f"lockstep_schedule: need pp >= 1 and microbatches >= 1, got {pp}, {microbatches}")
  lag = (lambda s: pp - 1 - s) if backward else (lambda s: s)
  return [[(s, t - lag(s)) for s in range(pp) if 0 <= t - lag(s) < microbatches]
          for t in range(microbatches + pp - 1)]


def bubble_fraction(pp: int, microbatches: int) -> float:
  """Idle (stage, tick) slots over all slots of the schedule: (PP − 1) / (M + PP − 1)."""
  ticks = lockstep_schedule(pp, microbatches)
  return 1.0 - sum(len(t) for t in ticks) / (pp * len(ticks))


def side_by_side(parts: list[Layout | None], num_buffers: int, buffer_len: int) -> tuple[Layout, list[int]]:
  """One layout of len(parts) × num_buffers buffers: part k in buffers k·num_buffers onwards,
  None = num_buffers empty buffers. Documents are renumbered in buffer order (part k's document j
  becomes base[k] + j). Returns (layout, base)."""
  names = ("buffer", "buffer_offset", "doc", "doc_offset", "length")
  cols = {k: [] for k in ("doc_lens",) + names}
  prior = {k: [] for k in names}  # ping-pong Pong halves: their prior shards, moved alike
  base, docs = [], 0
  for k, lay in enumerate(parts):
    base.append(docs)
    if lay is None:
      continue
    if lay.num_buffers != num_buffers or lay.buffer_len != buffer_len:
      raise ValueError(f"side_by_side: part {k} has {lay.num_buffers} buffers of {lay.buffer_len}, "
                       f"expected {num_buffers} of {buffer_len}")
    cols["doc_lens"].append(np.asarray(lay.doc_lens, np.int64))
    for src, out in ((lay, cols), (lay.prior, prior)):
      if src is None:
        continue
      out["buffer"].append(src.buffer + k * num_buffers)
      out["doc"].append(src.doc + docs)
      for name in ("buffer_offset", "doc_offset", "length"):
        out[name].append(getattr(src, name))
    docs += int(np.asarray(lay.doc_lens).size)
  cat = lambda c: {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in c.items()}
  cols = cat(cols)
  shape = dict(num_buffers=num_buffers * len(parts), buffer_len=buffer_len)
  has_prior = any(lay is not None and lay.prior is not None for lay in parts)
  return Layout(**shape, **cols, prior=Layout(**shape, doc_lens=cols["doc_lens"], **cat(prior))
                if has_prior else None), base


@dataclasses.dataclass
class _MicroBatch:
  """One micro-batch's per-replica work, ready for any stage."""

  lens: np.ndarray
  col: object  # SystemLoad
  col_pair_bytes: np.ndarray
  pdc: object  # SystemLoad
  halves: tuple  # CAD nano-batch layouts (Ping, Pong) or (whole,)


class PipelineSimulator(Simulator):
  """`Simulator` with PP stages and M micro-batches; `batch(step)` returns the same structure."""

  def __init__(self, cfg: SimConfig, point: Point):
    super().__init__(cfg, point)
    self.pp = point.pipeline
    self.dp = self.ranks // self.pp
    self.microbatches = cfg.microbatches_for(self.pp)
    self.schedule = lockstep_schedule(self.pp, self.microbatches)
    self.bubble = bubble_fraction(self.pp, self.microbatches)
    self.cad_comm = (CommModel.for_model(self.shape, cfg.tensor_parallel, resend=True)
                     if self.pp > 1 else self.comm)
    self.stage_node = [self.node[s * self.dp:(s + 1) * self.dp] for s in range(self.pp)]

  def _cp_sizes(self):
    # CP groups live inside one stage's DP replicas.
    sizes = [c for c in self.cfg.cp_sizes if c > 0]
    if not sizes:
      sizes = [c for c in (1, 2, 4, 8, 16, 32) if c <= self.dp]
    return sorted({c for c in sizes if self.dp % c == 0} | {1})

  # -------------------------------------------------------------------------- micro-batches

  def _micro_batch(self, step: int, k: int) -> _MicroBatch:
    cfg, dp, t = self.cfg, self.dp, self.t
    lens = self.sampler.sample(dp * t, step * self.microbatches + k)
    layout = pack(lens, dp, t)
    col = colocated(layout, self.comm, kernel=self.kernel)
    trc = traffic(initial_tasks(layout), layout, self.comm, pairwise=True)
    pdc = per_document_cp(lens, dp, t, self.comm, kernel=self.kernel)
    if cfg.pingpong:
      halves = pingpong_layouts(lens, dp, t)[:2]
    else:
      halves = (layout,)
    return _MicroBatch(lens, col, trc.pair_bytes, pdc, halves)

  def _wlb_step(self, mbs) -> dict:
    """cp -> per micro-batch SystemLoad [DP] of WLB packing over all DP × M buffers of the step."""
    cfg, dp, t = self.cfg, self.dp, self.t
    lens = np.concatenate([mb.lens for mb in mbs])
    out = {}
    for cp in self._cp_sizes():
      load = wlb_packing(lens, dp * len(mbs), t, self.comm, cp=cp, token_cap=cfg.wlb_token_cap,
                         kernel=self.kernel, cost=self.wlb_cost)
      cut = lambda x, k: x[k * dp:(k + 1) * dp]
      out[cp] = [dataclasses.replace(load, **{f: cut(getattr(load, f), k) for f in
                                              ("area", "tokens", "send", "recv", "attn_ms")})
                 for k in range(len(mbs))]
    return out

  # -------------------------------------------------------------------------- one tick

  def _busy(self, tokens, attn_ms) -> float:
    """Σ over ranks of compute ms per layer."""
    return float((tokens * self.lin_ms_per_token + attn_ms).sum())

  def _baseline_tick(self, pairs, mbs, wlb):
    """{system or ("wlb", cp): (SystemResult, busy)} of the baselines in one tick."""
    cfg = self.cfg
    cat = lambda xs: np.concatenate(xs)
    col = [mbs[m].col for _, m in pairs]
    comm_ms = cat([self._comm_ms_pairwise(mbs[m].col_pair_bytes, self.stage_node[s]) for s, m in pairs])
    area, tokens, attn = cat([c.area for c in col]), cat([c.tokens for c in col]), cat([c.attn_ms for c in col])
    out = {"colocated": (self._result("colocated", col[0], comm_ms, cfg.cp_overlap, area, tokens, attn,
                                      cat([np.maximum(c.send, c.recv) for c in col])),
                         self._busy(tokens, attn))}

    def joined(loads):
      j = dataclasses.replace(loads[0], **{f: cat([getattr(x, f) for x in loads])
                                           for f in ("area", "tokens", "send", "recv", "attn_ms")})
      return j, self._busy(j.tokens, j.attn_ms)

    for cp in self._cp_sizes():
      load, busy = joined([wlb[cp][m] for _, m in pairs])
      out[("wlb", cp)] = (self._baseline(load, 0.0 if load.cp == 1 else cfg.cp_overlap), busy)
    load, busy = joined([mbs[m].pdc for _, m in pairs])
    out["per_doc_cp"] = (self._baseline(load, cfg.cp_overlap, "per_doc_cp"), busy)
    return out

  def _plan_tick(self, lays: list[Layout], comm: CommModel):
    """The plans of a tick's streams as the trainer makes them (`schedule.tick.plan_tick`: the
    idle stages' share limited where the exchange would lengthen the tick, a tick as one node,
    the tick gate); one stage is no pipeline: its micro-batches are planned as 3D batches."""
    cfg = self.cfg
    if self.pp == 1:
      return [make_plan(lay, comm, cfg.epsilon, min_imbalance=cfg.min_imbalance_for(pipelined=False),
                        nodes=self.node[:lay.num_buffers]) for lay in lays]
    tasks = [initial_tasks(lay, validate=False) for lay in lays]
    area = sum(float(t.area().sum()) for t in tasks)
    attn_ms = sum(float(self.kernel.fwdbwd_ms(t.q_len, t.kv_len).sum()) for t in tasks)
    costs = TickCosts(linear_per_token=self.lin_ms_per_token,
                      attention_per_area=attn_ms / area if area > 0 else 0.0,
                      # Every byte at the network's rate: at TP 8 every rank is its own node.
                      per_byte=1.0 / (cfg.hardware.network_gbps * 1e6))
    # The relay changes no placement, only the bytes the rule weighs, as the trainer's plans do.
    return plan_tick(lays, comm, costs, epsilon=cfg.epsilon,
                     min_imbalance=cfg.min_imbalance_for(pipelined=True), relay=self.relay)

  def _cad_tick(self, step: int, tick: int, pairs, mbs, dump_dir: Path | None):
    """(SystemResult, busy, area_after) of CAD in one tick: every active stage's nano-batches
    balanced over all DP × PP ranks."""
    cfg, n, dp, comm = self.cfg, self.ranks, self.dp, self.cad_comm
    active = np.zeros(n, bool)
    for s, _ in pairs:
      active[s * dp:(s + 1) * dp] = True
    per, shards = [], 0
    nh = len(mbs[pairs[0][1]].halves)
    lays = []
    for h in range(nh):
      parts = [None] * self.pp
      for s, m in pairs:
        parts[s] = mbs[m].halves[h]
      lays.append(side_by_side(parts, dp, mbs[pairs[0][1]].halves[h].buffer_len)[0])
    for h, (lay, plan) in enumerate(zip(lays, self._plan_tick(lays, comm))):
      tasks = plan.tasks
      attn = np.bincount(tasks.server, weights=self.kernel.fwdbwd_ms(tasks.q_len, tasks.kv_len),
                         minlength=n)
      tok = np.bincount(lay.buffer, weights=lay.length, minlength=n).astype(np.float64)
      per.append((plan, attn, tok, *self._cad_exchange(tasks, lay, comm)))
      remote = tasks.server != tasks.home
      shards = max(shards, int(np.bincount(tasks.server[remote], minlength=n).max(initial=0)))
      if dump_dir is not None:
        p = self.point
        tag = ("_ping", "_pong")[h] if cfg.pingpong else ""
        plan.dump_json(dump_dir / f"{p.model}_{p.gpus}g_pp{self.pp}_{p.tokens_per_rank}_"
                                  f"{Path(p.distribution).stem}_b{step}_t{tick}{tag}.json")
    area_after = sum(x[0].stats.load_after for x in per)
    attn_ms = sum(x[1] for x in per)
    # One stream a tick (`pingpong=false`) has nothing independent to hide its exchange under:
    # the trainer's tick runs one core attention call per block, which waits for its dispatch.
    # (One stage is no pipeline: its micro-batches are unpipelined steps, priced as 3D.)
    exposed_whole = nh == 1 and self.pp > 1
    res = self._cad_result(dataclasses.replace(cfg, pingpong_overlap=0.0) if exposed_whole else cfg,
                           per, area_after, attn_ms, shards)
    tokens = sum(x[2] for x in per)
    if not active.all():  # memory is held by the active stages only
      res = dataclasses.replace(res, memory_imbalance=float(tokens[active].max() / tokens[active].mean()))
    return res, self._busy(tokens, attn_ms), area_after

  # -------------------------------------------------------------------------- one step

  def ticks(self, step: int, dump_dir: Path | None = None):
    """Per forward tick: {system: SystemResult} (wlb at every CP size as ("wlb", cp)), each with
    iter_s = that tick's fwd + bwd time in seconds (layers / PP layers); plus per tick the busy
    ms per layer and CAD's area per rank, and the colocated area per rank."""
    mbs = [self._micro_batch(step, k) for k in range(self.microbatches)]
    wlb = self._wlb_step(mbs)
    out = []
    for tick, pairs in enumerate(self.schedule):
      res = self._baseline_tick(pairs, mbs, wlb)
      res["cad"] = self._cad_tick(step, tick, pairs, mbs, dump_dir)
      before = np.zeros(self.ranks)
      for s, m in pairs:
        before[s * self.dp:(s + 1) * self.dp] = mbs[m].col.area
      scaled = {k: (dataclasses.replace(r, iter_s=r.iter_s / self.pp), busy)
                for k, (r, busy, *_) in res.items()}
      out.append({"results": scaled, "after": res["cad"][2], "before": before, "pairs": pairs})
    return out

  def _step_result(self, name: str, ticks) -> SystemResult:
    """A step from its ticks: times add up, imbalances are averaged, maxima kept."""
    rs = [r for r, _ in ticks]
    per_layer_max = sum(r.iter_s * 1e3 / (self.shape.layers / self.pp) for r in rs)
    busy = sum(b for _, b in ticks)
    return SystemResult(
        name=name, cp=rs[0].cp,
        compute_imbalance=float(np.mean([r.compute_imbalance for r in rs])),
        memory_imbalance=float(np.mean([r.memory_imbalance for r in rs])),
        total_compute_imbalance=float(np.mean([r.total_compute_imbalance for r in rs])),
        bytes_per_layer=max(r.bytes_per_layer for r in rs), comm_ms=max(r.comm_ms for r in rs),
        compute_ms=max(r.compute_ms for r in rs), hidden=float(np.mean([r.hidden for r in rs])),
        iter_s=sum(r.iter_s for r in rs), shards_max=max(r.shards_max for r in rs),
        idle_frac=1.0 - busy / (self.ranks * per_layer_max) if per_layer_max > 0 else 0.0)

  def batch(self, step: int, dump_dir: Path | None = None):
    """Returns ({system: SystemResult} of the whole step, {"before", "after"}: per-rank attention
    area of the first tick with the most active stages, colocated and CAD)."""
    ticks = self.ticks(step, dump_dir)
    per = lambda key: [t["results"][key] for t in ticks]
    out = {"cad": self._step_result("cad", per("cad"))}
    out["colocated"] = self._step_result("colocated", per("colocated"))
    sweep = {cp: self._step_result("wlb", per(("wlb", cp))) for cp in self._cp_sizes()}
    out["wlb"] = sweep[1]
    out["wlb_best"] = dataclasses.replace(min(sweep.values(), key=lambda r: r.iter_s), name="wlb_best")
    out["per_doc_cp"] = self._step_result("per_doc_cp", per("per_doc_cp"))
    full = max(ticks, key=lambda t: len(t["pairs"]))
    return out, {"before": full["before"], "after": full["after"]}
