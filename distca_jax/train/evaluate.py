"""Held-out evaluation: loss, perplexity and loss by token position, forward only.

A context-extension run needs to see, while it trains, whether the model uses its longer
context: the held-out loss of tokens far into their documents falls only if it does. The
evaluation runs the training step's model on the same mesh and the same attention path (a CAD
run's eval batches are planned as its training batches are, gate included), so what it measures
is the model being trained, not a re-implementation of it.

The held-out batches (`eval.batches` global batches of the training step's shape, from the data
source machinery with a seed of their own, `eval_data_config`) are drawn, planned and placed once
when the run starts, every one at one shape (their own `StepShapes`, sized in a first pass), so
every evaluation reads the same tokens and the forward step compiles once per kind of context.

A token's loss is binned by its in-document position (`eval.buckets`): the loss per bucket is the
mean over the bucket's tokens, so the buckets' losses weighted by their token counts give the
total.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from distca_jax import attention as attention_lib
from distca_jax.models.llama import AUTO_ORDER, join_streams
from distca_jax.schedule.capacities import StepShapes
from distca_jax.train.loss import bucketed_cross_entropy

# The default position buckets' starts for a 128K-token context (ProLong's view of a
# context-extension run: short, medium, long, the trained length, beyond it).
DEFAULT_BUCKETS = (4096, 16384, 65536, 131072)
DEFAULT_CONTEXT = 131072


def eval_data_config(config):
  """The `DataConfig` of the held-out batches: the training data's with `eval.seed` (default
  data.seed + 1), the source and its distribution or corpus as `eval.source` says."""
  e, d = config.eval, config.data
  seed = (d.seed + 1) % 2**32 if e.seed is None else e.seed
  # A held-out distribution or corpus replaces the training mixture, if any; `data` keeps it
  # (each mixture source's seed derives from data.seed, so the draws are held out too).
  if e.source == "synthetic":
    return dataclasses.replace(d, source="synthetic", seed=seed, mixture=(),
                               distribution=e.distribution or d.distribution)
  if e.source == "corpus":
    return dataclasses.replace(d, source="corpus", seed=seed, corpus_tokens=e.corpus_tokens,
                               corpus_offsets=e.corpus_offsets, mixture=())
  return dataclasses.replace(d, seed=seed)


def default_buckets(context: int) -> tuple[int, ...]:
  """`DEFAULT_BUCKETS` for a run whose documents reach `context` tokens: as they are from 128K
  up, scaled by context / 128K below it (a 16K run's are 512, 2K, 8K, 16K)."""
  scale = min(1.0, context / DEFAULT_CONTEXT)
  starts = sorted({max(1, int(round(b * scale))) for b in DEFAULT_BUCKETS})
  return tuple(starts)


def bucket_starts(config, num_buffers: int) -> tuple[int, ...]:
  """`eval.buckets`, or the default for the run's context: a document reaches at most one
  global batch (data ranks x tokens_per_device), and `data.max_doc_len` where that is set."""
  if config.eval.buckets is not None:
    return tuple(config.eval.buckets)
  context = num_buffers * config.data.tokens_per_device
  return default_buckets(min(context, config.data.max_doc_len or context))


def bucket_names(starts: tuple[int, ...]) -> list[str]:
  """"0-4K", "4K-16K", ..., "128K+": each bucket's positions."""
  edges = (0, *starts)
  return [f"{_short(lo)}-{_short(hi)}" for lo, hi in zip(edges, edges[1:])] + [f"{_short(edges[-1])}+"]


def _short(n: int) -> str:
  return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)


@dataclasses.dataclass(frozen=True)
class EvalResult:
  """One evaluation: the mean loss over the held-out batches' real tokens, its perplexity, and
  per position bucket the mean loss (None: no token there) and the token count."""

  step: int
  loss: float
  perplexity: float
  tokens: int
  buckets: list[str]
  bucket_loss: list[float | None]
  bucket_tokens: list[int]
  batches: int
  cad_batches: int          # of them, batches that ran CAD's exchange (the gate's choice)
  seconds: float

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def scalars(self) -> dict[str, float]:
    """The TensorBoard scalars: loss, perplexity, and the loss of each bucket with tokens."""
    out = {"loss": self.loss, "perplexity": self.perplexity}
    out.update({f"loss_pos_{name}": loss for name, loss in zip(self.buckets, self.bucket_loss)
                if loss is not None})
    return out

  def line(self) -> str:
    """One line: loss, perplexity, loss per position bucket."""
    parts = [f"{name} {loss:.4f}" for name, loss in zip(self.buckets, self.bucket_loss)
             if loss is not None]
    return (f"eval at step {self.step}: loss {self.loss:.4f} (perplexity {self.perplexity:.2f}) "
            f"on {self.tokens:,} held-out tokens; by position " + ", ".join(parts))


class Evaluator:
  """The held-out batches of a run, planned and placed, and the jitted forward step that
  evaluates parameters on them.

  `trainer`: the run's `Trainer` (mesh, model graph, attention, the attention config with the
  gate's resolved costs); `source`: the held-out source (`eval_data_config`); `rows`: the buffers
  this process feeds (`mesh.local_rows`)."""

  def __init__(self, trainer, source, batches: int, starts: tuple[int, ...], rows=None):
    self.trainer, self.starts = trainer, tuple(starts)
    self.names = bucket_names(self.starts)
    attention = trainer.config.attention
    held_out = [source.batch(i, rows) for i in range(batches)]
    shapes = StepShapes()
    plan = lambda b: attention_lib.host_context(attention, b, trainer.shape, rows, shapes=shapes)
    for batch in held_out:  # sizes `shapes` to the largest any batch needs
      plan(batch)
    contexts = [plan(b) for b in held_out]  # every batch at those sizes
    self.cad_batches = sum(bool(c.cad) for c in contexts)
    self.inputs = [trainer.put_batch(b, c) for b, c in zip(held_out, contexts)]
    replicated = NamedSharding(trainer.mesh, P())
    self._fn = jax.jit(self.sums, out_shardings=(replicated, replicated))

  def sums(self, params, arrays, ctx):
    """Per position bucket, the summed loss and the real-token count of one batch ([buckets]
    fp32 each): the forward of `Trainer.loss_fn` without its mean."""
    trainer = self.trainer
    model = nnx.merge(trainer.graphdef, params)
    model.remat = trainer.remat or AUTO_ORDER[0]  # forward only: no remat happens
    h = model(arrays["tokens"], arrays["positions"], ctx)  # ping-pong's streams joined along T
    starts = jnp.asarray(self.starts, jnp.int32)
    bucket = jnp.searchsorted(starts, join_streams(arrays["positions"]), side="right")
    return bucketed_cross_entropy(h, model.head_weight(), join_streams(arrays["targets"]),
                                  join_streams(arrays["loss_mask"]), bucket.astype(jnp.int32),
                                  len(self.starts) + 1)

  def __call__(self, params, step: int) -> EvalResult:
    """The held-out loss of `params` (the state after `step` steps)."""
    t0 = time.perf_counter()
    sums = counts = 0.0
    for arrays, ctx in self.inputs:
      s, c = jax.device_get(self._fn(params, arrays, ctx))
      sums, counts = sums + np.asarray(s, np.float64), counts + np.asarray(c, np.float64)
    tokens = float(np.sum(counts))
    loss = float(np.sum(sums) / max(tokens, 1.0))
    return EvalResult(
        step=step, loss=loss, perplexity=math.exp(min(loss, 700.0)), tokens=int(tokens),
        buckets=list(self.names),
        bucket_loss=[float(s / c) if c else None for s, c in zip(sums, counts)],
        bucket_tokens=[int(c) for c in counts], batches=len(self.inputs),
        cad_batches=self.cad_batches, seconds=time.perf_counter() - t0)

  def compile_count(self) -> int:
    return self._fn._cache_size()


def make_evaluator(config, trainer, make_source, rows=None) -> Evaluator | None:
  """The run's `Evaluator` (None: `eval.batches` is 0). `make_source(data_config, num_buffers)`
  builds a data source (the trainer's `make_source`)."""
  n = config.eval.batches
  if not n:
    return None
  data = trainer.mesh.shape["data"]
  source = make_source(dataclasses.replace(config, data=eval_data_config(config)), data)
  return Evaluator(trainer, source, n, bucket_starts(config, data), rows)


def due(step: int, every: int, last_step: int) -> bool:
  """Whether the state after `step` steps is evaluated: every `every` steps, and at the run's
  last step."""
  return step == last_step or (every > 0 and step % every == 0)


def restore_params(trainer, checkpoint_dir, step: int | None = None,
                   init: bool = False) -> tuple[Any, int]:
  """(parameters, their step) of checkpoint `step` (default: the newest) in `checkpoint_dir`,
  read into the trainer's shardings and pipeline layout whatever the layout they were saved
  with; with `init`, the run's starting parameters (`model.init_from`, step 0): the pretrained
  model's loss by position, to compare the trained one with. The one place an evaluation gets
  its parameters. Raises the checkpoint errors (none there, another model)."""
  from distca_jax.train.checkpoint import Checkpointer
  from distca_jax.train.resume import restore_any_layout

  if init:
    if trainer.config.model.init_from is None:
      from distca_jax.config import ConfigError

      raise ConfigError("model.init_from: unset, so the run has no starting checkpoint to "
                        "evaluate (--init)")
    return trainer.load_params(trainer.config.model.init_from), 0

  with Checkpointer(checkpoint_dir, save_every=1, keep=1, read_only=True) as checkpointer:
    state, extra = restore_any_layout(checkpointer, trainer, trainer.abstract_state(),
                                      {"model": trainer.shape.record()}, step=step)
  return state.params, int(extra["step"])


def document_logits(config, tokens: np.ndarray, paths) -> list[np.ndarray]:
  """The logits [T, V] of one document, `tokens`, from the parameters at each of `paths` (a run's
  checkpoint or an imported one: `Trainer.load_params`; all of `config.model`'s shape), on one
  device and compiled once: what a reference implementation's logits are compared against."""
  from distca_jax import mesh as mesh_lib
  from distca_jax.data.sources import make_batch
  from distca_jax.train.step import Trainer

  trainer = Trainer(config, mesh_lib.make_mesh(config.mesh, jax.devices()[:1]))
  batch = make_batch(np.array([len(tokens)]), tokens, 1, len(tokens))
  arrays, ctx = trainer.put_batch(batch, attention_lib.host_context(config.attention, batch,
                                                                    trainer.shape))

  @jax.jit
  def logits(params, arrays, ctx):
    model = nnx.merge(trainer.graphdef, params)
    return model(arrays["tokens"], arrays["positions"], ctx)[0] @ model.head_weight()

  return [np.asarray(logits(trainer.load_params(str(p)), arrays, ctx)) for p in paths]
