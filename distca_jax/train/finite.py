"""The guard that keeps a NaN or Inf out of the run and its checkpoints.

The jitted step returns three scalars: `loss`, `grads_finite` and `state_finite` (one fused
`isfinite` reduction over the updated parameters and optimizer moments, `step.Trainer`). The loop
checks them before anything of the step is logged as done or saved; only when one is false does
`first_nonfinite_leaf` look for the leaf to name (a per-leaf reduction, on the error path only).
Resume uses `all_finite` to pass over a checkpoint that holds a non-finite state.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class NonFiniteError(FloatingPointError):
  """Loss, gradients or the updated state became NaN/Inf; the message names the step and the
  quantity (and for the state its first non-finite leaf)."""


def check_step(step: int, m, state=None) -> None:
  """Raises NonFiniteError if step `step` (0-based) made the loss, the gradients or (`state`, the
  step's result, flagged by the step's `state_finite` scalar) the state non-finite. `m`: the
  step's metrics on the host."""
  if not math.isfinite(float(m["loss"])):
    raise NonFiniteError(f"step {step + 1}: loss is {float(m['loss'])}")
  if not bool(m["grads_finite"]):
    raise NonFiniteError(f"step {step + 1}: gradients contain NaN or Inf (grad_norm={float(m['grad_norm'])})")
  if state is not None and not bool(m.get("state_finite", True)):
    leaf = first_nonfinite_leaf(state) or "?"
    what = "optimizer state" if leaf.startswith("opt_state") else "parameters"
    raise NonFiniteError(
        f"step {step + 1}: the update made the {what} non-finite (first: {leaf}; "
        f"lr={float(m['lr']):.4g}, grad_norm={float(m['grad_norm']):.4g}); not saved")


def leaf_name(path) -> str:
  """`opt_state/0/mu/w` for a pytree key path (attribute, dict and sequence keys alike)."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def tree_all_finite(tree) -> jax.Array:
  """A scalar: whether every float array of `tree` is finite. Traceable (the step fuses it)."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.bool_(True)


@jax.jit
def _finite_flags(leaves):
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def _float_leaves(tree) -> list[tuple[Any, Any]]:
  return [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
          if jnp.issubdtype(x.dtype, jnp.inexact)]


def all_finite(tree) -> bool:
  """Whether every float array of `tree` is finite (one jitted reduction, replicated result)."""
  return first_nonfinite_leaf(tree) is None


def first_nonfinite_leaf(tree) -> str | None:
  """The path (`params/blocks/0/attn/wq/value`) of the first float array of `tree` holding a NaN
  or Inf, None if all are finite. A training state's leaves read `params/...`, `opt_state/...`."""
  named = _float_leaves(tree)
  if not named:
    return None
  flags = np.asarray(jax.device_get(_finite_flags([x for _, x in named])))
  for (path, _), ok in zip(named, flags):
    if not ok:
      return leaf_name(path)
  return None
