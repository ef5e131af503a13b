"""The at-scale simulator: CAD's scheduler against its baselines on sampled batches.

config.py (typed sweep configuration), engine.py (the step-time model and one batch's systems),
pipeline.py (the same with pipeline stages, and `make_simulator`, which picks one of the two).
The command line is launch/simulate.py; docs/SIMULATOR.md compares it with the paper.
"""

from distca_jax.sim.config import HardwareConfig, SimConfig, load_sim_config
from distca_jax.sim.engine import SYSTEMS, Simulator, SystemResult, points, summarize
from distca_jax.sim.pipeline import PipelineSimulator, make_simulator

__all__ = ["HardwareConfig", "SimConfig", "load_sim_config", "SYSTEMS", "Simulator",
           "SystemResult", "PipelineSimulator", "make_simulator", "points", "summarize"]
