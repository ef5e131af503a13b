"""The host side of a step that accumulates gradients over micro-batches (`train.microbatches=K`
without a pipeline; the device side is `Trainer.accumulate_step`).

Micro-batch i of step s is the source's batch s * K + i: `data` buffers whose documents never
cross into another micro-batch. Each is planned and gated on its own, as a step is (its attention
context, its CAD plan or the colocated tables). `MicroBatches` holds them and answers what the
loop reads of a step's context (`attention.StepContext`: whether CAD ran, its plans, its
predicted saving) and of its loads, over the whole step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from distca_jax.data.sources import Batch
from distca_jax.train.metrics import attention_load_per_device, imbalance
from distca_jax.train.pipeline_host import tick_layout


def target_tokens(layout) -> int:
  """Real next-token targets of a batch (its loss_mask's sum), from its layout alone: a
  document of L tokens has L - 1. The layout is global, so a process that holds only some rows
  counts the whole batch."""
  return int(np.sum(np.maximum(np.asarray(layout.doc_lens, np.int64) - 1, 0)))


@dataclasses.dataclass(frozen=True)
class MicroBatches:
  """A step's micro-batches: each one's batch, attention context and (before, after) loads."""

  micro: tuple[Batch, ...]
  contexts: tuple[Any, ...]
  loads: tuple[tuple[np.ndarray, np.ndarray | None], ...]

  @property
  def cad(self) -> bool:
    """Whether CAD ran on any micro-batch (the gate decides each on its own)."""
    return any(c.cad for c in self.contexts)

  @property
  def cad_share(self) -> float:
    """The share of the step's micro-batches CAD ran on."""
    return float(np.mean([c.cad for c in self.contexts]))

  @property
  def plans(self) -> tuple:
    return tuple(p for c in self.contexts for p in getattr(c, "plans", ()))

  @property
  def predicted_saving(self) -> float:
    """What the gate predicted CAD saves, the mean over the micro-batches it ran on."""
    return float(np.mean([c.predicted_saving for c in self.contexts if c.cad]))

  @property
  def batches(self) -> tuple:
    """The nano-batches (streams) of a micro-batch CAD ran on."""
    return next(c.batches for c in self.contexts if c.cad)

  @property
  def capacities(self):
    """The run's exchange capacities as of the step's last micro-batch CAD ran on."""
    return [c.capacities for c in self.contexts if c.cad][-1]

  @property
  def step_tokens(self) -> int:
    """Real targets of the whole step: every micro-batch's loss is divided by these."""
    return sum(target_tokens(b.layout) for b in self.micro)

  def attention_loads(self) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-device attention area summed over the micro-batches, before and after scheduling
    (after: None unless every micro-batch has one)."""
    before = sum(np.asarray(b, np.float64) for b, _ in self.loads)
    afters = [a for _, a in self.loads]
    after = None if any(a is None for a in afters) else sum(np.asarray(a, np.float64) for a in afters)
    return before, after

  def imbalance(self) -> tuple[float, float]:
    """Attention imbalance (max / mean over devices) before and after scheduling: the mean over
    micro-batches of each one's (each waits for its slowest device)."""
    before = [imbalance(attention_load_per_device(b.layout)) for b in self.micro]
    after = [imbalance(np.asarray(a)) if a is not None else bi
             for (_, a), bi in zip(self.loads, before)]
    return float(np.mean(before)), float(np.mean(after))

  def as_batch(self) -> Batch:
    """The step's micro-batches as one batch of K x data buffers, micro-batch i's on buffers
    i * data .. (for token and FLOP counts; the devices never see it)."""
    N, T = self.micro[0].layout.num_buffers, self.micro[0].layout.buffer_len
    cat = lambda name: np.concatenate([getattr(b, name) for b in self.micro])
    return Batch(tokens=cat("tokens"), targets=cat("targets"), loss_mask=cat("loss_mask"),
                 segment_ids=cat("segment_ids"), positions=cat("positions"),
                 layout=tick_layout([b.layout for b in self.micro], N, T))
