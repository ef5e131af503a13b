"""The exchange's transports as values (`schedule/transport.py`): `auto`'s choice and its reason,
the capacities and log fields each owns, the bytes each carries against the rows the plan moves,
and the trainer recording the transport it took."""

import dataclasses

import numpy as np
import pytest

from distca_jax.config import load_config
from distca_jax.schedule.capacities import Capacities
from distca_jax.schedule.cost import CommModel
from distca_jax.schedule.transport import RAGGED, TILED, TRANSPORTS, choose, named, relay_for

COMM = CommModel(heads=8, kv_heads=2, head_dim=16, dtype_bytes=2)


@pytest.mark.parametrize("nodes, platform, want, says", [
    (None, "gpu", TILED, "fit one node"),
    ((0, 0, 0, 0), "gpu", TILED, "fit one node"),
    ((0, 0, 1, 1), "gpu", RAGGED, "span 2 nodes"),
    ((0, 0, 1, 1), None, RAGGED, "span 2 nodes"),  # the host's plans: the topology decides
    ((0, 0, 1, 1), "cpu", TILED, "needs GPUs"),  # ragged_all_to_all does not run there
])
def test_auto_is_tiled_within_a_node_and_ragged_across(nodes, platform, want, says):
  got, why = choose("auto", nodes, platform)
  assert got is want and why.startswith(f"attention.exchange=auto: {want.name}") and says in why
  for name, t in TRANSPORTS.items():  # a named transport is taken as it is, on any topology
    assert choose(name, nodes, platform)[0] is t is named(name)
  with pytest.raises(ValueError, match="one of"):
    named("shifted")


def test_each_transport_owns_its_capacities_and_log_fields():
  caps = Capacities(send_q=4096, send_kv=2048, send_kv2=0, c=1024, ckv=768, ckv2=0, skv=8, ctask=2)
  assert TILED.capacities(caps) == caps
  assert RAGGED.capacities(caps) == dataclasses.replace(caps, c=0, ckv=0, ckv2=0)
  assert TILED.log_rows(caps) == {"exchange_q_rows": 1024, "exchange_kv_rows": 768}
  assert RAGGED.log_rows(caps) == {"exchange_send_q_rows": 4096, "exchange_send_kv_rows": 2048}
  assert len({t.log_prefix for t in TRANSPORTS.values()}) == len(TRANSPORTS)
  # Relays where the servers span nodes and the transport carries only moving rows.
  assert relay_for("auto", RAGGED, (0, 1)).fanout == 8 and relay_for("auto", TILED, (0, 1)) is None
  assert relay_for("auto", RAGGED, (0, 0)) is None and relay_for(3, TILED, None).fanout == 3
  assert relay_for(0, RAGGED, (0, 1)) is None


def test_bytes_carried_against_the_rows_that_move():
  """ragged carries the pairs' rows; tiled every off-diagonal pair the largest pair's bucket, the
  same per device as its step-capacity pricing (`carried_bytes`) at that bucket."""
  rng = np.random.default_rng(0)
  n, T = 4, 1024
  rows = [rng.integers(0, 300, (n, n)) * (1 - np.eye(n, dtype=int)) for _ in range(3)]
  ragged = RAGGED.rounds(*rows, COMM, T)
  tiled = TILED.rounds(*rows, COMM, T)
  np.testing.assert_allclose(ragged[0], rows[0] * COMM.q_row_bytes + rows[1] * COMM.kv_row_bytes)
  for r, t in zip(ragged, tiled):
    assert (r <= t).all() and not np.diagonal(t).any()
    assert len(np.unique(t[~np.eye(n, dtype=bool)])) == 1  # one block size for every pair
  caps = Capacities(c=256, ckv=512, ckv2=256)
  per_pair = sum(TILED.pair_bytes(caps, COMM))
  np.testing.assert_allclose(TILED.carried_bytes(caps, np.zeros(n), COMM, plans=2),
                             2 * 2 * (n - 1) * per_pair)
  moved = np.arange(n, dtype=float)
  np.testing.assert_array_equal(RAGGED.carried_bytes(caps, moved, COMM, plans=2), moved)


def test_the_trainer_records_the_transport_it_took():
  """`attention.exchange=auto` (the default) resolves once, on the data ranks' nodes and the
  platform, into the run's config; a named one stays."""
  from distca_jax.train.step import with_exchange

  cfg = load_config(None, ["attention.impl=distca", "mesh.data=4", "attention.data_rank_nodes=[0,0,1,1]"])
  assert cfg.attention.exchange == "auto"
  on_gpu, why = with_exchange(cfg, "gpu")
  assert on_gpu.attention.exchange == "ragged" and "span 2 nodes" in why
  on_cpu, why = with_exchange(cfg, "cpu")
  assert on_cpu.attention.exchange == "tiled" and "needs GPUs" in why
  pinned = load_config(None, ["attention.exchange=tiled"])
  assert with_exchange(pinned, "gpu")[0] == pinned
