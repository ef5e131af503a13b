"""The training loop: data prefetch, jitted steps, metrics, TensorBoard, checkpoints, summary.

Host work for step k+1 (sampling documents, packing, the attention context — for CAD the
scheduler's plan) runs in a background thread while the devices run step k; `host_wait_s` in the
summary is the total time the loop waited for it (0 means the host never stalled the devices).
"""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from distca_jax import attention as attention_lib
from distca_jax import mesh as mesh_lib
from distca_jax.config import Config, to_dict
from distca_jax.models.presets import resolve
from distca_jax.train import metrics as metrics_lib
from distca_jax.train.step import Trainer


class NonFiniteError(FloatingPointError):
  """Loss or gradients became NaN/Inf; the message names the step and the quantity."""


@dataclasses.dataclass
class Summary:
  steps: int
  losses: list[float]
  step_times_s: list[float]
  compile_s: float
  compile_count: int
  tokens_per_s: float
  mfu: float | None
  host_wait_s: float
  attention_imbalance: float
  devices: int
  mesh_shape: dict[str, int]

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def make_source(config: Config, num_buffers: int):
  shape = resolve(config.model)
  if config.data.source == "corpus":
    from distca_jax.data.corpus import corpus_from_config

    return corpus_from_config(config.data, num_buffers, vocab_size=shape.vocab_size)
  from distca_jax.data.sources import synthetic_from_config

  return synthetic_from_config(config.data, shape.vocab_size, num_buffers)


class Prefetcher:
  """Produces (step, batch, attention context) on a background thread, `depth` steps ahead."""

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


def run(config: Config, *, devices=None, log=print) -> Summary:
  """Trains for `config.train.steps` steps (resuming from the latest checkpoint if any)."""
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  shape = resolve(config.model)
  num_buffers = mesh.shape["data"]
  trainer = Trainer(config, mesh)
  source = make_source(config, num_buffers)
  out_dir = Path(config.train.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "config.json").write_text(json.dumps(to_dict(config), indent=2))

  t0 = time.perf_counter()
  state = trainer.init_state(config.train.seed)
  start_step = 0
  checkpointer = None
  if config.checkpoint.every > 0:
    from distca_jax.train.checkpoint import Checkpointer

    checkpointer = Checkpointer(config.checkpoint.dir or str(out_dir / "checkpoints"),
                                save_every=config.checkpoint.every, keep=config.checkpoint.keep)
    if config.checkpoint.resume and checkpointer.latest_step() is not None:
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
      state, extra = checkpointer.restore(abstract_state=abstract,
                                          expect={"model": dataclasses.asdict(shape)})
      start_step = int(extra["step"])
      log(f"resumed from checkpoint at step {start_step}")
  init_s = time.perf_counter() - t0

  def make_item(step):
    batch = source.batch(step)
    return batch, attention_lib.host_context(config.attention, batch, shape)

  device_kind = mesh.devices.flat[0].device_kind
  peak = metrics_lib.peak_flops_per_device(device_kind, config.train.peak_tflops)
  writer = _tensorboard(out_dir, config.train.tensorboard)
  bar = _progress(config.train.progress, start_step, config.train.steps)
  prefetch = Prefetcher(make_item, start_step, config.train.steps)
  losses, times, flops_done, tokens_done = [], [], 0.0, 0.0
  host_wait = 0.0
  compile_s = 0.0
  imbalances = []
  run_start = time.perf_counter()
  try:
    for _ in range(start_step, config.train.steps):
      t_wait = time.perf_counter()
      step, batch, ctx = prefetch.get()
      host_wait += time.perf_counter() - t_wait if step > start_step else 0.0
      t_step = time.perf_counter()
      arrays, ctx_dev = trainer.put_batch(batch, ctx)
      compiles_before = trainer.compile_count()
      state, m = trainer.step(state, arrays, ctx_dev)
      m = jax.device_get(m)
      dt = time.perf_counter() - t_step
      if trainer.compile_count() != compiles_before:
        compile_s += dt  # this step's time is dominated by compilation
      else:
        times.append(dt)
      _check_finite(step, m)
      loss = float(m["loss"])
      losses.append(loss)
      flops = metrics_lib.step_flops(shape, batch.layout)
      imb = metrics_lib.imbalance(metrics_lib.attention_load_per_device(batch.layout))
      imbalances.append(imb)
      record = {"loss": loss, "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
                "tokens_per_s": float(m["tokens"]) / dt, "attention_imbalance": imb,
                "compile_count": trainer.compile_count()}
      if peak is not None:
        record["mfu"] = flops / dt / (peak * mesh.size)
      if trainer.compile_count() == compiles_before:
        flops_done += flops
        tokens_done += float(m["tokens"])
      if writer is not None and (step % config.train.log_every == 0):
        for key, value in record.items():
          writer.add_scalar(f"train/{key}", value, step + 1)
      if bar is not None:
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        bar.update(1)
      elif step % config.train.log_every == 0:
        log(f"step {step + 1}: " + " ".join(f"{k}={v:.4g}" for k, v in record.items()))
      if checkpointer is not None:
        checkpointer.maybe_save(step + 1, state, {"step": step + 1, "model": dataclasses.asdict(shape)})
      if config.train.max_seconds is not None and time.perf_counter() - run_start > config.train.max_seconds:
        log(f"stopping at step {step + 1}: train.max_seconds={config.train.max_seconds} reached")
        break
  finally:
    prefetch.close()
    if bar is not None:
      bar.close()
    if checkpointer is not None:
      checkpointer.wait()
      checkpointer.close()
    if writer is not None:
      writer.close()

  steady = sum(times)
  summary = Summary(
      steps=len(losses), losses=losses, step_times_s=times, compile_s=compile_s + init_s,
      compile_count=trainer.compile_count(),
      tokens_per_s=tokens_done / steady if steady else float("nan"),
      mfu=(flops_done / steady / (peak * mesh.size)) if (peak and steady) else None,
      host_wait_s=host_wait, attention_imbalance=float(np.mean(imbalances)) if imbalances else 1.0,
      devices=mesh.size, mesh_shape=dict(mesh.shape))
  (out_dir / "summary.json").write_text(json.dumps(summary.as_dict(), indent=2))
  return summary


def _check_finite(step: int, m) -> None:
  if not math.isfinite(float(m["loss"])):
    raise NonFiniteError(f"step {step + 1}: loss is {float(m['loss'])}")
  if not bool(m["grads_finite"]):
    raise NonFiniteError(f"step {step + 1}: gradients contain NaN or Inf (grad_norm={float(m['grad_norm'])})")


def _tensorboard(out_dir: Path, enabled: bool):
  if not enabled:
    return None
  from tensorboardX import SummaryWriter

  return SummaryWriter(str(out_dir / "tb"))


def _progress(enabled: bool, start: int, total: int):
  if not enabled:
    return None
  from tqdm import tqdm

  return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)


def format_summary(s: Summary) -> str:
  med = float(np.median(s.step_times_s)) if s.step_times_s else float("nan")
  lines = [
      f"devices {s.devices} mesh {s.mesh_shape}; steps {s.steps}; compiled {s.compile_count}x",
      f"loss {s.losses[0]:.4f} -> {s.losses[-1]:.4f}" if s.losses else "no steps run",
      f"compile+init {s.compile_s:.1f}s; median step {med * 1e3:.1f} ms; {s.tokens_per_s:,.0f} tokens/s",
      f"MFU {s.mfu * 100:.1f}%" if s.mfu is not None else "MFU n/a (unknown peak: set train.peak_tflops)",
      f"attention imbalance (max/mean, colocated layout) {s.attention_imbalance:.2f}; host wait {s.host_wait_s:.2f}s",
  ]
  return "\n".join(lines)
