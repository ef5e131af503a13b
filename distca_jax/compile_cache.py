"""JAX's persistent compilation cache, turned on for a directory.

Its own module so that both the launchers' environment (`launch_env`) and the training loop
(`train.loop`, for `train.compile_cache_dir`) import it one way, without importing each other.
"""

from __future__ import annotations


def enable_compile_cache(directory: str, min_compile_s: float = 0.0) -> None:
  """Turns on JAX's persistent compilation cache in `directory`: a restarted or resumed run (and
  every process of a multi-host job that shares the directory) loads the step's executable
  instead of compiling it again. Safe to call after jax has started; entries are keyed by the
  program, the jax/XLA versions and the flags, so a stale entry is never used."""
  import jax

  jax.config.update("jax_compilation_cache_dir", str(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  try:
    # The cache is set up once, at the first compilation; re-read the settings now.
    from jax._src import compilation_cache

    compilation_cache.reset_cache()
  except Exception:  # private API moved: the settings apply from the next process on
    pass
