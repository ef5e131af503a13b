"""The packed exchange (`dispatch/exchange.py`): its CPU transport against the format's numpy
definition (`helpers.simulate_exchange`), forward and reversed, and CAD over them end to end:
loss and every parameter gradient against a single-device run on random layouts, at 2 to 16
devices, data and data x tensor meshes, keep and resend (the GPU's `ragged` transport has its
own test in tests/test_dispatch.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from distca_jax import mesh as mesh_lib
from distca_jax.data.sources import make_batch
from distca_jax.dispatch.exchange import Exchange, transport
from distca_jax.dispatch.format import exchange_offsets
from distca_jax.mesh import ROW_AXES
from distca_jax.schedule.transport import TILED
from helpers import reference_over, run_step, simulate_exchange, small_config, tree_rel_err

def _random_counts(rng, n: int) -> np.ndarray:
  """[n, n] rows device d sends s: zero diagonal, about a third of the pairs empty."""
  count = rng.integers(1, 12, (n, n)) * (rng.random((n, n)) < 0.65)
  np.fill_diagonal(count, 0)
  return count


def _device_exchange(count_NxN):
  """The per-device [N, N] arrays of an `Exchange` (rows: devices), as `DispatchPlan` lays them
  out: send count and offsets, their transposes seen from the receiver, the peers' offsets."""
  send_off, recv_off = exchange_offsets(count_NxN)
  arrays = dict(send_count=count_NxN, send_off=send_off, recv_count=count_NxN.T,
                recv_off=recv_off, peer_off=recv_off.T, back_off=send_off.T)
  return {k: jnp.asarray(np.ascontiguousarray(v), jnp.int32) for k, v in arrays.items()}


@pytest.mark.parametrize("n", [4, 8, 16])
def test_tiled_transport_moves_the_counted_rows(n):
  """Device d's rows for s, at [send_off[d, s], + count) of its send buffer, land in s's receive
  buffer grouped by source in order of d; every other row is zero; the rows past the counts in
  the send buffers (random here) never travel; the reversed exchange brings each row back to the
  send slot it left from."""
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices (tests/conftest.py sets them)")
  rng = np.random.default_rng(n)
  count = _random_counts(rng, n)
  S = int(count.sum(1).max()) + 3  # send buffers with padding rows past the counts
  R = int(count.sum(0).max()) + 2
  send_NxSxE = rng.standard_normal((n, S, 2, 3)).astype(np.float32)
  block = int(count.max()) + 1  # one row past the largest pair: a padded block
  arrays = _device_exchange(count)
  mesh = mesh_lib.make_mesh(small_config(f"mesh.data={n}").mesh, jax.devices()[:n])

  def local(x, arrays):
    ex = Exchange(**{k: v[0] for k, v in arrays.items()}, block=block)
    got = transport(x[0], R, ex, TILED)
    return got[None], transport(got, S, ex.reversed(), TILED)[None]

  spec = P(ROW_AXES)
  run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec),
                              check_vma=False))
  got, back = (np.asarray(x) for x in run(jnp.asarray(send_NxSxE), arrays))
  np.testing.assert_array_equal(got, simulate_exchange(send_NxSxE, count, R))
  sent = np.arange(S)[None, :] < count.sum(1)[:, None]  # [N, S]: the rows that travel
  np.testing.assert_array_equal(back, np.where(sent[..., None, None], send_NxSxE, 0))
  assert (~sent).any() and np.abs(send_NxSxE[~sent]).min() > 0  # the padding was not zero


def random_layout_batch(n: int, T: int, seed: int):
  """A batch of `n` buffers of T tokens from a seeded generator: one long document of 1.2 to
  2.5 buffers at a random place among many short ones (4 to 48 tokens), and up to T/8 padding
  tokens at the end. The long one spans two or three devices, so its K/V prefix has to move
  to whichever server takes a later shard of it."""
  rng = np.random.default_rng(seed)
  total = n * T - int(rng.integers(0, T // 8 + 1))
  long = int(rng.integers(int(1.2 * T), int(min(2.5, n - 0.5) * T) + 1))
  short = []
  left = total - long
  while left > 0:
    short.append(min(left, int(rng.integers(4, 49))))
    left -= short[-1]
  at = int(rng.integers(0, len(short) + 1))
  lens = np.array(short[:at] + [long] + short[at:])
  return make_batch(lens, rng.integers(0, 512, int(lens.sum())).astype(np.int32), n, T)


def dense_reference_loss(p: dict, shape, batch, eps: float = 1e-5):
  """The loss of tests/helpers.py's plain-jnp Llama (`reference_loss`) over the flat token
  stream, with attention as one dense [S, S] product masked to causal pairs of one document
  instead of a slice per document: the same function, whose program does not grow with the
  number of documents (a batch of many short ones compiles in seconds)."""
  H, K, E = shape.heads, shape.kv_heads, shape.head_dim
  tokens, pos, seg = (jnp.asarray(a.reshape(-1)) for a in (batch.tokens, batch.positions,
                                                           batch.segment_ids))
  # Padding rows (segment -1) attend to themselves alone: no row of a document reads them.
  same = (seg[:, None] == seg[None, :]) & ((seg[:, None] >= 0) | jnp.eye(seg.size, dtype=bool))
  mask_TxS = same & (pos[None, :] <= pos[:, None])
  norm = lambda x, scale: x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale

  def rot(x):
    ang = pos[:, None, None] * shape.rope_theta ** (-np.arange(0, E, 2) / E)
    x1, x2 = x[..., : E // 2], x[..., E // 2:]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang),
                            x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)

  x = jnp.asarray(p["embed"])[tokens]
  for blk in p["blocks"].values() if isinstance(p["blocks"], dict) else p["blocks"]:
    a, m = blk["attn"], blk["mlp"]
    h = norm(x, blk["attn_norm"]["scale"])
    q = rot(jnp.einsum("sd,dhe->she", h, a["wq"])).reshape(-1, K, H // K, E)
    k, v = rot(jnp.einsum("sd,dke->ske", h, a["wk"])), jnp.einsum("sd,dke->ske", h, a["wv"])
    logits = jnp.where(mask_TxS, jnp.einsum("tkge,ske->kgts", q, k) / np.sqrt(E), -jnp.inf)
    o = jnp.einsum("kgts,ske->tkge", jax.nn.softmax(logits, -1), v).reshape(-1, H, E)
    o = jnp.where((seg >= 0)[:, None, None], o, 0.0)
    x = x + jnp.einsum("she,hed->sd", o, a["wo"])
    h = norm(x, blk["mlp_norm"]["scale"])
    x = x + (jax.nn.silu(h @ m["w_gate"]) * (h @ m["w_up"])) @ m["w_down"]
  logp = jax.nn.log_softmax(norm(x, p["final_norm"]["scale"]) @ p["lm_head"], -1)
  picked = jnp.take_along_axis(logp, jnp.asarray(batch.targets.reshape(-1))[:, None], -1)[:, 0]
  mask = jnp.asarray(batch.loss_mask.reshape(-1))
  return -jnp.sum(picked * mask) / jnp.maximum(mask.sum(), 1.0)


# Each memory mode with and without tensor parallelism, 2 to 16 devices. Small: one layer, the
# reference kernel, 128-256 tokens per device. (The GPU's ragged transport: tests/test_dispatch.py.)
EQUIVALENCE_CASES = [
    # data ranks, tensor, memory mode, transport, tokens per device
    (2, 1, "keep", "tiled", 128),
    (2, 2, "resend", "tiled", 256),
    (4, 1, "resend", "tiled", 256),
    (4, 2, "keep", "tiled", 128),
    (8, 2, "resend", "tiled", 128),
]


@pytest.mark.parametrize("data,tensor,mode,exchange,T", EQUIVALENCE_CASES)
def test_cad_matches_a_single_device_run(data, tensor, mode, exchange, T):
  """CAD over the packed exchange on a random layout: loss and every parameter gradient as one
  device computes them over the whole batch, with query rows and K/V rows moving."""
  if jax.device_count() < data * tensor:
    pytest.skip(f"needs {data * tensor} devices (tests/conftest.py sets them)")
  cfg = small_config(f"mesh.data={data}", f"mesh.tensor={tensor}", "attention.impl=distca",
                     "attention.pingpong=false", f"attention.memory_mode={mode}",
                     f"attention.exchange={exchange}", f"data.tokens_per_device={T}",
                     "attention.epsilon=0.05", "model.layers=1", "attention.kernel=reference")
  batch = random_layout_batch(data, T, seed=100 * data + 10 * tensor + len(mode) + len(exchange))
  loss, grads, params, shape, ctx = run_step(cfg, batch, data * tensor)
  (d,) = ctx.dispatch
  assert d.q.recv_rows > 0 and d.kv.recv_rows > 0  # queries and K/V rows travel
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(
      lambda p: dense_reference_loss(p, shape, batch)))(params)
  assert abs(loss - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
  assert tree_rel_err(grads, ref_grads) <= 1e-5
  if data * tensor == 2:  # the dense reference is helpers' document-by-document one
    slice_loss, slice_grads = reference_over(params, shape, [batch])
    assert abs(float(ref_loss) - slice_loss) <= 1e-6 * abs(slice_loss)
    assert tree_rel_err(ref_grads, slice_grads) <= 1e-6
