"""Model construction under a mesh, the training state, and the jitted training step.

`Trainer` owns everything that is fixed for a run: the mesh, the model's graph, the shardings of
parameters and optimizer state, the optimizer, and the jitted step. The state is a plain pytree
(`TrainState`), so checkpoints and tests can handle it without the trainer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distca_jax import attention as attention_lib
from distca_jax import mesh as mesh_lib
from distca_jax.config import Config, ConfigError
from distca_jax.data.sources import Batch
from distca_jax.models.llama import AUTO_ORDER, Llama, join_streams
from distca_jax.models.presets import ModelShape, resolve
from distca_jax.schedule.transport import choose
from distca_jax.train import metrics as metrics_lib
from distca_jax.train import remat as remat_lib
from distca_jax.train.finite import leaf_name, tree_all_finite
from distca_jax.train.loss import chunked_cross_entropy
from distca_jax.train.optimizer import make_optimizer

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def _is_param(x) -> bool:
  return isinstance(x, nnx.Variable)


@functools.cache
def _initialiser(init, shape: tuple[int, ...], sharding: NamedSharding):
  """`init`'s draw of the parameter with index i (its key folded in) into `sharding`."""
  return jax.jit(lambda key, i: init(jax.random.fold_in(key, i), shape), out_shardings=sharding)


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


def with_nodes(config: Config, mesh: Mesh) -> Config:
  """`config` with `attention.data_rank_nodes` found unless set: from `mesh.devices_per_node`
  (consecutive devices of the mesh share a node), else from the mesh's processes' hosts
  (`mesh.data_rank_nodes`, a collective with several processes); a set one must have a node
  per data rank."""
  a, data = config.attention, mesh.shape["data"]
  if a.data_rank_nodes is not None:
    if len(a.data_rank_nodes) != data:
      raise ConfigError(f"attention.data_rank_nodes: one node number per data rank, got "
                        f"{len(a.data_rank_nodes)} for {data} data ranks")
    return config
  nodes = mesh_lib.data_rank_nodes(mesh, config.mesh.devices_per_node)
  return dataclasses.replace(config, attention=dataclasses.replace(a, data_rank_nodes=nodes))


def with_exchange(config: Config, platform: str) -> tuple[Config, str]:
  """(`config` with `attention.exchange=auto` resolved on the data ranks' nodes and `platform`,
  why that transport): `transport.choose`, recorded in the run's config.json so every later
  reader sees the transport the run took."""
  transport, why = choose(config.attention.exchange, config.attention.data_rank_nodes, platform)
  attention = dataclasses.replace(config.attention, exchange=transport.name)
  return dataclasses.replace(config, attention=attention), why


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
    self.config = with_nodes(self.config, mesh)
    # ... and with its exchange's transport: `auto` resolved on those nodes and this platform.
    self.config, self.exchange_reason = with_exchange(self.config, jax.default_backend())
    config = self.config
    self.rules = mesh_lib.LogicalRules.default(config.mesh.fsdp)
    self.core_attention = attention_lib.make_core_attention(config.attention, mesh)
    if config.data.packing == "wlb":  # the WLB-LLM baseline's buffers and attention
      from distca_jax import wlb_attention

      self.core_attention = wlb_attention.make_wlb_attention(mesh, config.attention.kernel)
    self.tx, self.schedule = make_optimizer(config.optim, total_steps or config.train.steps)
    constrain = mesh_lib.activation_constrainer(mesh, self.rules)
    dtype = DTYPES[config.model.dtype]

    # The remat policy: fixed by the config, or (`auto`) chosen at the first compile.
    self.remat, self.remat_reason = remat_lib.fixed_policy(config, mesh)
    self.remat_candidates: list[dict[str, Any]] = []
    self._auto_compiled = None  # (signature, compiled step) of the policy `auto` chose

    # The model's structure only: parameters are drawn by `_initial_params`.
    abstract_model = nnx.eval_shape(lambda: Llama(
        self.shape, dtype=dtype, remat=self.remat or AUTO_ORDER[0],
        core_attention=self.core_attention, constrain=constrain, norm_eps=self.shape.norm_eps,
        rngs=nnx.Rngs(0)))
    self.graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
    self.abstract_params = abstract_params  # the unpipelined layout (checkpoint relayout)
    self.param_shardings = mesh_lib.param_shardings(abstract_params, mesh, self.rules)
    self.flat_param_shardings = self.param_shardings  # the unpipelined layout's
    # With mesh.pipe > 1 the parameters take the pipeline layout (blocks stacked per stage,
    # pipeline.split_blocks) and the step runs the lock-step 1F1B schedule.
    self.pipeline = None
    if mesh.shape["pipe"] > 1:
      from distca_jax.train import pipeline

      self.pipeline = pipeline.PipelinedLlama(abstract_model, mesh, self.core_attention)
      self.param_shardings = pipeline.pipeline_shardings(self.param_shardings, mesh)
    self._step_fn = None
    self._acc_fns = None  # gradient accumulation's (zero accumulator, apply update)

  # ------------------------------------------------------------------ state

  def _initial_params(self, seed: int):
    """Each parameter drawn by its `Init` (model metadata) straight into its sharding. One
    program per distinct (Init, shape, sharding), shared by every layer and every trainer of
    the process: one program drawing all parameters compiles in time that grows with the
    layers."""
    key = jax.random.key(seed)
    inits = [v.get_metadata()["init"] for v in jax.tree.leaves(self.abstract_params, is_leaf=_is_param)]
    drawn = iter(enumerate(zip(inits, jax.tree.leaves(self.flat_param_shardings))))

    def one(abstract):
      i, (init, sharding) = next(drawn)
      return _initialiser(init, tuple(abstract.shape), sharding)(key, i)

    return self._in_layout(jax.tree.map(one, self.abstract_params))

  def _in_layout(self, params, abstract: bool = False):
    """Parameters in the unpipelined layout -> this trainer's (the pipeline's blocks stacked per
    stage); `abstract`: shapes and shardings only."""
    if self.pipeline is None:
      return params
    from distca_jax.train import pipeline

    split = jax.jit(lambda p: pipeline.split_blocks(p, self.shape.layers, self.pipeline.stages),
                    out_shardings=self.param_shardings)
    return jax.eval_shape(split, params) if abstract else split(params)

  def init_state(self, seed: int) -> TrainState:
    """Parameters initialised directly in their shardings (never materialised on one device),
    or with `model.init_from` read from that checkpoint (`load_params`; `seed` unused);
    optimizer moments inherit each parameter's sharding."""
    if self.config.model.init_from is not None:
      params = self.load_params(self.config.model.init_from)
    else:
      params = self._initial_params(seed)
    # The moments take their parameters' shardings explicitly: XLA gives zeros made from a
    # sharded input no sharding of their own (replicated), and the step keeps what it is given.
    # Every leaf is committed, as the step's outputs are: an uncommitted initial state would give
    # the jitted step a second dispatch-cache entry on step 2.
    shardings = jax.tree.map(lambda x: x.sharding, self.abstract_state())
    opt_state = jax.jit(self.tx.init, out_shardings=shardings.opt_state)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return TrainState(step=step, params=params, opt_state=opt_state)

  def load_params(self, path: str):
    """The parameters of the checkpoint at `path` (Hugging Face's or an imported one, `models/hf.py`)
    in fp32, placed straight into their shardings: each process reads only the slices its own
    devices hold, once per distinct slice."""
    from distca_jax.models import hf

    source = hf.Checkpoint(path)
    name_of = lambda p: leaf_name(p).removesuffix("/value").replace("/", ".")
    shardings = {name_of(p): s for p, s in
                 jax.tree_util.tree_flatten_with_path(self.flat_param_shardings)[0]}

    def one(path_, abstract):
      name, sharding = name_of(path_), shardings[name_of(path_)]
      if name not in source.specs or source.specs[name].shape != tuple(abstract.shape):
        raise ConfigError(f"model.init_from: {path} has no parameter {name} of shape "
                          f"{tuple(abstract.shape)}")
      read = functools.lru_cache(maxsize=None)(
          lambda key: source.read(name, tuple(slice(*k) for k in key)).astype(np.float32))
      return jax.make_array_from_callback(
          abstract.shape, sharding,
          lambda index: read(tuple((s.start, s.stop) for s in index)))

    return self._in_layout(jax.tree_util.tree_map_with_path(one, self.abstract_params))

  def abstract_state(self) -> TrainState:
    """The state `init_state` makes, as shapes with their shardings and nothing allocated: for
    compiling the step where its devices cannot run (`lower`, a mocked cluster)."""
    replicated = NamedSharding(self.mesh, P())
    shardings = iter(jax.tree.leaves(self.flat_param_shardings))
    params = self._in_layout(jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=next(shardings)),
        self.abstract_params), abstract=True)
    like = lambda sharding: lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    opt_state = optax.tree_map_params(self.tx, lambda s, p: like(p.sharding)(s),
                                      jax.eval_shape(self.tx.init, params), params,
                                      transform_non_params=like(replicated))
    return TrainState(step=like(replicated)(jax.ShapeDtypeStruct((), jnp.int32)), params=params,
                      opt_state=opt_state)

  @property
  def stages(self) -> int:
    """Pipeline stages of the parameter layout (1: the unpipelined model's)."""
    return 1 if self.pipeline is None else self.pipeline.stages

  def relayout(self, state: "TrainState", from_stages: int, to_stages: int) -> "TrainState":
    """`state` in the parameter layout of `from_stages` pipeline stages -> `to_stages`'s (jit it
    with the target shardings; see `restore_any_layout`)."""
    from distca_jax.train import pipeline

    return pipeline.relayout_state(state, from_stages, to_stages, self.shape.layers,
                                   self.abstract_params)

  # ------------------------------------------------------------------ step

  def loss_fn(self, params, arrays: dict[str, Any], ctx: Any, remat: str | None = None,
              step_tokens=None):
    """Mean next-token loss over real tokens, and the real-token count. With ping-pong, every
    entry of `arrays` and `ctx` is a tuple over nano-batches; the mean is over all of them.
    `remat`: the blocks' remat policy (default: the trainer's). `step_tokens`: divide by these
    real tokens instead of the batch's own (a micro-batch's share of its step's mean)."""
    model = nnx.merge(self.graphdef, params)
    model.remat = remat or self.remat or AUTO_ORDER[0]
    h = model(arrays["tokens"], arrays["positions"], ctx)  # ping-pong's streams joined along T
    targets, mask = join_streams(arrays["targets"]), join_streams(arrays["loss_mask"])
    count = jnp.sum(mask)
    # The mean's 1 / count goes into the loss, where its backward applies it (the head's
    # gradient is computed in the loss's forward pass, `loss.chunked_cross_entropy`).
    scale = 1.0 / jnp.maximum(count if step_tokens is None else step_tokens, 1.0)
    loss = chunked_cross_entropy(h, model.head_weight(), targets, mask, scale=scale)
    return loss, count

  def _train_step(self, state: TrainState, arrays, ctx, remat: str | None = None):
    if self.pipeline is None:
      (loss, count), grads = jax.value_and_grad(self.loss_fn, has_aux=True)(
          state.params, arrays, ctx, remat)
    else:
      (loss, count), grads = self.pipeline.value_and_grad(
          state.params, arrays, ctx["forward"], ctx["backward"], ctx["schedule"])
    return self._update(state, loss, count, grads)

  def _update(self, state: TrainState, loss, count, grads):
    """The optimizer update of a step whose gradient is `grads`, and the step's metrics."""
    with jax.named_scope("optimizer"):  # the profiler's step parts (train/profile.py)
      updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss,
        "grad_norm": optax.global_norm(grads),
        "lr": self.schedule(state.step),
        "tokens": count,
        "grads_finite": jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])),
        # Checked before the state can be saved (train/finite.py): one reduction XLA fuses.
        "state_finite": tree_all_finite((params, opt_state)),
    }
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  def _jit(self, state: TrainState, remat: str):
    shardings = jax.tree.map(lambda x: x.sharding, state)
    # A partial of its own per policy: jit's trace cache must not hand one policy's trace to
    # another.
    return jax.jit(functools.partial(self._train_step, remat=remat),
                   in_shardings=(shardings, None, None), out_shardings=(shardings, None),
                   donate_argnums=(0,))

  def _jitted_step(self, state: TrainState):
    if self._step_fn is None:
      self._step_fn = self._jit_candidate(state, self.remat or AUTO_ORDER[0])
    return self._step_fn

  def _jit_candidate(self, state: TrainState, remat: str):
    """The jitted function that holds a step's activations under `remat`: the step, or with
    gradient accumulation a micro-batch's gradient step."""
    return self._jit_micro(state, remat) if self.accumulates else self._jit(state, remat)

  def _candidate_args(self, state: TrainState, arrays, ctx) -> tuple:
    """`_jit_candidate`'s arguments for these inputs (the accumulator as shapes: for tracing)."""
    if not self.accumulates:
      return state, arrays, ctx
    return state.params, self._abstract_acc(state), arrays, ctx, jax.ShapeDtypeStruct((), jnp.float32)

  # ------------------------------------------------------------------ gradient accumulation
  #
  # `train.microbatches=K` without a pipeline: a step is K jitted calls, one per micro-batch,
  # each adding its gradient to an accumulator it takes and returns (donated: updated in place),
  # then one call for the optimizer update. Not a lax.scan over the K micro-batches stacked:
  # that needs every micro-batch alike in shapes and kind and all K on the device at once,
  # while each micro-batch here is planned on its own (CAD's capacities grow as plans need, and
  # the gate may run one colocated and the next with CAD), and the host places micro-batch i+1
  # while i runs. Memory: one micro-batch's activations plus the accumulator (the gradient,
  # sharded as the parameters). Each micro-batch's loss is divided by the whole step's real
  # tokens (`step_tokens`), so the sum is the step's mean loss and its gradient.

  @property
  def accumulates(self) -> bool:
    """Whether a step accumulates `train.microbatches` micro-batches (no pipeline)."""
    return self.pipeline is None and self.config.train.microbatches > 1

  def _micro_step(self, params, acc, arrays, ctx, step_tokens, remat: str | None = None):
    (loss, count), grads = jax.value_and_grad(self.loss_fn, has_aux=True)(
        params, arrays, ctx, remat, step_tokens)
    return {"grads": jax.tree.map(jnp.add, acc["grads"], grads), "loss": acc["loss"] + loss,
            "tokens": acc["tokens"] + count}

  def _acc_shardings(self, state: TrainState):
    replicated = NamedSharding(self.mesh, P())
    return {"grads": jax.tree.map(lambda x: x.sharding, state.params), "loss": replicated,
            "tokens": replicated}

  def _abstract_acc(self, state: TrainState):
    shardings = self._acc_shardings(state)
    scalar = lambda s: jax.ShapeDtypeStruct((), jnp.float32, sharding=s)
    return {"grads": jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                  state.params, shardings["grads"]),
            "loss": scalar(shardings["loss"]), "tokens": scalar(shardings["tokens"])}

  def _jit_micro(self, state: TrainState, remat: str):
    params, acc = jax.tree.map(lambda x: x.sharding, state.params), self._acc_shardings(state)
    return jax.jit(functools.partial(self._micro_step, remat=remat),
                   in_shardings=(params, acc, None, None, None), out_shardings=acc,
                   donate_argnums=(1,))

  def _accumulation_fns(self, state: TrainState):
    """(zero accumulator, apply update) jitted, made once."""
    if self._acc_fns is None:
      shardings = jax.tree.map(lambda x: x.sharding, state)
      acc = self._acc_shardings(state)
      zero = jax.jit(lambda params: {"grads": jax.tree.map(jnp.zeros_like, params),
                                     "loss": jnp.zeros((), jnp.float32),
                                     "tokens": jnp.zeros((), jnp.float32)}, out_shardings=acc)
      apply = jax.jit(lambda st, a: self._update(st, a["loss"], a["tokens"], a["grads"]),
                      in_shardings=(shardings, acc), out_shardings=(shardings, None),
                      donate_argnums=(0, 1))
      self._acc_fns = (zero, apply)
    return self._acc_fns

  def accumulate_step(self, state: TrainState, micro_batches, step_tokens: float):
    """One optimizer step over the micro-batches `micro_batches` yields, each as its placed
    (arrays, ctx) (`put_batch`; a generator places each only when its turn comes).
    `step_tokens`: the real (loss_mask) tokens of all of them together."""
    zero, apply = self._accumulation_fns(state)
    acc = zero(state.params)
    tokens = put_global(np.float32(step_tokens), self.mesh, P())
    for arrays, ctx in micro_batches:
      self._prepare(state, arrays, ctx)
      compiled = self._auto_executable(arrays, ctx)
      fn = compiled or self._jitted_step(state)
      acc = fn(state.params, acc, arrays, ctx, tokens)
    return apply(state, acc)

  def _choose_remat(self, state: TrainState, arrays, ctx):
    """`model.remat=auto`: the first policy of `AUTO_ORDER` whose compiled step fits the device
    (`remat.choose`). The chosen compiled step is kept and runs these shapes (no second
    compile)."""
    reserved = 0
    if self.accumulates:  # the accumulator, a gradient's worth, is not allocated yet
      reserved = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params))
    free = remat_lib.free_bytes_everywhere(self.mesh, reserved)
    chosen = remat_lib.choose(lambda name: self._jit_candidate(state, name),
                              self._candidate_args(state, arrays, ctx), free)
    self.remat, self._step_fn, compiled, self.remat_candidates, self.remat_reason = chosen
    self._auto_compiled = (remat_lib.signature(arrays, ctx), compiled)

  def _prepare(self, state: TrainState, arrays, ctx):
    if self.remat is None:
      self._choose_remat(state, arrays, ctx)

  def _auto_executable(self, arrays, ctx):
    if self._auto_compiled is not None and self._auto_compiled[0] == remat_lib.signature(arrays, ctx):
      return self._auto_compiled[1]
    return None

  def step(self, state: TrainState, arrays, ctx):
    """One optimizer step (jitted once per distinct shape of `ctx`)."""
    self._prepare(state, arrays, ctx)
    compiled = self._auto_executable(arrays, ctx)
    if compiled is not None:
      return compiled(state, arrays, ctx)
    return self._jitted_step(state)(state, arrays, ctx)

  def lower(self, state: TrainState, arrays, ctx, platforms: tuple[str, ...] | None = None):
    """The step (with gradient accumulation: a micro-batch's gradient step) traced and lowered
    for these shapes (`jax.stages.Lowered`), not compiled;
    `platforms`: lower for those instead of this process's devices (e.g. ("cuda",) on a CPU).
    With `model.remat=auto` undecided, lowers with the first policy of `AUTO_ORDER`."""
    traced = self._jitted_step(state).trace(*self._candidate_args(state, arrays, ctx))
    return traced.lower(lowering_platforms=platforms) if platforms else traced.lower()

  def compile(self, state: TrainState, arrays, ctx):
    """The compiled step for these shapes without running it (memory planning:
    `.memory_analysis()`); `model.remat=auto` chooses its policy here if not yet chosen."""
    self._prepare(state, arrays, ctx)
    return self._auto_executable(arrays, ctx) or self.lower(state, arrays, ctx).compile()

  def compiled_text(self, state: TrainState, arrays, ctx) -> str:
    """HLO text of the compiled step for these shapes (from the jit cache: no recompilation when
    the step already ran with them). The profiler maps kernels to named scopes with it."""
    if self._step_fn is None:
      raise RuntimeError("compiled_text: run a step first")
    return self._step_fn.lower(*self._candidate_args(state, arrays, ctx)).compile().as_text()

  def compile_count(self) -> int:
    jitted = 0 if self._step_fn is None else self._step_fn._cache_size()
    if self._acc_fns is not None:  # the optimizer update of an accumulated step
      jitted += self._acc_fns[1]._cache_size()
    return jitted + (self._auto_compiled is not None)

  def put_batch(self, batch: Batch, ctx_host: Any):
    """Device arrays for one step: what the host context lays out for it
    (`attention.StepContext.device_inputs`: a CAD context brings its own nano-batches, since
    ping-pong re-packs the batch, and a pipelined one its ticks), placed by their specs."""
    return self._placed(batch, ctx_host, put_global)

  def abstract_batch(self, batch: Batch, ctx_host: Any):
    """What `put_batch` places, as shapes with their shardings (nothing placed)."""
    def shapes(tree, mesh, spec):
      sharding = NamedSharding(mesh, spec)
      return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                         sharding=sharding), tree)

    return self._placed(batch, ctx_host, shapes)

  def _placed(self, batch: Batch, ctx_host: Any, place):
    """(arrays, ctx) of the step, each host tree turned by `place(tree, mesh, spec)`."""
    (arrays, arrays_spec), (ctx, ctx_spec) = ctx_host.device_inputs(batch)
    if isinstance(arrays_spec, dict):  # a spec per array
      arrays = {k: place(v, self.mesh, arrays_spec[k]) for k, v in arrays.items()}
    else:
      arrays = place(arrays, self.mesh, arrays_spec)
    return arrays, place(ctx, self.mesh, ctx_spec)
