"""The host's work for a step, on a background thread a step ahead of the devices.

`host_item` is what the prefetch thread produces for a step: its batch (a process reads only the
buffers its devices hold), the attention context (CAD's plans and the gate's choice, the
colocated windows, the pipeline's ticks, the WLB-style re-packing, each micro-batch's with
gradient accumulation), the per-device attention loads, the step's capacities and the digest the
processes compare before the step runs. `size_shapes` plans a run's first steps ahead so the
step compiles once per kind of context.
"""

from __future__ import annotations

import queue
import threading
import time

import jax
import numpy as np

from distca_jax import attention as attention_lib
from distca_jax import mesh as mesh_lib
from distca_jax.train import accumulate, agreement
from distca_jax.train import profile as profile_lib

# `job` below: a `train.job.Job` (which imports this module, so it is not imported here).


class Prefetcher:
  """Produces (step, *`make_item(step)`) on a background thread, `depth` steps ahead."""

  def __init__(self, make_item, first_step: int, last_step: int, depth: int = 2):
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self.host_seconds = 0.0

    def work():
      for step in range(first_step, last_step):
        if self._stop.is_set():
          return
        t0 = time.perf_counter()
        try:
          item = (step, *make_item(step))
        except BaseException as e:  # surfaced in the training thread
          self._queue.put(e)
          return
        self.host_seconds += time.perf_counter() - t0
        self._queue.put(item)

    self._thread = threading.Thread(target=work, daemon=True, name="distca-prefetch")
    self._thread.start()

  def get(self):
    item = self._queue.get()
    if isinstance(item, BaseException):
      raise item
    return item

  def close(self):
    self._stop.set()
    while not self._queue.empty():
      self._queue.get_nowait()


def host_item(job, step: int):
  """(batch, attention context, (load before, load after), capacities, digest) of `step`: the
  host's work, on the prefetch thread. The digest (None with one process) is what the processes
  compare before the step runs (`agreement.check_agreement`)."""
  batch, ctx, loads, sizes = host_work(job, step)
  digest = None
  if jax.process_count() > 1:
    # Accumulating: one digest per micro-batch (each has its gate's choice), combined.
    pairs = (zip(ctx.micro, ctx.contexts) if job.trainer.accumulates else [(batch, ctx)])
    digest = np.bitwise_xor.reduce([agreement.step_digest(step, sizes, b, x) for b, x in pairs])
  return batch, ctx, loads, sizes, digest


def host_work(job, step: int, report: bool = True):
  """(batch, attention context, (load before, load after), capacities) of `step`; without
  `report`, the loads are not computed (None)."""
  c, trainer, shape, shapes = job.config, job.trainer, job.trainer.shape, job.shapes
  rows = mesh_lib.local_rows(job.mesh)  # each process checks the plans of the rows it feeds
  if trainer.pipeline is not None:
    from distca_jax.train import pipeline_host

    m = c.train.microbatches
    # Tokens are sharded over `data` only: a process reads its data ranks' buffers of each
    # micro-batch (every stage of them), never the whole batch.
    data_rows = None if rows is None else np.unique(rows % job.mesh.shape["data"])
    mbs = [job.source.batch(step * m + i, data_rows) for i in range(m)]
    ctx = pipeline_host.host_context(c.attention, mbs, job.mesh.shape["pipe"], shape, rows, shapes)
    batch = ctx.as_batch()
    ctx.device_inputs(batch)  # what the step reads is built here, as `_plan` does
    return batch, ctx, ctx.attention_loads(), dict(shapes.sizes)
  if c.data.packing == "wlb":  # the WLB-LLM baseline: the step's documents re-packed
    from distca_jax import wlb_attention

    # This process's buffers of the in-order batch give the stream its re-packed rows read from.
    return (*wlb_attention.host_item(c, job.source.batch(step, rows), shape,
                                     job.mesh.shape["tensor"], shapes, rows), dict(shapes.sizes))
  if trainer.accumulates:  # K micro-batches, each planned and gated as a step is
    m = c.train.microbatches
    parts = [_plan(job, job.source.batch(step * m + i, rows), rows, report) for i in range(m)]
    ctx = accumulate.MicroBatches(*map(tuple, zip(*parts)))
    return ctx.as_batch(), ctx, ctx.attention_loads() if report else None, dict(shapes.sizes)
  batch = job.source.batch(step, rows)  # only this process's buffers: its host work is its rows'
  return (*_plan(job, batch, rows, report), dict(shapes.sizes))  # the capacities as of this step


def _plan(job, batch, rows, report: bool = True):
  """(batch, attention context, (load before, load after), or None without `report`) of one
  batch."""
  c, shape = job.config, job.trainer.shape
  ctx = attention_lib.host_context(c.attention, batch, shape, rows, shapes=job.shapes)
  # A source's batch builds its arrays when first read (`sources.Batch.deferred`): those the
  # step reads (not the batch's own when it runs as ping-pong's halves) are built here, on this
  # thread, not on the training thread's way to the devices.
  ctx.device_inputs(batch)
  loads = profile_lib.attention_loads(ctx, batch.layout, shape, c.attention,
                                      tensor_parallel=job.mesh.shape["tensor"],
                                      plan_after=c.train.imbalance_after) if report else None
  return batch, ctx, loads


def size_shapes(job, log) -> None:
  """Plans the run's next `train.shape_steps` steps on the host (their batches, CAD's plans and
  gate, the colocated windows) and keeps the capacities they need in `job.shapes`, so the step
  compiles once per kind of context at sizes that hold them, instead of again each time a
  step needs a larger capacity than the steps before it."""
  steps = range(job.start_step, min(job.last_step, job.start_step + job.config.train.shape_steps))
  if not steps:
    return
  t0 = time.perf_counter()
  for step in steps:
    host_work(job, step, report=False)
  job.shapes.count_from_here()
  if job.main:
    # Not "step ...": a log line that starts so is a step's record.
    log(f"sized the step's capacities from the plans of steps {steps.start + 1}-{steps.stop} "
        f"({time.perf_counter() - t0:.1f}s, train.shape_steps={job.config.train.shape_steps})")
