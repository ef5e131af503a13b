"""Checksums that a checkpoint carries, so a resumed run trusts only what it saved.

A checkpoint's `extra` item holds, under `INTEGRITY`, a checksum of every array of the state and
one of `extra` itself; both are written in the same commit as the arrays, so a committed step
always carries them.

Array checksums are computed on the devices, by one jitted program over the whole state: each
element's bits (as unsigned 32-bit words) times an odd weight drawn from its flat index, summed
modulo 2**32, twice with different weights (64 bits in all). An integer sum modulo 2**32 does not
depend on the order of its terms, so the value is the same whatever the array's sharding, mesh or
process count: a checkpoint restored onto another mesh is verified against the checksum of the
mesh it was saved on, and no process gathers anything but two words per array. A single flipped
bit `k` of element `i` moves each sum by `2**k * w_i`, never 0 modulo 2**32 for an odd `w_i`:
every single-bit error in the arrays' values is detected, whatever file format stores them.

`extra` (the step, the model shape, ...) is covered by a CRC-32 of its canonical JSON.
"""

from __future__ import annotations

import functools
import json
import zlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from distca_jax.train.finite import leaf_name

INTEGRITY = "integrity"


def _words(x) -> jax.Array:
  """The bits of every element of `x` as uint32 words (8-byte elements: two words each)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = x.dtype.itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    return jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes: a trailing axis of 2 words


def _mix(i, seed: int):
  """An odd 32-bit weight per flat index `i` (uint32; a murmur3-style finaliser)."""
  h = i * jnp.uint32(0x9E3779B1) + jnp.uint32(seed)
  h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
  h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
  return (h ^ (h >> 16)) | jnp.uint32(1)


def _array_sums(x) -> jax.Array:
  """[2] uint32: the two weighted sums of `x`'s words."""
  w = _words(x)
  flat = jnp.zeros(w.shape, jnp.uint32)  # the flat index, wrapping past 2**32 elements
  stride = 1
  for axis in reversed(range(w.ndim)):
    flat = flat + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride % 2**32)
    stride *= w.shape[axis]
  return jnp.stack([jnp.sum(w * _mix(flat, 0x3C6EF372), dtype=jnp.uint32),
                    jnp.sum(w * _mix(flat, 0x1B873593), dtype=jnp.uint32)])


def _all_sums(leaves: list) -> jax.Array:
  return jnp.stack([_array_sums(x) for x in leaves])


@functools.lru_cache(maxsize=None)
def _sums_on(devices: tuple | None):
  """`_all_sums` jitted with its [n, 2] result replicated over `devices` (the leaves' devices):
  every process reads all of it from its own copy, whatever the leaves' shardings."""
  if devices is None:
    return jax.jit(_all_sums)
  replicated = NamedSharding(Mesh(np.asarray(devices, dtype=object), ("all",)), PartitionSpec())
  return jax.jit(_all_sums, out_shardings=replicated)


def array_checksums(state: Any) -> dict[str, str]:
  """{leaf name: "dtype:16 hex digits"} for every array leaf of `state` (any sharding)."""
  named = [(leaf_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
           if hasattr(x, "dtype") and hasattr(x, "shape")]
  # One program per set of devices the leaves live on (in a trainer's state: one, the mesh's).
  groups: dict[Any, list[int]] = {}
  for i, (_, x) in enumerate(named):
    sharding = getattr(x, "sharding", None)
    devices = None if sharding is None else tuple(sorted(sharding.device_set, key=lambda d: d.id))
    groups.setdefault(devices, []).append(i)
  sums = np.zeros((len(named), 2), np.uint32)
  for devices, members in groups.items():
    out = _sums_on(devices)([jnp.asarray(named[i][1]) for i in members])
    sums[members] = np.asarray(out.addressable_data(0))
  return {name: f"{x.dtype}:{int(a):08x}{int(b):08x}" for (name, x), (a, b) in zip(named, sums)}


def _extra_crc(extra: Mapping[str, Any]) -> str:
  return f"{zlib.crc32(json.dumps(extra, sort_keys=True).encode()):08x}"


def sealed(extra: Mapping[str, Any], state: Any) -> dict[str, Any]:
  """`extra` with its `INTEGRITY` record: the state's array checksums and a CRC of the whole."""
  # Through JSON first: what is stored and read back (tuples as lists, keys as strings).
  out = {**json.loads(json.dumps(dict(extra))), INTEGRITY: {"arrays": array_checksums(state)}}
  out[INTEGRITY]["extra"] = _extra_crc(out)
  return out


def unseal(extra: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str] | None, str | None]:
  """(`extra` without its record, the array checksums (None: saved without them), why `extra`
  itself is damaged (None: it is not))."""
  extra = dict(extra)
  record = extra.pop(INTEGRITY, None)
  if record is None:
    return extra, None, None
  if not isinstance(record, dict) or not isinstance(record.get("arrays"), dict):
    return extra, None, "its checksum record is malformed"
  record = dict(record)
  crc = record.pop("extra", None)
  if crc != _extra_crc({**extra, INTEGRITY: record}):
    return extra, None, "checksum mismatch in its `extra` item"
  return extra, record["arrays"], None


def mismatches(state: Any, recorded: Mapping[str, str]) -> list[str]:
  """Names of the arrays of `state` whose checksum differs from `recorded` (arrays restored in
  another dtype than saved are not compared; arrays missing from `recorded` count as
  differing)."""
  now = array_checksums(state)
  bad = []
  for name, value in now.items():
    want = recorded.get(name)
    if want is None or (want.split(":")[0] == value.split(":")[0] and want != value):
      bad.append(name)
  return bad
