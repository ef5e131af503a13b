"""Profiling: phase attribution by named scope from a real xprof trace, step-time statistics, and
`launch/profile_steps.py` end to end (compile time, step times, trace, phases, attention load PNG)."""

import functools
import json
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distca_jax.launch_env import enable_compile_cache
from distca_jax.train import profile as profile_lib
from helpers import launch_script



def test_phase_of_follows_the_named_scope_contract():
  p = profile_lib.phase_of
  assert p("jit(_train_step)/jvp()/Llama/blocks/0/attn/core_attention/dot_general") == "attention"
  assert p("jit(_train_step)/transpose(jvp(core_attention))/dot_general") == "attention"
  assert p("jit(_train_step)/jvp()/core_attention/dispatch/all_to_all") == "dispatch"
  assert p("jit(_train_step)/transpose(jvp())/return/all_to_all") == "return"
  assert p("jit(_train_step)/jvp()/mlp/returns/dot_general") == "other"  # whole components only
  assert p("jit(_train_step)/jvp()/core_attention_helper/add") == "other"
  assert p("") == "other"


def test_step_part_of_names_the_parts_of_a_step():
  p = profile_lib.step_part_of
  assert p("jit(_train_step)/jvp()/blocks/0/core_attention/dot_general") == "attention"
  assert p("jit(_train_step)/transpose(jvp(lm_head_loss))/bcv,dv->bcd/dot_general") == "lm_head_loss"
  assert p("jit(_train_step)/optimizer/mul") == "optimizer"
  assert p("jit(_train_step)/transpose(jvp())/rmsnorm/reduce_sum") == "rmsnorm"
  assert p("jit(_train_step)/jvp()/rope/sin") == "rope"
  assert p("jit(_train_step)/jvp()/swiglu/logistic") == "swiglu"
  assert p("jit(_train_step)/transpose(jvp())/btd,df->btf/dot_general") == "matmul"
  assert p("jit(_train_step)/jvp()/add") == "other"
  assert p("jit(_train_step)/jvp()/dot_general_helper/add") == "other"
  assert set(profile_lib.STEP_PARTS) >= {part for _, part in profile_lib.STEP_SCOPES} | {"matmul", "other"}


def test_step_parts_of_a_traced_program(tmp_path):
  def f(x):
    with jax.named_scope("rmsnorm"):
      x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True))
    x = jnp.sin(x @ x)
    with jax.named_scope("lm_head_loss"):
      return jnp.sum(jax.nn.logsumexp(x @ x, -1))

  step = jax.jit(jax.value_and_grad(f))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(256, 256)), jnp.float32) / 16
  jax.block_until_ready(step(x))
  with jax.profiler.trace(str(tmp_path), profiler_options=profile_lib.trace_options()):
    jax.block_until_ready(step(x))
  parts = profile_lib.step_parts(profile_lib.find_xplane(tmp_path), step.lower(x).compile().as_text(),
                                 module="jit_f")
  ms = parts["ms_per_step"]
  assert set(ms) == set(profile_lib.STEP_PARTS)
  assert ms["lm_head_loss"] > 0 and ms["matmul"] > 0 and ms["rmsnorm"] > 0 and ms["attention"] == 0
  assert sum(parts["fraction"].values()) == pytest.approx(1.0)


def test_op_names_and_leaf_events():
  hlo = ('  %fusion.3 = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop, calls=%fc, '
         'metadata={op_name="jit(f)/core_attention/mul" source_file="x.py" source_line=3}\n'
         '  ROOT %all-to-all.1 = f32[8]{0} all-to-all(f32[8]{0} %a), dimensions={0}, '
         'metadata={op_name="jit(f)/dispatch/all_to_all"}\n'
         '  %p = f32[4]{0} parameter(0)\n')
  assert profile_lib.op_names(hlo) == {"fusion.3": "jit(f)/core_attention/mul",
                                       "all-to-all.1": "jit(f)/dispatch/all_to_all"}
  # A while loop (0..100) containing two ops: only the inner ops count.
  events = [(0, 100, "while"), (10, 20, "a"), (40, 50, "b"), (200, 5, "c")]
  assert [e[2] for e in profile_lib._leaf_events(events)] == ["a", "b", "c"]


def test_step_time_stats():
  st = profile_lib.step_time_stats([0.1, 0.2, 0.3, 0.4, 1.0])
  assert st["median_s"] == pytest.approx(0.3) and st["p90_s"] == pytest.approx(0.76) and st["count"] == 5
  assert np.isnan(profile_lib.step_time_stats([])["median_s"])


def test_phase_breakdown_of_a_traced_program(tmp_path):
  """Three matmul chains in the three scopes, forward and backward, traced on this backend."""

  def f(x):
    with jax.named_scope("dispatch"):
      x = jnp.sin(x @ x)
    with jax.named_scope("core_attention"):
      x = jnp.tanh(x @ x) @ x
    with jax.named_scope("return"):
      x = jnp.cos(x @ x)
    return jnp.sum(x * x)

  step = jax.jit(jax.value_and_grad(f))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(256, 256)), jnp.float32) / 16
  jax.block_until_ready(step(x))  # compile outside the trace
  with jax.profiler.trace(str(tmp_path), profiler_options=profile_lib.trace_options()):
    for _ in range(2):
      jax.block_until_ready(step(x))
  xplane = profile_lib.find_xplane(tmp_path)
  assert xplane is not None
  hlo = step.lower(x).compile().as_text()
  ph = profile_lib.phase_breakdown(xplane, hlo, module="jit_f", steps=2)
  assert ph["scoped"] and ph["ops"] > 0
  ms = ph["ms_per_step"]
  assert ms["attention"] > 0 and ms["dispatch"] > 0 and ms["return"] > 0
  assert sum(ph["fraction"].values()) == pytest.approx(1.0)
  per_device = ph["per_device_ms"]
  assert len(per_device) == ph["devices"] >= 1
  for p in profile_lib.PHASES:
    assert np.mean([d[p] for d in per_device.values()]) == pytest.approx(ms[p])


def test_profile_cli_end_to_end(tmp_path, capsys, monkeypatch):
  """`launch/profile_steps.py` in this process (8 CPU devices): seed 6 keeps the three steps on one
  compiled program, the one tests/test_multihost.py compiles too."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 CPU devices (tests/conftest.py sets them)")
  from distca_jax.train import loop

  # The launcher trains on every device; the suite has more than the 8 this program is for.
  monkeypatch.setattr(loop, "run", functools.partial(loop.run, devices=jax.devices()[:8]))
  enable_compile_cache(os.environ.setdefault("DISTCA_TEST_COMPILE_CACHE",
                                             tempfile.mkdtemp(prefix="distca_compile_cache_")))
  cli = launch_script("profile_steps")
  rc = cli.main(["--warmup", "0", "--measure", "1", "--trace", "1",
                 "model.dtype=float32", "model.remat=none", "model.layers=1", "model.hidden=64",
                 "model.ffn=128", "model.vocab_size=256", "data.tokens_per_device=256",
                 "data.length_scale=64", "data.seed=6", "train.tensorboard=false",
                 f"train.out_dir={tmp_path}"])
  assert rc == 0
  report = json.loads((tmp_path / "profile.json").read_text())
  assert report["compile_count"] == 1 and report["compile_s"] > 0
  assert report["step_time"]["count"] == 1 and report["step_time"]["median_s"] > 0
  assert report["traced_steps"] == 1
  assert profile_lib.find_xplane(tmp_path / "trace") is not None
  assert report["phases"]["ops"] > 0 and report["phases"]["devices"] == 8
  load = report["attention_load"]
  assert len(load["before"]) == 8 and len(load["after"]) == 8
  assert sum(load["after"]) == pytest.approx(sum(load["before"]))  # moved, not lost
  assert load["imbalance_after"] <= load["imbalance_before"]
  assert Path(load["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  out = capsys.readouterr().out
  assert "median" in out and "p90" in out and "per-phase" in out and "attention_load.png" in out


def test_overlap_report_counts_communication_beside_compute(tmp_path, capsys):
  """launch/tools/overlap_report.py on a small Perfetto trace: per GPU, the NCCL time covered by
  compute kernels running at the same time (on another stream); host events do not count."""
  import gzip

  from helpers import launch_script

  meta = lambda pid, name: {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
  ev = lambda pid, name, ts, dur: {"ph": "X", "pid": pid, "tid": 1, "name": name, "ts": ts, "dur": dur}
  events = [meta(1, "/device:GPU:0"), meta(2, "/device:GPU:1"), meta(3, "/host:CPU"),
            ev(1, "ncclDevKernel_SendRecv", 0, 10), ev(1, "ncclDevKernel_SendRecv", 8, 4),
            ev(1, "fusion_12", 5, 15), ev(1, "gemm", 30, 5),  # comm [0, 12], compute from 5: 7
            ev(2, "ncclKernel_AllToAll", 0, 4), ev(2, "gemm", 10, 5),
            ev(3, "ncclDevKernel_SendRecv", 0, 100)]
  path = tmp_path / "trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  rows = launch_script("overlap_report").report(str(path))
  assert [r["device"] for r in rows] == ["/device:GPU:0", "/device:GPU:1"]
  assert rows[0]["comm_ms"] == pytest.approx(0.012) and rows[0]["comm_overlapped_ms"] == pytest.approx(0.007)
  assert rows[0]["compute_ms"] == pytest.approx(0.020)
  assert rows[1]["overlap"] == 0.0
  assert launch_script("overlap_report").main([str(path)]) == 0
  assert "| /device:GPU:0 | 0.01 | 0.01 | 58% | 0.02 |" in capsys.readouterr().out


_DUMP = """
import os, sys
os.environ["XLA_FLAGS"] = f"--xla_dump_to={sys.argv[1]} --xla_dump_hlo_module_re=.*big_step.*"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp

def big_step(x):  # one 16 MiB temporary live while a second is made from it
  with jax.named_scope("wide"):
    # The barrier keeps XLA from fusing the whole step into one reduction (newer XLA does).
    y = jax.lax.optimization_barrier(jnp.sin(jnp.tile(x, (16, 1))))
  return (jnp.cos(y) * y).sum()

jax.jit(big_step)(jnp.ones((256, 1024))).block_until_ready()
"""


def test_xla_buffers_names_the_buffers_at_the_peak(tmp_path, capsys):
  """launch/tools/xla_buffers.py on a real XLA dump (CPU): a peak at least the step's largest
  temporary, and that buffer listed with the JAX name scope of the op that made it."""
  import subprocess
  import sys

  from helpers import launch_script

  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  subprocess.run([sys.executable, "-c", _DUMP, str(tmp_path)], check=True, env=env, timeout=120)
  assert launch_script("xla_buffers").main([str(tmp_path), "--top", "3"]) == 0
  out = capsys.readouterr().out
  peak = float(out.split(" peak ")[1].split(" GiB")[0])
  assert peak >= 15 / 1024  # the [4096, 1024] f32 temporary: 16 MiB (printed to 1 MiB)
  assert "wide" in out
