"""The CA-task scheduler (numpy only; no JAX here).

items.py (CA-task items from the packed layout), cost.py (area, bytes, kernel time), planner.py
(the greedy ΔF/bytes balancer and byte accounting), plan.py (the plan: placed tasks, capacities,
and the scheduler's reference array layout with its numpy simulation), baselines.py (colocated,
WLB-style packing, per-document CP), pingpong.py (the two nano-batches).
"""

from distca_jax.schedule.cost import AnalyticKernel, CommModel, TimeTable
from distca_jax.schedule.items import GRANULE, Tasks, initial_tasks, validate_layout
from distca_jax.schedule.plan import (Capacities, CapacityError, CapacityPolicy, Plan, PlanArrays,
                                      build_arrays, colocated_plan, make_plan, requirements,
                                      simulate_dispatch)
from distca_jax.schedule.planner import balance, kv_requests, traffic
from distca_jax.schedule.pingpong import pingpong_layouts, split_pingpong

__all__ = [
    "AnalyticKernel", "CommModel", "TimeTable", "GRANULE", "Tasks", "initial_tasks",
    "validate_layout", "Capacities", "CapacityError", "CapacityPolicy", "Plan", "PlanArrays",
    "build_arrays", "colocated_plan", "make_plan", "requirements", "simulate_dispatch", "balance", "kv_requests",
    "traffic", "pingpong_layouts", "split_pingpong",
]
