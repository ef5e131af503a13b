"""A step's plan: the scheduler's CA-tasks, their capacities, and a reference array layout.

What training uses from here: `make_plan` (tasks placed on servers, capacities chosen from
buckets) and its `Plan.tasks`. The dispatch layer lays those tasks out in its own format
(`dispatch.build_dispatch` -> `dispatch.DispatchPlan`: stay-home rows kept apart, only the
off-diagonal blocks exchanged). The arrays below (`PlanArrays`, `with_arrays=True`) are the
scheduler's own, simpler layout, which `simulate_dispatch` runs in numpy against per-document
attention: the executable specification of what any dispatch must compute.

Setting. N devices on the `data` axis. Each device d is the *home* of a buffer of T tokens (rows
0..T-1, the packed layout) and is also an attention *server*. Every CA-task has one home, and
its query rows are a contiguous range of the home buffer; its keys are its document's prefix.

Arrays (numpy; indices int32, masks bool; padding entries have index 0 and valid False):

  send_q_idx  [N, N, Cq]   device d sends its local rows send_q_idx[d, s, :] (where
  send_q_valid[N, N, Cq]   send_q_valid) to server s; packed task by task, so the query rows of one
                           task are contiguous in the block. Tasks that stay home are the s == d
                           block (a local copy, no network traffic).
  send_kv_idx  [N, N, Ckv] local K/V rows device d sends to server s. Deduplicated: for each
  send_kv_valid            document, server s receives rows [0, max end of its tasks of that doc)
                           exactly once, from whichever devices hold them.
  (tiled all_to_all: server s then holds recv_q flat [N * Cq], the block of source d at rows
  d*Cq .. d*Cq+Cq-1, and recv_kv flat [N * Ckv] likewise.)
  server_kv_idx   [N, Skv] server s gathers its KV rows: kv_s = recv_kv_s[server_kv_idx[s]], so
  server_kv_valid [N, Skv] each document's prefix [0, need) is contiguous, document position p of
                           it at row base + p.
  q_start, q_len, kv_start, kv_len  [N, Ctask]  server s's fused task table (kernels/tasks.py
                           semantics): queries are recv_q flat rows [q_start, q_start+q_len), keys
                           are gathered KV rows [kv_start, kv_start+kv_len); bottom-right causal
                           (query i sees keys 0..kv_len-q_len+i of the range); q_len <= kv_len;
                           padding entries have q_len = kv_len = 0.
  (O, computed in recv_q's row order on server s, goes back by the reverse tiled all_to_all; the
  home device d then holds a returned buffer [N * Cq], block of server s at rows s*Cq.)
  return_idx   [N, T]      home row r of device d finds its output at returned flat row
  return_valid [N, T]      return_idx[d, r]; False for padding tokens (no document).

Capacities. Cq, Ckv, Skv, Ctask are chosen from a small set of buckets (`row_bucket`,
`task_bucket`) so that XLA recompiles rarely; a caller may fix any of them (`Capacities`). Note
that the s == d block holds every token that stays home, so Cq is usually T (and the all_to_all
buffers N*Cq rows): the format trades padding for one uniform exchange. `make_plan` raises ε step
by step until the plan fits the fixed capacities and raises `CapacityError` if even the colocated
plan does not. Below `min_imbalance` (colocated load max / mean) it returns the colocated plan.

`simulate_dispatch` runs this exact data movement in numpy with reference attention and checks
it against per-document causal attention on the packed layout: the executable specification.

Use (host side, once per nano-batch; numpy only):

  comm = CommModel.for_model(shape, tensor_parallel=tp)     # schedule/cost.py
  plan = make_plan(layout, comm, epsilon=0.1)               # buckets chosen for this step, or
  plan = make_plan(layout, comm, 0.1, Capacities(cq=T, ckv=T, skv=4 * T, ctask=64))
  policy = CapacityPolicy(T); plan = policy.plan(layout, comm, 0.1)   # capacities only grow
  a = plan.arrays            # PlanArrays: a.send_q_idx, ..., a.return_valid; a.cq, a.ckv, ...
  colocated_plan(layout, comm)                              # nothing moves, same format
  plan.tasks, plan.task_flops, plan.dump_json(path)         # the task list, documented JSON
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from distca_jax.data.packing import Layout
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.items import Tasks, initial_tasks, row_bucket, validate_layout
from distca_jax.schedule.planner import BalanceStats, Traffic, balance, kv_requests, traffic

PLAN_FORMAT = "distca-plan-v1"


class CapacityError(ValueError):
  """The plan's arrays do not fit the requested capacities."""


@dataclasses.dataclass(frozen=True)
class Capacities:
  """Fixed capacities; None lets `make_plan` pick the bucket the plan needs."""

  cq: int | None = None
  ckv: int | None = None
  skv: int | None = None
  ctask: int | None = None

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if v is not None and v < 1:
        raise ValueError(f"Capacities.{f.name}: must be >= 1 or None, got {v}")


def task_bucket(tasks: int) -> int:
  """Smallest power of two >= tasks, at least 8."""
  return max(8, 1 << max(0, math.ceil(math.log2(max(int(tasks), 1)))))


@dataclasses.dataclass(frozen=True)
class PlanArrays:
  """The dispatch arrays; the module docstring defines every field."""

  send_q_idx: np.ndarray
  send_q_valid: np.ndarray
  send_kv_idx: np.ndarray
  send_kv_valid: np.ndarray
  server_kv_idx: np.ndarray
  server_kv_valid: np.ndarray
  q_start: np.ndarray
  q_len: np.ndarray
  kv_start: np.ndarray
  kv_len: np.ndarray
  return_idx: np.ndarray
  return_valid: np.ndarray

  @property
  def cq(self) -> int:
    return self.send_q_idx.shape[-1]

  @property
  def ckv(self) -> int:
    return self.send_kv_idx.shape[-1]

  @property
  def skv(self) -> int:
    return self.server_kv_idx.shape[-1]

  @property
  def ctask(self) -> int:
    return self.q_start.shape[-1]


@dataclasses.dataclass(frozen=True)
class Requirements:
  """Smallest capacities a task placement needs (before bucketing)."""

  cq: int
  ckv: int
  skv: int
  ctask: int

  def fits(self, caps: Capacities) -> bool:
    return all(getattr(caps, k) is None or getattr(self, k) <= getattr(caps, k)
               for k in ("cq", "ckv", "skv", "ctask"))


class CapacityPolicy:
  """Capacities that only grow, so a training run recompiles only when a step needs a bigger bucket.

  `capacities(req)` returns the current buckets if `req` fits them, else the buckets of the
  elementwise max of the current ones and `req` (counted in `recompiles`). Pass the result to
  `make_plan(..., capacities=...)`: with fixed capacities the planner's ε feedback applies.

    policy = CapacityPolicy(buffer_len=T)
    plan = make_plan(layout, comm, eps, policy.capacities(requirements_of_last_plan))
  """

  def __init__(self, buffer_len: int, initial: Capacities | None = None):
    self.buffer_len = buffer_len
    self.current = initial
    self.recompiles = 0
    self.history: list[Capacities] = []

  def capacities(self, req: Requirements) -> Capacities:
    cur = self.current
    if cur is not None and req.fits(cur):
      return cur
    need = {k: max(getattr(req, k), getattr(cur, k) or 0 if cur is not None else 0)
            for k in ("cq", "ckv", "skv", "ctask")}
    new = resolve_capacities(Requirements(**need), Capacities(), self.buffer_len)
    if new != cur:
      self.recompiles += 1
      self.history.append(new)
    self.current = new
    return new

  def plan(self, layout: Layout, comm: CommModel, epsilon: float = 0.1, **kw) -> "Plan":
    """make_plan with these capacities, growing them (one recompile) when the step needs more."""
    free = make_plan(layout, comm, epsilon, with_arrays=False, **kw)
    return make_plan(layout, comm, epsilon, self.capacities(free.requirements), **kw)


def cumsum_in_groups(values: np.ndarray, group: np.ndarray) -> np.ndarray:
  """Per element: sum of `values` of earlier elements of the same group (input grouped, sorted)."""
  c = np.cumsum(values) - values
  if values.size == 0:
    return c
  starts = np.r_[True, group[1:] != group[:-1]]
  base = np.maximum.accumulate(np.where(starts, c, 0))
  return c - base


def fill_ranges(idx_flat: np.ndarray, valid_flat: np.ndarray, dst_start, src_start, length) -> None:
  """idx_flat[d : d+l] = s + arange(l), valid_flat[...] = True, for each (d, s, l).

  A loop over ranges (tasks, KV pieces), never over tokens: each range is a contiguous slice
  write, several times faster than scattering per-token index arrays.
  """
  if len(length) == 0:
    return
  ramp = np.arange(int(np.max(length)), dtype=idx_flat.dtype)
  for d, s_, l in zip(np.asarray(dst_start).tolist(), np.asarray(src_start).tolist(),
                      np.asarray(length).tolist()):
    if l > 0:
      np.add(ramp[:l], s_, out=idx_flat[d:d + l])
      valid_flat[d:d + l] = True


def requirements(tasks: Tasks, layout: Layout) -> Requirements:
  n = layout.num_buffers
  q_block = np.bincount(tasks.home * n + tasks.server, weights=tasks.q_len, minlength=n * n)
  kv = kv_requests(tasks, layout)
  dst = kv.pair_server[kv.piece_pair]
  kv_block = np.bincount(kv.piece_src * n + dst, weights=kv.piece_rows, minlength=n * n)
  skv = np.bincount(kv.pair_server, weights=kv.pair_need, minlength=n)
  ntask = np.bincount(tasks.server, minlength=n)
  return Requirements(cq=int(q_block.max(initial=0)), ckv=int(kv_block.max(initial=0)),
                      skv=int(skv.max(initial=0)), ctask=int(ntask.max(initial=0)))


def resolve_capacities(req: Requirements, caps: Capacities, buffer_len: int) -> Capacities:
  return Capacities(
      cq=caps.cq if caps.cq is not None else row_bucket(req.cq, buffer_len),
      ckv=caps.ckv if caps.ckv is not None else row_bucket(req.ckv, buffer_len),
      skv=caps.skv if caps.skv is not None else row_bucket(req.skv, buffer_len),
      ctask=caps.ctask if caps.ctask is not None else task_bucket(req.ctask))


def build_arrays(tasks: Tasks, layout: Layout, caps: Capacities) -> PlanArrays:
  """The dispatch arrays of a task placement (all capacities in `caps` must be set).

  Raises CapacityError naming the capacity that is too small.
  """
  if layout.prior is not None:
    raise ValueError("build_arrays: these reference arrays read K/V rows from the layout's own "
                     "buffers only; a ping-pong layout with prior shards is laid out by "
                     "dispatch.build_dispatch")
  n, t = layout.num_buffers, layout.buffer_len
  req = requirements(tasks, layout)
  for k in ("cq", "ckv", "skv", "ctask"):
    if getattr(caps, k) is None:
      raise ValueError(f"build_arrays: capacity {k} must be set")
    if getattr(req, k) > getattr(caps, k):
      raise CapacityError(f"plan needs {k} = {getattr(req, k)} but the capacity is {getattr(caps, k)}")
  cq, ckv, skv, ctask = caps.cq, caps.ckv, caps.skv, caps.ctask

  # Queries: tasks grouped by (home, server) block, in home-row order inside a block.
  block = tasks.home * n + tasks.server
  order = np.lexsort((tasks.home_off, block))
  blk, ql = block[order], tasks.q_len[order]
  home, server, hoff = tasks.home[order], tasks.server[order], tasks.home_off[order]
  pos = cumsum_in_groups(ql, blk)
  send_q_idx = np.zeros(n * n * cq, np.int32)
  send_q_valid = np.zeros(n * n * cq, bool)
  fill_ranges(send_q_idx, send_q_valid, blk * cq + pos, hoff, ql)
  q_start_flat = home * cq + pos  # task's first row in its server's recv_q flat
  return_idx = np.zeros(n * t, np.int32)
  return_valid = np.zeros(n * t, bool)
  fill_ranges(return_idx, return_valid, home * t + hoff, server * cq + pos, ql)

  # Keys/values: deduplicated prefix pieces, grouped by (source, server) block.
  kv = kv_requests(tasks, layout)
  dst = kv.pair_server[kv.piece_pair]
  kblk = kv.piece_src * n + dst
  korder = np.lexsort((kv.piece_doc_off, kv.piece_pair, kblk))
  kb, rows = kblk[korder], kv.piece_rows[korder]
  src, kdst = kv.piece_src[korder], dst[korder]
  kpos = cumsum_in_groups(rows, kb)
  send_kv_idx = np.zeros(n * n * ckv, np.int32)
  send_kv_valid = np.zeros(n * n * ckv, bool)
  fill_ranges(send_kv_idx, send_kv_valid, kb * ckv + kpos, kv.piece_src_off[korder], rows)
  # Server gather: pairs are sorted by (server, doc); each gets a contiguous prefix region.
  pair_base = cumsum_in_groups(kv.pair_need, kv.pair_server)
  server_kv_idx = np.zeros(n * skv, np.int32)
  server_kv_valid = np.zeros(n * skv, bool)
  pair = kv.piece_pair[korder]
  fill_ranges(server_kv_idx, server_kv_valid, kdst * skv + pair_base[pair] + kv.piece_doc_off[korder],
               src * ckv + kpos, rows)

  # Task tables: per server, in order of their query rows.
  num_docs = max(int(np.asarray(layout.doc_lens).size), 1)
  pair_key = kv.pair_server * num_docs + kv.pair_doc
  tpair = np.searchsorted(pair_key, server * num_docs + tasks.doc[order])
  torder = np.lexsort((q_start_flat, server))
  srv = server[torder]
  slot = cumsum_in_groups(np.ones_like(srv), srv)
  flat = srv * ctask + slot
  tab = {k: np.zeros(n * ctask, np.int32) for k in ("q_start", "q_len", "kv_start", "kv_len")}
  tab["q_start"][flat] = q_start_flat[torder]
  tab["q_len"][flat] = ql[torder]
  tab["kv_start"][flat] = pair_base[tpair[torder]]
  tab["kv_len"][flat] = tasks.q_hi[order][torder]

  return PlanArrays(
      send_q_idx=send_q_idx.reshape(n, n, cq), send_q_valid=send_q_valid.reshape(n, n, cq),
      send_kv_idx=send_kv_idx.reshape(n, n, ckv), send_kv_valid=send_kv_valid.reshape(n, n, ckv),
      server_kv_idx=server_kv_idx.reshape(n, skv), server_kv_valid=server_kv_valid.reshape(n, skv),
      q_start=tab["q_start"].reshape(n, ctask), q_len=tab["q_len"].reshape(n, ctask),
      kv_start=tab["kv_start"].reshape(n, ctask), kv_len=tab["kv_len"].reshape(n, ctask),
      return_idx=return_idx.reshape(n, t), return_valid=return_valid.reshape(n, t))


@dataclasses.dataclass(frozen=True)
class Plan:
  """Tasks (with servers), the dispatch arrays, and what the planner reports.

  task_flops: forward FLOPs per task per layer for one server's heads (comm.flops_per_area).
  """

  num_devices: int
  buffer_len: int
  epsilon: float
  capacities: Capacities
  requirements: Requirements
  tasks: Tasks
  task_flops: np.ndarray
  stats: BalanceStats
  traffic: Traffic
  arrays: PlanArrays | None

  def server_flops(self) -> np.ndarray:
    """[N] forward attention FLOPs per layer each server computes (one server's heads)."""
    return np.bincount(self.tasks.server, weights=self.task_flops, minlength=self.num_devices)

  def server_ms(self, kernel, backward: bool = True) -> np.ndarray:
    """[N] predicted kernel ms per layer per server: Σ over its tasks of `kernel.fwdbwd_ms` (or
    `fwd_ms`), kernel = cost.AnalyticKernel or a profiled cost.TimeTable for one server's heads."""
    t = self.tasks
    ms = (kernel.fwdbwd_ms if backward else kernel.fwd_ms)(t.q_len, t.kv_len)
    return np.bincount(t.server, weights=ms, minlength=self.num_devices)

  def to_json_dict(self) -> dict:
    """Documented JSON form (see `dump_json`)."""
    t = self.tasks
    return {
        "format": PLAN_FORMAT,
        "num_devices": self.num_devices,
        "buffer_len": self.buffer_len,
        "epsilon": self.epsilon,
        "moves": self.stats.moves,
        "capacities": dataclasses.asdict(self.capacities),
        "requirements": dataclasses.asdict(self.requirements),
        "load_before": self.stats.load_before.tolist(),
        "load_after": self.stats.load_after.tolist(),
        "imbalance_before": self.stats.imbalance_before,
        "imbalance_after": self.stats.imbalance_after,
        "flops_after": self.server_flops().tolist(),
        "send_bytes_per_layer": self.traffic.send.tolist(),
        "recv_bytes_per_layer": self.traffic.recv.tolist(),
        "tasks": {
            "home": t.home.tolist(), "doc": t.doc.tolist(), "q_lo": t.q_lo.tolist(),
            "q_hi": t.q_hi.tolist(), "kv_lo": [0] * t.size, "kv_hi": t.q_hi.tolist(),
            "home_off": t.home_off.tolist(), "server": t.server.tolist(),
            "flops": self.task_flops.tolist(),
        },
    }

  def dump_json(self, path: str | Path) -> None:
    """Writes the plan as JSON. Schema (`format` = "distca-plan-v1"):

    num_devices, buffer_len, epsilon (the tolerance the plan was made with, after capacity
    feedback), moves (planner moves), capacities {cq, ckv, skv, ctask} (the array capacities),
    requirements (the smallest capacities this placement needs), load_before / load_after [N]
    (attention area, query-key pairs, per server before and after scheduling),
    imbalance_before / imbalance_after (max / mean of those), flops_after [N] (forward attention
    FLOPs per layer per server, one server's heads), send_ / recv_bytes_per_layer [N]
    (network bytes per device per layer, one server's heads, KV deduplicated), and tasks: columns
    of equal length, one entry per CA-task: home (device holding its query rows), doc (document
    id), q_lo / q_hi (query positions in the document), kv_lo / kv_hi (key positions: always
    0 / q_hi), home_off (home buffer row of q_lo), server (device computing it), flops (forward
    FLOPs per layer for one server's heads).
    """
    Path(path).write_text(json.dumps(self.to_json_dict()))


def _finish(tasks, layout, comm, epsilon, stats, caps, with_arrays) -> Plan:
  req = requirements(tasks, layout)
  resolved = resolve_capacities(req, caps, layout.buffer_len)
  arrays = build_arrays(tasks, layout, resolved) if with_arrays else None
  return Plan(num_devices=layout.num_buffers, buffer_len=layout.buffer_len, epsilon=epsilon,
              capacities=resolved, requirements=req, tasks=tasks,
              task_flops=tasks.area() * comm.flops_per_area(backward=False), stats=stats,
              traffic=traffic(tasks, layout, comm), arrays=arrays)


def make_plan(layout: Layout, comm: CommModel, epsilon: float = 0.1,
              capacities: Capacities = Capacities(), *, epsilon_step: float = 0.05,
              max_epsilon: float = 1.0, with_arrays: bool = True, min_imbalance: float = 1.0,
              **balance_kw) -> Plan:
  """Schedules `layout` and builds its dispatch arrays, with capacity feedback.

  Below `min_imbalance` (the colocated attention load's max / mean over devices) nothing moves:
  the colocated plan (its exchange carries only the K/V prefixes of documents that continue from
  an earlier buffer, which colocated attention needs too). Otherwise tries epsilon,
  epsilon + epsilon_step, ... up to max_epsilon, then the colocated plan; returns the first that
  fits `capacities` (None fields: chosen from the buckets). Raises CapacityError if none fits,
  ValueError on a bad layout. `with_arrays=False` skips the O(N² C) arrays (training, the
  simulator).
  """
  validate_layout(layout)
  if min_imbalance < 1.0:
    raise ValueError(f"min_imbalance: a max / mean ratio, must be >= 1, got {min_imbalance}")
  if min_imbalance > 1.0:
    base = initial_tasks(layout, validate=False)
    load = np.bincount(base.server, weights=base.area(), minlength=layout.num_buffers)
    if load.mean() > 0 and load.max() / load.mean() < min_imbalance:
      try:
        return colocated_plan(layout, comm, capacities=capacities, with_arrays=with_arrays)
      except CapacityError:
        pass  # fixed capacities the colocated plan exceeds: a balanced plan may still fit
  tried = []
  eps = float(epsilon)
  max_epsilon = max(max_epsilon, eps)  # the requested tolerance is always tried
  while eps <= max_epsilon + 1e-9:
    tasks, stats = balance(layout, comm, eps, validate=False, **balance_kw)
    req = requirements(tasks, layout)
    if req.fits(capacities):
      return _finish(tasks, layout, comm, eps, stats, capacities, with_arrays)
    tried.append((eps, req))
    if epsilon_step <= 0:
      break
    eps = round(eps + epsilon_step, 10)
  plan = colocated_plan(layout, comm, capacities=Capacities(), with_arrays=False)
  if plan.requirements.fits(capacities):
    return colocated_plan(layout, comm, capacities=capacities, with_arrays=with_arrays)
  last = tried[-1][1] if tried else plan.requirements
  raise CapacityError(
      f"no plan fits the capacities {dataclasses.asdict(capacities)}: tried epsilon "
      f"{[e for e, _ in tried]} and the colocated plan; the colocated plan needs "
      f"{dataclasses.asdict(plan.requirements)}, the last balanced one {dataclasses.asdict(last)}")


def colocated_plan(layout: Layout, comm: CommModel, capacities: Capacities = Capacities(),
                   with_arrays: bool = True) -> Plan:
  """Every task on its home device (no balancing), in the same array format."""
  tasks = initial_tasks(layout).sorted()
  load = np.bincount(tasks.server, weights=tasks.area(), minlength=layout.num_buffers)
  stats = BalanceStats(epsilon=float("inf"), moves=0, load_before=load, load_after=load)
  req = requirements(tasks, layout)
  if not req.fits(capacities):
    raise CapacityError(f"the colocated plan needs {dataclasses.asdict(req)}, more than the "
                        f"capacities {dataclasses.asdict(capacities)}")
  return _finish(tasks, layout, comm, float("inf"), stats, capacities, with_arrays)


# ----------------------------------------------------------------------------- numpy check


def _attention(q_TxHxD, k_SxKxD, v_SxKxD):
  """Bottom-right causal attention of one task, float64 numpy; GQA (head h reads h // (H/K))."""
  t, h, dim = q_TxHxD.shape
  s, kh, _ = k_SxKxD.shape
  k = np.repeat(k_SxKxD, h // kh, axis=1)
  v = np.repeat(v_SxKxD, h // kh, axis=1)
  logits = np.einsum("thd,shd->hts", q_TxHxD, k) / math.sqrt(dim)
  mask = np.arange(s)[None, :] <= (s - t + np.arange(t))[:, None]
  logits = np.where(mask[None], logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("hts,shd->thd", p, v)


def simulate_dispatch(plan: Plan, layout: Layout, heads: int = 2, kv_heads: int = 1,
                      head_dim: int = 8, seed: int = 0) -> float:
  """Runs the plan's data movement in numpy and returns the max |error| against direct attention.

  Random q [N, T, H, D] and k, v [N, T, K, D] per home buffer; per device: gather send blocks;
  tiled all_to_all; server-side KV gather; reference attention per task; reverse all_to_all;
  `return_idx` gather. The reference is per-document causal attention computed from the layout
  (each document's rows concatenated in position order). Padding rows must come back unused.
  """
  a = plan.arrays
  if a is None:
    raise ValueError("simulate_dispatch: the plan was made with with_arrays=False")
  n, t = layout.num_buffers, layout.buffer_len
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((n, t, heads, head_dim))
  k = rng.standard_normal((n, t, kv_heads, head_dim))
  v = rng.standard_normal((n, t, kv_heads, head_dim))
  dev = np.arange(n)[:, None, None]
  # Send: [N(src), N(dst), C, ...]; padding rows zeroed (they carry garbage in a real run).
  send_q = np.where(a.send_q_valid[..., None, None], q[dev, a.send_q_idx], 0.0)
  send_k = np.where(a.send_kv_valid[..., None, None], k[dev, a.send_kv_idx], 0.0)
  send_v = np.where(a.send_kv_valid[..., None, None], v[dev, a.send_kv_idx], 0.0)
  # Tiled all_to_all: server s receives block [d, s] from every d, laid out at rows d*C.
  recv_q = send_q.transpose(1, 0, 2, 3, 4).reshape(n, n * a.cq, heads, head_dim)
  recv_k = send_k.transpose(1, 0, 2, 3, 4).reshape(n, n * a.ckv, kv_heads, head_dim)
  recv_v = send_v.transpose(1, 0, 2, 3, 4).reshape(n, n * a.ckv, kv_heads, head_dim)
  srv = np.arange(n)[:, None]
  kv_k = recv_k[srv, a.server_kv_idx]
  kv_v = recv_v[srv, a.server_kv_idx]
  out = np.zeros_like(recv_q)
  for s in range(n):
    for j in range(a.ctask):
      qs, ql, ks, kl = (int(x[s, j]) for x in (a.q_start, a.q_len, a.kv_start, a.kv_len))
      if ql == 0:
        continue
      out[s, qs:qs + ql] = _attention(recv_q[s, qs:qs + ql], kv_k[s, ks:ks + kl], kv_v[s, ks:ks + kl])
  # Reverse all_to_all: home d receives block [s, d] of every server s at rows s*Cq.
  back = out.reshape(n, n, a.cq, heads, head_dim).transpose(1, 0, 2, 3, 4)
  back = back.reshape(n, n * a.cq, heads, head_dim)
  got = back[np.arange(n)[:, None], a.return_idx]  # [N, T, H, D]
  # Reference: each document's rows in position order, causal attention, scattered back.
  seg, pos = layout.segment_ids(), layout.positions()
  want = np.zeros_like(got)
  for g in range(np.asarray(layout.doc_lens).size):
    dd, rr = np.nonzero(seg == g)
    o = np.argsort(pos[dd, rr], kind="stable")
    dd, rr = dd[o], rr[o]
    want[dd, rr] = _attention(q[dd, rr], k[dd, rr], v[dd, rr])
  if (a.return_valid != (seg >= 0)).any():
    return float("inf")
  err = np.abs(np.where(a.return_valid[..., None, None], got - want, 0.0))
  return float(err.max(initial=0.0))
