"""The CA-task scheduler (numpy only; no JAX here).

items.py (CA-task items from the packed layout, the capacity buckets), cost.py (area, bytes,
kernel time), planner.py (the greedy ΔF/bytes balancer and byte accounting), capacities.py (a
step's array capacities and capacities that only grow over a run), plan.py (the plan: placed
tasks and their capacities), baselines.py (colocated, WLB-style packing, per-document CP),
pingpong.py (the two nano-batches).
"""

from distca_jax.schedule.capacities import Capacities, StepShapes, requirements
from distca_jax.schedule.cost import AnalyticKernel, CommModel, TimeTable
from distca_jax.schedule.items import GRANULE, Tasks, initial_tasks, validate_layout
from distca_jax.schedule.plan import CapacityError, Plan, colocated_plan, make_plan
from distca_jax.schedule.planner import balance
from distca_jax.schedule.traffic import kv_requests, traffic
from distca_jax.schedule.pingpong import pingpong_layouts, split_pingpong

__all__ = [
    "AnalyticKernel", "CommModel", "TimeTable", "GRANULE", "Tasks", "initial_tasks",
    "validate_layout", "Capacities", "CapacityError", "StepShapes", "Plan", "colocated_plan",
    "make_plan", "requirements", "balance", "kv_requests", "traffic", "pingpong_layouts",
    "split_pingpong",
]
