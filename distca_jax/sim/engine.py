"""The at-scale simulator: CAD against its baselines on sampled batches, predicted step time.

Model of one training step of a 3D-parallel job (DP × TP, no pipeline), per DP rank (one
tensor-parallel group of `tensor_parallel` GPUs holding `tokens_per_rank` tokens), per layer:

* linear time  = tokens × (matmul FLOPs per token per layer) × 3 (fwd+bwd) / (TP × linear TFLOP/s)
* attention    = Σ over the rank's tasks of the kernel's fwd+bwd time (`cost.AnalyticKernel`:
                 FLOPs at `attention_tflops` with 128-row tiles, or a profiled `cost.TimeTable`),
                 for the rank's share of heads (heads / TP)
* communication = per-GPU bytes (CommModel for heads / TP; backward included) on CAD's transport
                 (`exchange`: what each (rank, server) pair carries, `sim/transport.py`) over
                 NVLink for partners in the same node, over the network (50 GB/s per GPU)
                 otherwise; the two links run in parallel. Relayed K/V (`kv_relay_fanout`) is a
                 second round after the first: the two rounds' times add.
* exposed communication: CAD splits the micro-batch into Ping and Pong (`schedule/pingpong.py`),
  plans each, and overlaps each nano-batch's dispatch with the other's compute:
  `exposed = Σ_i max(comm_i − pingpong_overlap · compute_other(i), (1 − pingpong_overlap) · comm_i)`
  (`pingpong=false`: one plan, `exposed = comm − pingpong_overlap · min(comm, compute)`); the
  baselines' context-parallel KV all-gather is hidden by the fraction `cp_overlap`.
* step time = layers × max over ranks (compute + exposed communication): every layer's
  all-to-all (CAD) or the step's gradient all-reduce (baselines) waits for the slowest rank.

With pipeline parallelism (4D, `pipeline_parallel` > 1; `distca_jax/sim/pipeline.py`): GPUs =
DP × PP × TP, each stage holds layers / PP layers, and each DP replica runs M micro-batches
(`microbatches`) of `tokens_per_rank` tokens per step through the paper's lock-step 1F1B: every
stage runs forward in the same tick, or every stage runs backward, so a step is M + PP − 1
forward ticks and M + PP − 1 backward ticks; in tick t stage s holds micro-batch t − s (forward)
or t − (PP − 1 − s) (backward), so forward tick t and backward tick t hold the same micro-batches
and are costed together, fwd + bwd per rank as above. A tick lasts layers / PP × the slowest
rank of the tick (lock-step: DP and PP stragglers both show); idle stages in warm-up and drain
compute nothing. Baselines: each (replica, stage) runs its own micro-batch's stage, costed as
one 3D rank. CAD: the attention of every active (replica, stage) of the tick is balanced by the
real scheduler over all DP × PP ranks (the tick's micro-batches laid side by side as buffers,
idle stages as empty buffers that only serve attention), linear work stays with its stage, and
the backward re-sends Q, K, V (docs/METHOD.md, "Backward: keep or resend": resend, used with pipelines). Step =
Σ over ticks. The schedule's bubble fraction is (PP − 1) / (M + PP − 1). PP = 1 with one
micro-batch is exactly the 3D model above (a test checks it).

Not modelled (the same for every system, so they only dilute speedups): embedding and LM head
beyond their FLOPs, the gradient all-reduce, the optimizer, TP collectives, the pipeline's
stage-to-stage activation sends, and the smaller-matmul efficiency loss of ping-pong.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np

from distca_jax.data.doclens import LengthSampler, load_lengths
from distca_jax.data.packing import pack
from distca_jax.models.presets import PRESETS
from distca_jax.schedule.baselines import SystemLoad, colocated, per_document_cp, wlb_packing
from distca_jax.schedule.cost import AnalyticKernel, CommModel, TimeTable
from distca_jax.schedule.items import initial_tasks
from distca_jax.schedule.pingpong import pingpong_layouts
from distca_jax.schedule.plan import make_plan
from distca_jax.schedule.wlb import WlbCost
from distca_jax.schedule.traffic import traffic
from distca_jax.schedule.transport import choose, relay_for
from distca_jax.sim.config import SimConfig
from distca_jax.sim.transport import exchange_rounds

SYSTEMS = ("cad", "colocated", "wlb", "wlb_best", "per_doc_cp")


@dataclasses.dataclass(frozen=True)
class SystemResult:
  """One system on one batch. Times in ms per layer unless named otherwise."""

  name: str
  cp: int
  compute_imbalance: float  # max / mean attention area over ranks
  memory_imbalance: float  # max / mean tokens over ranks
  total_compute_imbalance: float  # max / mean of (linear + attention) time
  bytes_per_layer: float  # max over ranks of per-GPU bytes sent or received per layer
  comm_ms: float  # max over ranks
  compute_ms: float  # max over ranks
  # Share of the step's ticks whose communication hid under compute on every rank (3D: the
  # batch is one tick, so 0 or 1).
  hidden: float
  iter_s: float  # predicted step time, seconds
  shards_max: int = 0  # CAD: most remote CA-tasks one server computes per nano-batch
  # Fraction of GPU time in the step not spent computing (waiting for the slowest rank, exposed
  # communication, pipeline bubbles).
  idle_frac: float = 0.0


@dataclasses.dataclass
class Point:
  model: str
  gpus: int
  tokens_per_rank: int
  distribution: str
  pipeline: int = 1  # pipeline stages (PP)


def points(cfg: SimConfig) -> list[Point]:
  """The sweep's points in order: per sub-sweep, the product of models, gpus, tokens_per_rank,
  distributions and pipeline_parallel (duplicates across sub-sweeps dropped)."""
  out = []
  for axes in cfg.sweep_axes():
    for m, g, t, d, pp in itertools.product(axes["models"], axes["gpus"], axes["tokens_per_rank"],
                                            axes["distributions"], axes["pipeline_parallel"]):
      if Point(m, g, t, d, pp) not in out:
        out.append(Point(m, g, t, d, pp))
  return out


class Simulator:
  """Holds the per-point constants; `batch(step)` simulates every system on one sampled batch."""

  def __init__(self, cfg: SimConfig, point: Point):
    self.cfg, self.point = cfg, point
    shape = PRESETS[point.model]
    self.shape = dataclasses.replace(shape, layers=cfg.layers) if cfg.layers else shape
    tp = cfg.tensor_parallel
    self.ranks = point.gpus // tp
    self.t = point.tokens_per_rank
    self.comm = CommModel.for_model(self.shape, tp)
    h = cfg.hardware
    if h.time_table:
      table = TimeTable.load(h.time_table)
      self.kernel = table.rescaled(self.comm.heads) if table.head_dim == self.shape.head_dim else None
      if self.kernel is None:
        raise ValueError(f"hardware.time_table: head_dim {table.head_dim} does not match the "
                         f"model's {self.shape.head_dim}")
    else:
      self.kernel = AnalyticKernel(heads=self.comm.heads, head_dim=self.shape.head_dim,
                                   tflops_fwd=h.attention_tflops, tflops_fwdbwd=h.attention_tflops)
    # Linear layers: ms per token per layer on one rank (TP GPUs share the work).
    lin_flops = self.shape.matmul_flops_per_token() / self.shape.layers * 3.0
    self.lin_ms_per_token = lin_flops / (tp * h.linear_tflops * 1e12) * 1e3
    # The WLB baseline's price of a step: the trainer's `data.wlb_cp=auto` uses the same model.
    self.wlb_cost = WlbCost(lin_ms_per_token=self.lin_ms_per_token, kernel=self.kernel,
                            kv_row_bytes=self.comm.kv_row_bytes, nvlink_gbps=h.nvlink_gbps,
                            network_gbps=h.network_gbps, gpus_per_node=h.gpus_per_node,
                            tensor_parallel=tp, cp_overlap=cfg.cp_overlap)
    elong = cfg.elongate_factor or max(1, self.t // 131072)
    self.sampler = LengthSampler(
        load_lengths(point.distribution), upsample_long_factor=cfg.upsample_long_factor,
        elongate_factor=elong, full_context_replacement=(point.distribution == "prolong"),
        seed=cfg.seed)
    self.node = np.arange(self.ranks) * tp // h.gpus_per_node
    # CAD's transport, as the trainer resolves it on these nodes (`exchange=auto`: across nodes,
    # ragged): the simulator prices GPU clusters.
    self.transport, self.transport_reason = choose(cfg.exchange, self.node, "gpu")
    self.relay = relay_for(cfg.kv_relay_fanout, self.transport, self.node)
    # Appendix A: shards in flight with communication hidden, s <= 2 (t B - h_q) / h_kv - 1,
    # t = forward time per token of the non-attention layers (one layer, one GPU's share),
    # B = network bandwidth per GPU, h_q / h_kv = bytes per token of Q / of K and V on one GPU.
    # (34B, TP 8, 495 TFLOP/s, 50 GB/s gives 30: the paper's "about 31".)
    h_q = self.comm.heads * self.shape.head_dim * self.comm.dtype_bytes
    h_kv = 2 * self.comm.kv_heads * self.shape.head_dim * self.comm.dtype_bytes
    t_tok_s = self.lin_ms_per_token / 3.0 * 1e-3
    self.appendix_a_s = 2.0 * (t_tok_s * h.network_gbps * 1e9 - h_q) / h_kv - 1.0

  # -------------------------------------------------------------------------- helpers

  def _comm_ms_pairwise(self, pair_bytes: np.ndarray, node: np.ndarray | None = None) -> np.ndarray:
    """Per rank: ms to move the per-GPU bytes of pair_bytes [src, dst] (NVLink ∥ network).

    node: the node of each rank of pair_bytes (default: ranks 0..N-1 of this point)."""
    h = self.cfg.hardware
    node = self.node if node is None else node
    same = node[:, None] == node[None, :]
    intra_out = np.where(same, pair_bytes, 0.0).sum(1)
    inter_out = np.where(same, 0.0, pair_bytes).sum(1)
    intra_in = np.where(same, pair_bytes, 0.0).sum(0)
    inter_in = np.where(same, 0.0, pair_bytes).sum(0)
    nv, net = h.nvlink_gbps * 1e6, h.network_gbps * 1e6  # bytes per ms
    return np.maximum.reduce([intra_out / nv, inter_out / net, intra_in / nv, inter_in / net])

  def _cad_exchange(self, tasks, layout, comm):
    """(comm ms, bytes, moved bytes) per rank and layer of CAD's exchange on the configured
    transport (`transport.exchange_rounds`): a relay's second round runs after the first, so
    their times add; bytes = max(sent, received) over all rounds; moved = sent + received of the
    rows that move (what `cad_ms_per_gb` charges)."""
    rounds, moved_NxN = exchange_rounds(tasks, layout, comm, self.transport, self.relay)
    comm_ms = sum(self._comm_ms_pairwise(r) for r in rounds)
    total_NxN = sum(rounds)
    return (comm_ms, np.maximum(total_NxN.sum(1), total_NxN.sum(0)),
            moved_NxN.sum(1) + moved_NxN.sum(0))

  def _cad_result(self, cfg, per, area_after, attn_ms, shards) -> SystemResult:
    """CAD's result from its per-nano-batch (area, attention ms, tokens, comm ms, bytes) parts:
    with ping-pong each nano-batch's communication hides under the other's compute."""
    tokens = sum(x[2] for x in per)
    comm_ms = sum(x[3] for x in per)
    bytes_ = sum(x[4] for x in per)
    # The calibrated costs beyond the model (SimConfig.cad_machinery, cad_exchange_fixed,
    # cad_ms_per_gb).
    extra = ((cfg.cad_machinery + cfg.cad_exchange_fixed) * tokens * self.lin_ms_per_token
             + cfg.cad_ms_per_gb * sum(x[5] for x in per) / 1e9)
    if len(per) == 2:  # ping-pong
      comp = [x[2] * self.lin_ms_per_token + x[1] for x in per]
      ov = cfg.pingpong_overlap
      exposed = sum(np.maximum(per[i][3] - ov * comp[1 - i], (1 - ov) * per[i][3]) for i in (0, 1))
      hidden = bool(all((per[i][3] <= comp[1 - i] + 1e-12).all() for i in (0, 1)))
    else:
      exposed, hidden = None, None
    return dataclasses.replace(
        self._result("cad", None, comm_ms, cfg.pingpong_overlap, area_after, tokens, attn_ms,
                     bytes_, exposed=exposed, hidden=hidden, extra_ms=extra), shards_max=shards)

  def _result(self, name, load: SystemLoad, comm_ms, overlap, area, tokens, attn_ms, bytes_,
              exposed=None, hidden=None, extra_ms=0.0):
    lin = tokens * self.lin_ms_per_token
    compute = lin + attn_ms
    if exposed is None:
      exposed = comm_ms - overlap * np.minimum(comm_ms, compute)
    if hidden is None:
      hidden = bool((comm_ms <= compute + 1e-12).all())
    per_rank = compute + exposed + extra_ms
    ratio = lambda x: float(x.max() / x.mean()) if x.mean() > 0 else 1.0
    return SystemResult(
        name=name, cp=load.cp if load is not None else 1, compute_imbalance=ratio(area),
        memory_imbalance=ratio(tokens), total_compute_imbalance=ratio(compute),
        bytes_per_layer=float(bytes_.max(initial=0.0)), comm_ms=float(comm_ms.max(initial=0.0)),
        compute_ms=float(compute.max()), hidden=float(hidden),
        iter_s=float(per_rank.max()) * self.shape.layers / 1e3,
        idle_frac=1.0 - float(compute.sum()) / (compute.size * float(per_rank.max()))
        if per_rank.max() > 0 else 0.0)

  def _baseline(self, load: SystemLoad, overlap: float, name: str | None = None) -> SystemResult:
    h = self.cfg.hardware
    if load.cp > 1:
      same_node = load.cp * self.cfg.tensor_parallel <= h.gpus_per_node
      bw = (h.nvlink_gbps if same_node else h.network_gbps) * 1e6
      comm_ms = np.maximum(load.send, load.recv) / bw
    else:
      comm_ms = np.maximum(load.send, load.recv) / (h.network_gbps * 1e6)
    return self._result(name or load.name, load, comm_ms, overlap, load.area, load.tokens,
                        load.attn_ms, np.maximum(load.send, load.recv))

  # -------------------------------------------------------------------------- one batch

  def batch(self, step: int, dump_dir: Path | None = None):
    """Returns ({system: SystemResult}, {"before": area [N], "after": area [N]})."""
    cfg, n, t = self.cfg, self.ranks, self.t
    lens = self.sampler.sample(n * t, step)
    layout = pack(lens, n, t)
    out = {}
    # Colocated.
    col = colocated(layout, self.comm, kernel=self.kernel)
    trc = traffic(initial_tasks(layout), layout, self.comm, pairwise=True)
    out["colocated"] = self._result("colocated", col, self._comm_ms_pairwise(trc.pair_bytes),
                                    cfg.cp_overlap, col.area, col.tokens, col.attn_ms,
                                    np.maximum(col.send, col.recv))
    # CAD; below min_imbalance nothing moves and the step runs colocated (the trainer's gate).
    if col.area.max() < cfg.min_imbalance_for(pipelined=False) * col.area.mean():
      out["cad"], area_after = dataclasses.replace(out["colocated"], name="cad"), col.area
    else:
      out["cad"], area_after = self._cad(lens, layout, step, dump_dir)
      if cfg.gate and out["cad"].iter_s > out["colocated"].iter_s:  # the gate: CAD would lose
        out["cad"], area_after = dataclasses.replace(out["colocated"], name="cad"), col.area
    # WLB packing (cp = 1), the best DP x CP sweep, and per-document CP over everything.
    sweep = {}
    for cp in self._cp_sizes():
      load = wlb_packing(lens, n, t, self.comm, cp=cp, token_cap=cfg.wlb_token_cap,
                         kernel=self.kernel, cost=self.wlb_cost)
      sweep[cp] = self._baseline(load, 0.0 if load.cp == 1 else cfg.cp_overlap)
    out["wlb"] = dataclasses.replace(sweep[1], name="wlb")
    best = min(sweep.values(), key=lambda r: r.iter_s)
    out["wlb_best"] = dataclasses.replace(best, name="wlb_best")
    pdc = per_document_cp(lens, n, t, self.comm, kernel=self.kernel)
    out["per_doc_cp"] = self._baseline(pdc, cfg.cp_overlap, "per_doc_cp")
    return out, {"before": col.area, "after": area_after}

  def _cad(self, lens, layout, step, dump_dir):
    """CAD's result on one batch and its attention area per rank after scheduling."""
    cfg, n, t = self.cfg, self.ranks, self.t
    # CAD: with ping-pong, one plan per nano-batch (equal tokens, balanced Σl², half buffers);
    # each nano-batch's dispatch overlaps the other's compute (docs/METHOD.md, "Ping-pong execution").
    # A document cut between the two is exact: Pong's plan reads its prefix's K/V from Ping's
    # rows (`Layout.prior`), and its cost and traffic count them. As in training, a split that
    # cuts a document longer than half the batch is also tried as one plan, and the faster runs.
    if not cfg.pingpong:
      return self._cad_streams((layout,), step, dump_dir)
    ping, pong, split = pingpong_layouts(lens, n, t)
    two = self._cad_streams((ping, pong), step, dump_dir)
    if (not cfg.pingpong_allow_single or split.cut is None
        or int(np.asarray(lens)[split.cut[0]]) <= split.tokens[1]):
      return two
    one = self._cad_streams((layout,), step, None)
    return one if one[0].iter_s < two[0].iter_s else two

  def _cad_streams(self, halves, step, dump_dir):
    """CAD's result with one plan per layout of `halves` (Ping and Pong, or the whole batch)."""
    cfg, n = self.cfg, self.ranks
    per = []
    shards = 0
    for k, lay in enumerate(halves):
      plan = make_plan(lay, self.comm, cfg.epsilon, nodes=self.node)
      tasks = plan.tasks
      attn = np.bincount(tasks.server, weights=self.kernel.fwdbwd_ms(tasks.q_len, tasks.kv_len),
                         minlength=n)
      tok = np.bincount(lay.buffer, weights=lay.length, minlength=n).astype(np.float64)
      per.append((plan, attn, tok, *self._cad_exchange(tasks, lay, self.comm)))
      remote = tasks.server != tasks.home
      shards = max(shards, int(np.bincount(tasks.server[remote], minlength=n).max(initial=0)))
      if dump_dir is not None:
        p = self.point
        tag = ("_ping", "_pong")[k] if len(halves) == 2 else ""
        plan.dump_json(dump_dir / f"{p.model}_{p.gpus}g_{p.tokens_per_rank}_"
                                  f"{Path(p.distribution).stem}_b{step}{tag}.json")
    area_after = sum(x[0].stats.load_after for x in per)
    attn_ms = sum(x[1] for x in per)
    return self._cad_result(cfg, per, area_after, attn_ms, shards), area_after

  def _cp_sizes(self):
    sizes = [c for c in self.cfg.cp_sizes if c > 0]
    if not sizes:
      sizes = [c for c in (1, 2, 4, 8, 16, 32) if c <= self.ranks]
    sizes = sorted({c for c in sizes if self.ranks % c == 0} | {1})
    return sizes


def summarize(results: list[dict[str, SystemResult]]) -> dict[str, dict]:
  """Means over batches per system, and CAD's speedup over each baseline (ratio of mean times)."""
  out = {}
  for name in SYSTEMS:
    rs = [r[name] for r in results]
    out[name] = {
        "cp": int(np.bincount([r.cp for r in rs]).argmax()),
        "compute_imbalance": float(np.mean([r.compute_imbalance for r in rs])),
        "memory_imbalance": float(np.mean([r.memory_imbalance for r in rs])),
        "total_compute_imbalance": float(np.mean([r.total_compute_imbalance for r in rs])),
        "bytes_per_layer_mb": float(np.mean([r.bytes_per_layer for r in rs])) / 1e6,
        "comm_ms": float(np.mean([r.comm_ms for r in rs])),
        "compute_ms": float(np.mean([r.compute_ms for r in rs])),
        "hidden_frac": float(np.mean([r.hidden for r in rs])),
        "iter_s": float(np.mean([r.iter_s for r in rs])),
        "shards_max": int(max(r.shards_max for r in rs)),
        "idle_frac": float(np.mean([r.idle_frac for r in rs])),
    }
  cad = out["cad"]["iter_s"]
  for name in SYSTEMS:
    out[name]["cad_speedup"] = out[name]["iter_s"] / cad if cad > 0 else float("nan")
  return out
