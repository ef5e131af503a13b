"""Fitting the step gate's cost profile to measured steps, and reading training logs for it.

`fit_step_costs` fits the three costs (`attention.gate_*`) to measured step times (least
squares; the measurements ship as data, `gate_fit.json`, `gate.measured_batches`);
`fit_kernel_cost` fits one kernel's attention time per FLOP from training-step logs
(`read_step_log`); `launch/fit_gate.py` is the command that plans the measured batches, prints
both, and writes the profile a run loads. Numpy only.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np


@dataclasses.dataclass(frozen=True)
class FitBatch:
  """One measured batch, as the fit reads it: the two measured step times (ms) and, for the
  slowest device, its matmul FLOPs (3 x forward), its attention FLOPs colocated, the slowest
  server's attention FLOPs after planning, and the busiest device's exchange bytes over the
  step's layers."""

  colocated_ms: float
  distca_ms: float
  linear_flops: float
  attention_flops: float
  planned_flops: float
  exchange_bytes: float


@dataclasses.dataclass(frozen=True)
class StepCostFit:
  """`fit_step_costs`'s result: ms per matmul FLOP and per (effective) attention FLOP, CAD's
  machinery as given and the exchange's overhead (fractions of the matmul time, and ms per
  byte), and per batch the
  fitted colocated step, the measured saving and the net saving predicted by a fit of the
  other batches (leave-one-out), all in ms."""

  ms_per_linear_flop: float
  ms_per_attention_flop: float
  machinery: float
  exchange_fixed: float
  exchange_ms_per_byte: float
  max_residual_ms: float
  fitted_colocated_ms: np.ndarray
  measured_saving_ms: np.ndarray
  leave_one_out_saving_ms: np.ndarray

  @property
  def costs(self) -> dict[str, float]:
    """The costs of a cost profile (`gate.read_profile`), in matmul-FLOP units: the fit's
    kernel's attention cost, the machinery held, the exchange's fixed cost and its cost per
    byte."""
    c_lin = self.ms_per_linear_flop
    return dict(attention_cost=self.ms_per_attention_flop / c_lin,
                machinery=self.machinery, exchange_fixed=self.exchange_fixed,
                exchange_flops_per_byte=self.exchange_ms_per_byte / c_lin)


def fit_step_costs(batches: list[FitBatch], machinery: float = 0.0) -> StepCostFit:
  """The gate's cost model fit to measured batches (least squares, in FLOP units, so batches of
  different model shapes and token counts fit together on one machine kind): colocated ms =
  L x c_lin + A x c_att, L the slowest device's matmul FLOPs and A its attention FLOPs; then CAD's
  overhead, what balancing would ideally save (c_att x (A - planned)) less what was measured,
  = (machinery + fixed) x the matmul ms + b x bytes, with `machinery` held at what one GPU
  measured (launch/bench_train.py --suite overhead) and fixed >= 0."""
  col = np.array([b.colocated_ms for b in batches])
  c_lin, c_att = np.linalg.lstsq(np.array([[b.linear_flops, b.attention_flops] for b in batches]),
                                 col, rcond=None)[0]
  ideal = np.array([c_att * (b.attention_flops - b.planned_flops) for b in batches])
  saved = np.array([b.colocated_ms - b.distca_ms for b in batches])
  lin_ms = np.array([c_lin * b.linear_flops for b in batches])
  X = np.stack([lin_ms, [b.exchange_bytes for b in batches]], axis=1)
  overhead = ideal - saved - machinery * lin_ms
  fixed, per_byte = _fixed_and_per_byte(X, overhead)
  resid = overhead - X @ np.array([fixed, per_byte])
  loo = np.empty(len(batches))
  for i in range(len(batches)):
    keep = np.arange(len(batches)) != i
    fi, bi = _fixed_and_per_byte(X[keep], overhead[keep])
    loo[i] = ideal[i] - (machinery + fi) * lin_ms[i] - bi * batches[i].exchange_bytes
  return StepCostFit(
      ms_per_linear_flop=float(c_lin), ms_per_attention_flop=float(c_att), machinery=machinery,
      exchange_fixed=float(fixed), exchange_ms_per_byte=float(per_byte),
      max_residual_ms=float(np.abs(resid).max()),
      fitted_colocated_ms=lin_ms + c_att * np.array([b.attention_flops for b in batches]),
      measured_saving_ms=saved, leave_one_out_saving_ms=loo)


def _fixed_and_per_byte(X_Bx2, overhead_B) -> tuple[float, float]:
  """Least squares of the overhead on (matmul ms, bytes), the fixed part kept >= 0: where the
  machinery held covers all of it, the bytes alone carry the rest."""
  fixed, per_byte = np.linalg.lstsq(X_Bx2, overhead_B, rcond=None)[0]
  if fixed < 0:
    fixed, per_byte = 0.0, np.linalg.lstsq(X_Bx2[:, 1:], overhead_B, rcond=None)[0][0]
  return float(fixed), float(per_byte)


def fit_kernel_cost(flops_Sx2: np.ndarray, ms_S: np.ndarray) -> tuple[float, float, float]:
  """One kernel's training steps fit as ms = c_lin x matmul FLOPs + c_att x attention FLOPs
  (least squares over S steps, `flops_Sx2` their slowest device's two terms): (c_lin, c_att,
  RMS error in ms). Raises ValueError when the time does not grow with attention FLOPs."""
  coef, *_ = np.linalg.lstsq(flops_Sx2, ms_S, rcond=None)
  if coef[1] <= 0:
    raise ValueError(f"the step time does not grow with attention FLOPs ({coef[1]:.3g} ms per "
                     "FLOP): too few or too alike batches to fit")
  return float(coef[0]), float(coef[1]), float(np.sqrt(np.mean((flops_Sx2 @ coef - ms_S) ** 2)))


# ----------------------------------------------------------------------------- training logs

_LOG_LINE = re.compile(r"^step (\d+): (.*)$")


def read_step_log(path) -> dict[int, dict[str, float]]:
  """A `launch/train.py` log's steps (`step N: key=value ...`, written with
  `train.progress=false`): step -> its logged values; `compiled`: whether the step's compile
  count went up (its time is mostly compilation)."""
  steps, last = {}, 0.0
  for line in open(path):
    m = _LOG_LINE.match(line.strip())
    if not m:
      continue
    values = {k: float(v) for k, v in (kv.split("=", 1) for kv in m.group(2).split())}
    values["compiled"] = float(values.get("compile_count", 0) > last)
    last = values.get("compile_count", last)
    steps[int(m.group(1))] = values
  return steps
