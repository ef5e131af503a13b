"""The at-scale simulator: CAD's scheduler against its baselines on sampled batches.

config.py (typed sweep configuration), engine.py (the step-time model and one batch's systems).
The command line is launch/simulate.py; docs/SIMULATOR.md compares it with the paper.
"""

from distca_jax.sim.config import HardwareConfig, SimConfig, load_sim_config
from distca_jax.sim.engine import SYSTEMS, Simulator, SystemResult, points, summarize

__all__ = ["HardwareConfig", "SimConfig", "load_sim_config", "SYSTEMS", "Simulator",
           "SystemResult", "points", "summarize"]
