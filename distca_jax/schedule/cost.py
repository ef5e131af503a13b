"""Cost model of CA-tasks: FLOPs, bytes on the wire, and (optionally) profiled kernel time.

docs/METHOD.md, "CA-tasks" and "Cost model". Units used throughout the scheduler:

* **area**: query-key pairs of a bottom-right causal task, `q*kv - q*(q-1)/2`. The planner
  balances area; FLOPs are `area * 4 * head_dim * heads` per layer forward (QKᵀ and PV, 2 FLOPs a
  multiply-add), and the backward costs `BWD_OVER_FWD` times the forward.
* **bytes**: per *row* sizes. A query row moved to a server costs `q_row_bytes` (Q out, O back;
  in the backward dO, O and the fp32 LSE out and dQ back), a KV row `kv_row_bytes` (K and V out;
  dK and dV back). These are per layer, for the heads one server handles (all heads divided by the
  tensor-parallel size).
* **time**: milliseconds from a profiled table over a (q, kv) grid with bilinear interpolation
  (`TimeTable`), or from an analytic throughput (`AnalyticKernel`).

Numpy only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np

# Backward of flash attention recomputes P and does 2 more matmuls than the forward's 2, with
# lower utilisation: the paper's "backward ≈ 2.5× forward".
BWD_OVER_FWD = 2.5
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def causal_area(q, kv):
  """Query-key pairs of a bottom-right causal task with `q` queries over `kv` keys (float64)."""
  q = np.asarray(q, np.float64)
  kv = np.asarray(kv, np.float64)
  return q * kv - q * (q - 1.0) / 2.0


def range_area(lo, hi):
  """Area of the task whose queries are document positions [lo, hi) (keys [0, hi)).

  Equal to `causal_area(hi - lo, hi)`: query at position p sees p + 1 keys.
  """
  lo = np.asarray(lo, np.float64)
  hi = np.asarray(hi, np.float64)
  return (hi - lo) * (hi + lo + 1.0) / 2.0


@dataclasses.dataclass(frozen=True)
class CommModel:
  """Per-row byte sizes of moving attention work, for one attention server (one TP rank).

  heads, kv_heads: heads that server handles (model heads / tensor-parallel size).
  head_dim: per-head dimension. dtype_bytes: activation element size (2 for bf16).
  backward: include the backward pass traffic (dO, O, LSE out; dQ, dK, dV back; "keep" mode: the
  server kept Q, K, V from the forward). resend: "resend" mode (docs/METHOD.md, "Backward:
  keep or resend"): the backward also re-sends Q, K, V.
  """

  heads: int
  kv_heads: int
  head_dim: int
  dtype_bytes: int = 2
  backward: bool = True
  resend: bool = False

  def __post_init__(self):
    for name in ("heads", "kv_heads", "head_dim", "dtype_bytes"):
      if getattr(self, name) < 1:
        raise ValueError(f"CommModel.{name}: must be >= 1, got {getattr(self, name)}")

  @property
  def q_row_bytes(self) -> float:
    """Bytes per query row moved to a server and its output back, per layer."""
    h = self.heads * self.head_dim * self.dtype_bytes
    fwd = 2 * h  # Q out, O back
    if not self.backward:
      return float(fwd)
    bwd = 3 * h + 4 * self.heads  # dO, O out, dQ back; fp32 LSE per head
    if self.resend:
      bwd += h  # Q again
    return float(fwd + bwd)

  @property
  def kv_row_bytes(self) -> float:
    """Bytes per KV row sent to a server (K and V), gradients back, per layer."""
    h = 2 * self.kv_heads * self.head_dim * self.dtype_bytes
    if not self.backward:
      return float(h)
    return float(h + h + (h if self.resend else 0))  # K,V out; dK,dV back; (K,V again)

  @property
  def beta(self) -> float:
    """The paper's β = size_kv / size_q."""
    return self.kv_row_bytes / self.q_row_bytes

  def move_bytes(self, n_q, n_kv):
    """Bytes to run a task of n_q query rows over n_kv key rows on a remote server."""
    return np.asarray(n_q, np.float64) * self.q_row_bytes + np.asarray(n_kv, np.float64) * self.kv_row_bytes

  def flops_per_area(self, backward: bool | None = None) -> float:
    """FLOPs per query-key pair per layer for this server's heads (forward, or fwd+bwd)."""
    f = 4.0 * self.head_dim * self.heads
    backward = self.backward if backward is None else backward
    return f * (1.0 + BWD_OVER_FWD) if backward else f

  @classmethod
  def for_model(cls, shape, tensor_parallel: int = 1, dtype_bytes: int = 2, **kw) -> "CommModel":
    """From a `ModelShape` (models/presets.py); heads divided over the tensor-parallel ranks."""
    if shape.heads % tensor_parallel or shape.kv_heads % tensor_parallel:
      raise ValueError(f"tensor_parallel {tensor_parallel} must divide heads {shape.heads} and "
                       f"kv_heads {shape.kv_heads}")
    return cls(heads=shape.heads // tensor_parallel, kv_heads=shape.kv_heads // tensor_parallel,
               head_dim=shape.head_dim, dtype_bytes=dtype_bytes, **kw)


def optimal_split(area, beta: float):
  """Byte-optimal shard for `area` query-key pairs, ignoring the document's bounds.

  Minimises `n_q + beta * n_kv` subject to `n_q * n_kv - n_q²/2 = area` (continuous form of the
  paper's `n_q(2 n_kv − n_q) = α L_q (2 L_kv − L_q)`). Returns (n_q, n_kv) as floats with
  `n_q = sqrt(2·area·β / (β + 2))`, the paper's `n_q*`.
  """
  area = np.asarray(area, np.float64)
  n_q = np.sqrt(2.0 * area * beta / (beta + 2.0))
  n_kv = area / np.maximum(n_q, 1e-9) + n_q / 2.0
  return n_q, n_kv


# ----------------------------------------------------------------------------- kernel time


@dataclasses.dataclass(frozen=True)
class AnalyticKernel:
  """Kernel time from a sustained throughput; shards are padded to the 128-row tile.

  tflops_fwd / tflops_fwdbwd: sustained TFLOP/s per GPU (the default is packed cuDNN's,
  docs/METHOD.md, "Reference measurements").
  Times are for `heads` query heads of `head_dim` (one TP rank's share).
  """

  heads: int
  head_dim: int
  tflops_fwd: float = 300.0
  tflops_fwdbwd: float = 300.0
  tile: int = 128

  def fwd_ms(self, q, kv):
    return self._ms(q, kv, self.tflops_fwd, 1.0)

  def fwdbwd_ms(self, q, kv):
    return self._ms(q, kv, self.tflops_fwdbwd, 1.0 + BWD_OVER_FWD)

  def _ms(self, q, kv, tflops, mult):
    q = np.asarray(q, np.float64)
    kv = np.asarray(kv, np.float64)
    # A tile is computed whole even when half-masked: round q up to the tile, keep the mask area.
    qt = np.where(q > 0, np.ceil(q / self.tile) * self.tile, 0.0)
    area = causal_area(np.minimum(qt, kv), kv)
    return mult * 4.0 * self.heads * self.head_dim * area / (tflops * 1e12) * 1e3


def shipped_tables() -> dict[str, Path]:
  """The measured (q, kv) tables the package ships (`kernels/tables/*.json`, installed as
  `distca_jax/kernels/tables/`), by file name without `.json`, sorted. Found without importing
  `distca_jax.kernels` (which imports JAX)."""
  spec = importlib.util.find_spec("distca_jax.kernels")
  folders = [Path(f) / "tables" for f in (spec.submodule_search_locations or [])] if spec else []
  return {p.stem: p for folder in folders if folder.is_dir() for p in sorted(folder.glob("*.json"))}


@dataclasses.dataclass(frozen=True)
class TimeTable:
  """Profiled kernel time over a (q, kv) grid, bilinearly interpolated (see `_interp`).

  JSON format (written by the kernel benchmark): {"device", "dtype", "heads", "kv_heads",
  "head_dim", "q": [...], "kv": [...], "fwd_ms": [[len(kv)] x len(q)], "fwdbwd_ms": [...]}.
  Entries may be null (launch/bench_kernels.py writes null where q > kv or nothing was measured):
  the interpolation then reads the throughput of the nearest valid entry of the same q row
  (for q > kv: the first kv >= q), or the median throughput of the table.
  """

  q: np.ndarray
  kv: np.ndarray
  fwd: np.ndarray  # [len(q), len(kv)] ms
  fwdbwd: np.ndarray
  heads: int
  kv_heads: int
  head_dim: int
  device: str = ""
  dtype: str = "bfloat16"

  @classmethod
  def load(cls, name_or_path: str | Path) -> "TimeTable":
    """A table the package ships, by name (`NVIDIA_H200_mosaic`, see `shipped_tables`), or a
    JSON file of the kernel benchmark."""
    shipped = shipped_tables()
    if str(name_or_path) in shipped:
      return cls.from_json(shipped[str(name_or_path)])
    if not Path(name_or_path).is_file():
      raise ValueError(f"time table {str(name_or_path)!r} is neither a shipped table "
                       f"({', '.join(shipped) or 'none found'}) nor an existing file")
    return cls.from_json(name_or_path)

  @classmethod
  def from_json(cls, path: str | Path) -> "TimeTable":
    path = Path(path)
    try:
      d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
      raise ValueError(f"time table {path}: cannot read ({e})") from e
    return cls.from_dict(d, str(path))

  @classmethod
  def from_dict(cls, d: dict, source: str = "time table") -> "TimeTable":
    need = ("heads", "kv_heads", "head_dim", "q", "kv", "fwd_ms", "fwdbwd_ms")
    missing = [k for k in need if k not in d]
    if missing:
      raise ValueError(f"{source}: missing keys {missing}")
    q = np.asarray(d["q"], np.float64)
    kv = np.asarray(d["kv"], np.float64)
    try:  # null (q > kv, or not measured) becomes NaN
      fwd = np.array(d["fwd_ms"], dtype=np.float64)
      fb = np.array(d["fwdbwd_ms"], dtype=np.float64)
    except (TypeError, ValueError) as e:
      raise ValueError(f"{source}: fwd_ms / fwdbwd_ms must be rectangular lists of numbers or null ({e})") from e
    if q.ndim != 1 or kv.ndim != 1 or q.size < 2 or kv.size < 2:
      raise ValueError(f"{source}: q and kv must be lists of at least 2 grid points")
    if (np.diff(q) <= 0).any() or (np.diff(kv) <= 0).any():
      raise ValueError(f"{source}: q and kv grid points must be strictly increasing")
    for name, a in (("fwd_ms", fwd), ("fwdbwd_ms", fb)):
      if a.shape != (q.size, kv.size):
        raise ValueError(f"{source}: {name} has shape {a.shape}, expected {(q.size, kv.size)}")
      valid = a[np.isfinite(a)]
      if valid.size == 0:
        raise ValueError(f"{source}: {name} has no measured entry")
      if (valid < 0).any():
        raise ValueError(f"{source}: {name} has negative times")
    return cls(q=q, kv=kv, fwd=fwd, fwdbwd=fb, heads=int(d["heads"]), kv_heads=int(d["kv_heads"]),
               head_dim=int(d["head_dim"]), device=str(d.get("device", "")),
               dtype=str(d.get("dtype", "bfloat16")))

  def fwd_ms(self, q, kv):
    return self._interp(self.fwd, q, kv)

  def fwdbwd_ms(self, q, kv):
    return self._interp(self.fwdbwd, q, kv)

  def _interp(self, grid, q, kv):
    # Bilinear interpolation of the *time per query-key pair* (inverse throughput), then times the
    # task's exact causal area. Time itself is quadratic in q along the diagonal and a grid cell
    # that crosses q = kv mixes causal and impossible shapes; throughput varies slowly across the
    # grid, so this is exact at grid points, exact everywhere for a constant-throughput kernel,
    # and extrapolates beyond the grid by area at the edge's throughput.
    q = np.asarray(q, np.float64)
    kv = np.maximum(np.asarray(kv, np.float64), q)
    per_pair = self._per_pair(grid)
    qc = np.clip(q, self.q[0], self.q[-1])
    kc = np.clip(kv, self.kv[0], self.kv[-1])
    i = np.clip(np.searchsorted(self.q, qc, side="right") - 1, 0, self.q.size - 2)
    j = np.clip(np.searchsorted(self.kv, kc, side="right") - 1, 0, self.kv.size - 2)
    tq = (qc - self.q[i]) / (self.q[i + 1] - self.q[i])
    tk = (kc - self.kv[j]) / (self.kv[j + 1] - self.kv[j])
    r = ((1 - tq) * (1 - tk) * per_pair[i, j] + tq * (1 - tk) * per_pair[i + 1, j]
         + (1 - tq) * tk * per_pair[i, j + 1] + tq * tk * per_pair[i + 1, j + 1])
    return np.where(q <= 0, 0.0, r * causal_area(q, kv))

  def _per_pair(self, grid):
    """ms per query-key pair on the grid, missing entries filled (see the class docstring)."""
    qg, kg = np.meshgrid(self.q, self.kv, indexing="ij")
    per = grid / np.maximum(causal_area(qg, np.maximum(kg, qg)), 1e-9)
    if np.isfinite(per).all():
      return per
    per = per.copy()
    fallback = float(np.nanmedian(per))
    for i in range(per.shape[0]):
      row = per[i]
      ok = np.flatnonzero(np.isfinite(row))
      if ok.size == 0:
        row[:] = fallback
        continue
      # Nearest valid column; columns left of the first valid one (q > kv) take that one.
      idx = np.searchsorted(ok, np.arange(row.size)).clip(0, ok.size - 1)
      left = ok[np.maximum(idx - 1, 0)]
      right = ok[idx]
      cols = np.arange(row.size)
      pick = np.where(np.abs(cols - left) < np.abs(right - cols), left, right)
      row[:] = np.where(np.isfinite(row), row, row[pick])
    return per

  def rescaled(self, heads: int) -> "TimeTable":
    """The table for `heads` query heads (time scales linearly with heads at fixed shapes)."""
    f = heads / self.heads
    return dataclasses.replace(self, fwd=self.fwd * f, fwdbwd=self.fwdbwd * f, heads=heads,
                               kv_heads=max(1, round(self.kv_heads * f)))
