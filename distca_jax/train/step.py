"""Model construction under a mesh, the training state, and the jitted training step.

`Trainer` owns everything that is fixed for a run: the mesh, the model's graph, the shardings of
parameters and optimizer state, the optimizer, and the jitted step. The state is a plain pytree
(`TrainState`), so checkpoints and tests can handle it without the trainer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distca_jax import attention as attention_lib
from distca_jax.colocated import stream_arrays as device_batch_arrays  # (re-exported)
from distca_jax import mesh as mesh_lib
from distca_jax.config import Config, ConfigError
from distca_jax.data.sources import Batch
from distca_jax.models.llama import Llama
from distca_jax.models.presets import ModelShape, resolve
from distca_jax.train import metrics as metrics_lib
from distca_jax.train.loss import chunked_cross_entropy
from distca_jax.train.optimizer import make_optimizer

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  step: jax.Array
  params: Any      # nnx.State of fp32 parameters
  opt_state: Any


def put_global(host_tree: Any, mesh: Mesh, spec: P = P("data")) -> Any:
  """Places host arrays (identical on every process) as global arrays sharded by `spec`.

  Works for one process and for many: each process supplies the shards it addresses.
  """
  sharding = NamedSharding(mesh, spec)

  def one(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

  return jax.tree.map(one, host_tree)


def with_gate_nodes(config: Config, mesh: Mesh) -> Config:
  """`config` with `attention.gate_nodes` found from the mesh's processes' hosts
  (`mesh.data_rank_nodes`, a collective with several processes) unless set; a set one must
  have a node per data rank."""
  a, data = config.attention, mesh.shape["data"]
  if a.gate_nodes is not None:
    if len(a.gate_nodes) != data:
      raise ConfigError(f"attention.gate_nodes: one node number per data rank, got "
                        f"{len(a.gate_nodes)} for {data} data ranks")
    return config
  nodes = mesh_lib.data_rank_nodes(mesh)
  return dataclasses.replace(config, attention=dataclasses.replace(a, gate_nodes=nodes))


class Trainer:
  """Builds the sharded model and optimizer for `config` on `mesh` and runs training steps."""

  def __init__(self, config: Config, mesh: Mesh, total_steps: int | None = None):
    self.mesh = mesh
    self.shape: ModelShape = resolve(config.model)
    # `config` with the step gate's attention cost of the kernel every core attention call takes
    # (`metrics.with_kernel_gate_cost`, unless the config sets one): plan steps with
    # `trainer.config.attention`. A named kernel that cannot run the model fails here.
    self.config, self.kernel = metrics_lib.with_kernel_gate_cost(config, self.shape)
    # ... and with the node of each data rank, unless the config sets them: the gate prices the
    # exchange's bytes between nodes higher (`dispatch.exchange_bytes`).
    self.config = with_gate_nodes(self.config, mesh)
    config = self.config
    self.rules = mesh_lib.LogicalRules.default(config.mesh.fsdp)
    self.core_attention = attention_lib.make_core_attention(config.attention, mesh)
    if config.data.packing == "wlb":  # the WLB-LLM baseline's buffers and attention
      from distca_jax import wlb_attention

      self.core_attention = wlb_attention.make_wlb_attention(mesh, config.attention.kernel)
    self.tx, self.schedule = make_optimizer(config.optim, total_steps or config.train.steps)
    constrain = mesh_lib.activation_constrainer(mesh, self.rules)
    dtype = DTYPES[config.model.dtype]

    def build(seed):
      return Llama(self.shape, dtype=dtype, remat=config.model.remat,
                   core_attention=self.core_attention, constrain=constrain,
                   norm_eps=config.model.norm_eps, rngs=nnx.Rngs(seed))

    self._build = build
    abstract_model = nnx.eval_shape(lambda: build(0))
    self.graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
    self.abstract_params = abstract_params  # the unpipelined layout (checkpoint relayout)
    self.param_shardings = mesh_lib.param_shardings(abstract_params, mesh, self.rules)
    # With mesh.pipe > 1 the parameters take the pipeline layout (blocks stacked per stage,
    # pipeline.split_blocks) and the step runs the lock-step 1F1B schedule.
    self.pipeline = None
    if mesh.shape["pipe"] > 1:
      from distca_jax import pipeline

      self.pipeline = pipeline.PipelinedLlama(abstract_model, mesh, self.core_attention)
      self.param_shardings = pipeline.pipeline_shardings(self.param_shardings, mesh)
    self._step_fn = None

  # ------------------------------------------------------------------ state

  def init_state(self, seed: int) -> TrainState:
    """Parameters initialised directly in their shardings (never materialised on one device);
    optimizer moments inherit each parameter's sharding."""
    build = self._build

    def init_params(seed_arr):
      params = nnx.state(build(jax.random.key(seed_arr)), nnx.Param)
      if self.pipeline is None:
        return params
      from distca_jax import pipeline

      return pipeline.split_blocks(params, self.shape.layers, self.pipeline.stages)

    seed_arr = jnp.asarray(seed, jnp.uint32)
    params = jax.jit(init_params, out_shardings=self.param_shardings)(seed_arr)
    opt_state = jax.jit(self.tx.init)(params)
    replicated = NamedSharding(self.mesh, P())
    # Scalars of the optimizer (counts) come out on one device: replicate them over the mesh.
    # Every leaf is placed explicitly (committed, as the step's outputs are): an uncommitted
    # initial state would give the jitted step a second dispatch-cache entry on step 2.
    opt_state = jax.tree.map(
        lambda x: jax.device_put(
            x, x.sharding if len(x.sharding.device_set) == self.mesh.size else replicated),
        opt_state)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    return TrainState(step=step, params=params, opt_state=opt_state)

  @property
  def stages(self) -> int:
    """Pipeline stages of the parameter layout (1: the unpipelined model's)."""
    return 1 if self.pipeline is None else self.pipeline.stages

  def relayout(self, state: "TrainState", from_stages: int, to_stages: int) -> "TrainState":
    """`state` in the parameter layout of `from_stages` pipeline stages -> `to_stages`'s (jit it
    with the target shardings; see `restore_any_layout`)."""
    from distca_jax import pipeline

    return pipeline.relayout_state(state, from_stages, to_stages, self.shape.layers,
                                   self.abstract_params)

  # ------------------------------------------------------------------ step

  def loss_fn(self, params, arrays: dict[str, Any], ctx: Any):
    """Mean next-token loss over real tokens, and the real-token count. With ping-pong, every
    entry of `arrays` and `ctx` is a tuple over nano-batches; the mean is over all of them."""
    model = nnx.merge(self.graphdef, params)
    h = model(arrays["tokens"], arrays["positions"], ctx)
    streams = isinstance(h, tuple)
    hs = h if streams else (h,)
    targets = arrays["targets"] if streams else (arrays["targets"],)
    masks = arrays["loss_mask"] if streams else (arrays["loss_mask"],)
    total = sum(chunked_cross_entropy(h_i, model.lm_head[...], t_i, m_i)
                for h_i, t_i, m_i in zip(hs, targets, masks))
    count = sum(jnp.sum(m_i) for m_i in masks)
    return total / jnp.maximum(count, 1.0), count

  def _train_step(self, state: TrainState, arrays, ctx):
    if self.pipeline is None:
      (loss, count), grads = jax.value_and_grad(self.loss_fn, has_aux=True)(state.params, arrays, ctx)
    else:
      (loss, count), grads = self.pipeline.value_and_grad(
          state.params, arrays, ctx["forward"], ctx["backward"], ctx["schedule"])
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss,
        "grad_norm": optax.global_norm(grads),
        "lr": self.schedule(state.step),
        "tokens": count,
        "grads_finite": jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])),
    }
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  def _jitted_step(self, state: TrainState):
    if self._step_fn is None:
      shardings = jax.tree.map(lambda x: x.sharding, state)
      self._step_fn = jax.jit(self._train_step, in_shardings=(shardings, None, None),
                              out_shardings=(shardings, None), donate_argnums=(0,))
    return self._step_fn

  def step(self, state: TrainState, arrays, ctx):
    """One optimizer step (jitted once per distinct shape of `ctx`)."""
    return self._jitted_step(state)(state, arrays, ctx)

  def lower(self, state: TrainState, arrays, ctx, platforms: tuple[str, ...] | None = None):
    """The step traced and lowered for these shapes (`jax.stages.Lowered`), not compiled;
    `platforms`: lower for those instead of this process's devices (e.g. ("cuda",) on a CPU)."""
    traced = self._jitted_step(state).trace(state, arrays, ctx)
    return traced.lower(lowering_platforms=platforms) if platforms else traced.lower()

  def compile(self, state: TrainState, arrays, ctx):
    """The compiled step for these shapes without running it (memory planning:
    `.memory_analysis()`)."""
    return self.lower(state, arrays, ctx).compile()

  def compiled_text(self, state: TrainState, arrays, ctx) -> str:
    """HLO text of the compiled step for these shapes (from the jit cache: no recompilation when
    the step already ran with them). The profiler maps kernels to named scopes with it."""
    if self._step_fn is None:
      raise RuntimeError("compiled_text: run a step first")
    return self._step_fn.lower(state, arrays, ctx).compile().as_text()

  def compile_count(self) -> int:
    return 0 if self._step_fn is None else self._step_fn._cache_size()

  def put_batch(self, batch: Batch, ctx_host: Any):
    """Device arrays for one step: what the host context lays out for it
    (`attention.StepContext.device_inputs`: a CAD context brings its own nano-batches, since
    ping-pong re-packs the batch, and a pipelined one its ticks), placed by their specs."""
    (arrays, arrays_spec), (ctx, ctx_spec) = ctx_host.device_inputs(batch)
    if isinstance(arrays_spec, dict):  # a spec per array
      arrays = {k: put_global(v, self.mesh, arrays_spec[k]) for k, v in arrays.items()}
    else:
      arrays = put_global(arrays, self.mesh, arrays_spec)
    return arrays, put_global(ctx, self.mesh, ctx_spec)
