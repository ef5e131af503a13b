"""distca-jax: core attention disaggregation for long-context LLM training in JAX."""

__version__ = "0.1.0"
