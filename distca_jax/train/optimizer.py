"""AdamW with linear warm-up, cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax


def lr_schedule(optim_config, total_steps: int) -> optax.Schedule:
  o = optim_config
  decay = o.decay_steps or total_steps
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
      decay_steps=max(decay, o.warmup_steps + 1), end_value=o.lr * o.min_lr_ratio)


def make_optimizer(optim_config, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Clip, then AdamW. Weight decay applies to matrices only (not norms' scales)."""
  o = optim_config
  schedule = lr_schedule(o, total_steps)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  tx = optax.chain(
      optax.clip_by_global_norm(o.clip_norm),
      optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=decay_mask),
  )
  return tx, schedule
