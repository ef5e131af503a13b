"""Checkpointer: async saves, keep-K, interrupted saves, mesh changes, mismatches, corruption,
falling back to the newest good checkpoint, and failed or oversized saves as one-line errors.

Needs 8 CPU devices for the mesh-change test: the flag is set here, before jax is imported,
unless the environment (or a conftest) already chose a device count.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import glob  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from distca_jax.train import checkpoint as checkpoint_lib  # noqa: E402
from distca_jax.train.checkpoint import (  # noqa: E402
    CheckpointCorruptError, CheckpointError, Checkpointer, CheckpointMismatchError,
    CheckpointSaveError, NoCheckpointError)

MODEL = {"hidden": 64, "layers": 2, "heads": 4}


def _mesh(shape, names):
  if jax.device_count() < int(np.prod(shape)):
    pytest.skip(f"needs {int(np.prod(shape))} devices, have {jax.device_count()}; on CPU, jax "
                f"started before this module set XLA_FLAGS (JAX_PLATFORMS=cpu on a GPU machine)")
  return Mesh(np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def _state(scale: float = 1.0, mesh=None):
  """A small training-state-like pytree; `w` sharded over `data` when a mesh is given."""
  w = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) * scale
  if mesh is not None:
    w = jax.device_put(w, NamedSharding(mesh, P("data", None)))
  return {"params": {"w": w, "b": jnp.full((8,), scale, jnp.bfloat16)},
          "opt": {"count": jnp.int32(int(scale)), "mu": jnp.ones((4, 6)) * scale}}


def _abstract(state, sharding_of=lambda path, a: getattr(a, "sharding", None)):
  return jax.tree_util.tree_map_with_path(
      lambda p, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding_of(p, a)), state)


def _assert_tree_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_periodic_async_saves_keep_last_k(tmp_path):
  with Checkpointer(tmp_path / "ck", save_every=2, keep=2) as ck:
    saved = [ck.maybe_save(step, _state(step), {"data_step": step, "model": MODEL}) for step in range(8)]
    ck.wait()
    assert saved == [True, False] * 4
    assert ck.all_steps() == [4, 6] and ck.latest_step() == 6
    state, extra = ck.restore(abstract_state=_abstract(_state()))
    _assert_tree_equal(state, _state(6))
    assert extra == {"data_step": 6, "model": MODEL}
    # A forced save off the interval (e.g. the last step of a run) is kept too.
    assert ck.maybe_save(9, _state(9), {"data_step": 9}, force=True)
  assert sorted(int(p.name) for p in (tmp_path / "ck").iterdir() if p.name.isdigit()) == [6, 9]
  with pytest.raises(TypeError, match="extra.*JSON"):
    Checkpointer(tmp_path / "ck2", 1, 1).maybe_save(0, _state(), {"bad": object()})


def test_restore_onto_different_mesh(tmp_path):
  mesh8 = _mesh((8,), ("data",))
  state = _state(3.0, mesh8)
  with Checkpointer(tmp_path, save_every=1, keep=1) as ck:
    ck.maybe_save(1, state, {"data_step": 1})

  mesh24 = _mesh((2, 4), ("data", "tensor"))
  specs = {"w": P("tensor", "data"), "b": P("tensor"), "count": P(), "mu": P("data", None)}
  target = _abstract(state, lambda p, a: NamedSharding(mesh24, specs[p[-1].key]))
  restored, extra = Checkpointer(tmp_path, 1, 1).restore(abstract_state=target)
  _assert_tree_equal(restored, jax.device_get(state))
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
    assert got.sharding == want.sharding
  assert restored["params"]["w"].addressable_shards[0].data.shape == (4, 4)
  assert extra == {"data_step": 1}

  # A target sharding that cannot tile its array is reported as the caller's error.
  specs["mu"] = P(None, "tensor")  # 6 columns over 4 devices
  bad = _abstract(state, lambda p, a: NamedSharding(mesh24, specs[p[-1].key]))
  with pytest.raises(ValueError, match="restore target state/opt/mu: .*evenly divide"):
    Checkpointer(tmp_path, 1, 1).restore(abstract_state=bad)


def _seed_checkpoints(directory: Path) -> None:
  with Checkpointer(directory, save_every=2, keep=5) as ck:
    for step in (2, 4):
      ck.maybe_save(step, _state(step), {"data_step": step})


def test_half_written_step_is_ignored(tmp_path):
  _seed_checkpoints(tmp_path)
  # What a killed save leaves behind: under atomic rename, a tmp directory with partial contents;
  # on a filesystem without atomic rename (commit-file mode), the step directory without its
  # commit marker. Both copies hold real data from step 4 but are incomplete.
  shutil.copytree(tmp_path / "4", tmp_path / "6.orbax-checkpoint-tmp-1234")
  os.remove(tmp_path / "6.orbax-checkpoint-tmp-1234" / "commit_success.txt")
  shutil.copytree(tmp_path / "4", tmp_path / "8")
  os.remove(tmp_path / "8" / "commit_success.txt")

  reader = Checkpointer(tmp_path, save_every=2, keep=5, read_only=True)
  assert reader.all_steps() == [2, 4] and reader.latest_step() == 4
  _, extra = reader.restore(abstract_state=_abstract(_state()))
  assert extra == {"data_step": 4}
  with pytest.raises(NoCheckpointError, match=r"step 8 .*incomplete .*complete steps are \[2, 4\]"):
    reader.restore(step=8, abstract_state=_abstract(_state()))
  with pytest.raises(NoCheckpointError, match=r"step 7 .*does not exist"):
    reader.restore(step=7)
  with pytest.raises(CheckpointError, match="read-only"):
    reader.maybe_save(10, _state())
  reader.close()

  # A writer removes the leftovers and can save those steps again. (Orbax removes its tmp
  # directories in the background, awaited by the first save: the listing is read after saving.)
  with Checkpointer(tmp_path, save_every=2, keep=5) as writer:
    assert writer.all_steps() == [2, 4]
    assert writer.maybe_save(6, _state(6), {"data_step": 6})
    assert writer.maybe_save(8, _state(8), {"data_step": 8})
    writer.wait()
    assert writer.latest_step() == 8
  assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "4", "6", "8"]
  with Checkpointer(tmp_path, save_every=2, keep=5, read_only=True) as again:
    assert again.restore(step=8, abstract_state=_abstract(_state()))[1] == {"data_step": 8}


_KILLED_SAVE = textwrap.dedent("""
    import os, sys
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    from distca_jax.train.checkpoint import Checkpointer

    ck = Checkpointer(sys.argv[1], save_every=1, keep=5)
    ck.maybe_save(1, {"w": jnp.ones((64, 64))}, {"data_step": 1})
    ck.wait()

    async def die(self, *args, **kwargs):
      os._exit(9)  # the process is killed after the files are written, before the commit
    atomicity.AtomicRenameTemporaryPath.finalize = die
    ck.maybe_save(2, {"w": jnp.full((64, 64), 2.0)}, {"data_step": 2})
    ck.wait()
    print("save 2 was not interrupted")
""")


def test_killed_save_never_restored(tmp_path):
  proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], capture_output=True,
                        text=True, timeout=120, env={**os.environ, "XLA_FLAGS": ""})
  assert proc.returncode == 9, proc.stdout + proc.stderr
  assert glob.glob(str(tmp_path / "2.orbax-checkpoint-tmp*")), "the killed save left no tmp directory"
  ck = Checkpointer(tmp_path, save_every=1, keep=5)
  assert ck.latest_step() == 1
  state, extra = ck.restore(abstract_state={"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)})
  assert extra == {"data_step": 1} and float(state["w"][0, 0]) == 1.0
  # The next run saves step 2 again over the leftovers.
  assert ck.maybe_save(2, {"w": jnp.full((64, 64), 2.0)}, {"data_step": 2})
  ck.close()
  assert Checkpointer(tmp_path, 1, 5).latest_step() == 2


def test_mismatched_model_shape_is_refused(tmp_path):
  with Checkpointer(tmp_path, save_every=1, keep=1) as ck:
    ck.maybe_save(1, _state(), {"data_step": 1, "model": MODEL})
  ck = Checkpointer(tmp_path, 1, 1)
  current = {**MODEL, "hidden": 128, "kv_heads": 2}
  with pytest.raises(CheckpointMismatchError) as err:
    ck.restore(abstract_state=_abstract(_state()), expect={"model": current})
  assert "model.hidden: checkpoint has 64, current run has 128" in str(err.value)
  assert "model.kv_heads: missing from the checkpoint" in str(err.value)
  assert "layers" not in str(err.value)
  # The same model shape restores; tuples in `expect` compare equal to the stored JSON lists.
  ck.restore(abstract_state=_abstract(_state()), expect={"model": MODEL, "data_step": 1})

  # Array shapes or tree structure that differ from the checkpoint are named too.
  bad = _state()
  bad["params"]["w"] = jnp.zeros((8, 8))
  del bad["opt"]["mu"]
  bad["opt"]["nu"] = jnp.zeros(3)
  with pytest.raises(CheckpointMismatchError) as err:
    ck.restore(abstract_state=_abstract(bad))
  msg = str(err.value)
  assert "state/params/w: checkpoint shape (16, 8), current (8, 8)" in msg
  assert "not in the checkpoint: state/opt/nu" in msg
  assert "not in the current state: state/opt/mu" in msg


def test_missing_directory_says_no_checkpoint(tmp_path):
  ck = Checkpointer(tmp_path / "nowhere", save_every=1, keep=1, read_only=True)
  assert ck.latest_step() is None
  with pytest.raises(NoCheckpointError, match="no checkpoint to restore: directory .*nowhere does not exist"):
    ck.restore(abstract_state=_abstract(_state()))
  with pytest.raises(NoCheckpointError, match="holds no complete checkpoint"):
    Checkpointer(tmp_path / "empty", save_every=1, keep=1).restore()


# A failed read leaves orbax's other pending chunk reads to be collected after their event loop
# closed; the resulting "Event loop is closed" noise is orbax's, not a failure of this code.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage, message", [
    ("truncate-data", "cannot read its array"),
    ("garble-data", "cannot read its array"),
    ("delete-data", "cannot read its array"),
    ("garble-array-metadata", "cannot read its array metadata"),
    ("garble-manifest", "cannot read its array metadata"),
    ("garble-extra", "cannot read its `extra` item"),
])
def test_corrupt_checkpoint_raises_clear_error(tmp_path, damage, message):
  _seed_checkpoints(tmp_path)
  step = tmp_path / "4"
  # OCDBT keeps array chunks in `state/ocdbt.process_*/d/` and the merged b-tree (with small
  # arrays inlined) in `state/d/`: damage every data file.
  data = glob.glob(str(step / "state" / "**" / "d" / "*"), recursive=True)
  assert len(data) >= 2
  how, what = damage.split("-", 1)
  files = {"data": data, "array-metadata": [step / "state" / "_METADATA"],
           "manifest": glob.glob(str(step / "state" / "**" / "manifest.ocdbt"), recursive=True),
           "extra": [step / "extra" / "metadata"]}[what]
  for f in map(Path, files):
    raw = f.read_bytes()
    if how == "truncate":
      f.write_bytes(raw[: len(raw) // 2])
    elif how == "garble":
      f.write_bytes(bytes(b ^ 0x5A for b in raw))
    else:
      f.unlink()
  with Checkpointer(tmp_path, 2, 5) as ck:
    with pytest.raises(CheckpointCorruptError, match=rf"checkpoint step 4 in .*: {message}") as err:
      ck.restore(abstract_state=_abstract(_state()))
    assert "TensorStore({" not in str(err.value)  # the spec dump stays in the exception chain
    # The older checkpoint is still usable.
    state, _ = ck.restore(step=2, abstract_state=_abstract(_state()))
    _assert_tree_equal(state, _state(2))


def test_resume_gives_the_same_run(tmp_path):
  """2N steps straight vs N steps, close, resume for N: parameters, optimizer state and data
  position come back exactly (a toy regression trained with AdamW)."""
  opt = optax.adamw(1e-2)

  def batch(step):
    rng = np.random.default_rng([0, step])
    x = rng.normal(size=(32, 8)).astype(np.float32)
    return x, x @ np.arange(8, dtype=np.float32)

  @jax.jit
  def train_step(state, x, y):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))(state["params"])
    updates, opt_state = opt.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, loss

  def run(state, start, stop, ck=None):
    losses = []
    for step in range(start, stop):
      state, loss = train_step(state, *batch(step))
      losses.append(float(loss))
      if ck is not None:
        ck.maybe_save(step + 1, state, {"data_step": step + 1})
    return state, losses

  params = {"w": jnp.zeros(8), "b": jnp.zeros(())}
  init = {"params": params, "opt": opt.init(params)}
  straight, straight_losses = run(init, 0, 10)

  with Checkpointer(tmp_path, save_every=5, keep=2) as ck:
    run(init, 0, 5, ck)
  ck = Checkpointer(tmp_path, save_every=5, keep=2)
  state, extra = ck.restore(abstract_state=jax.eval_shape(lambda: init))
  resumed, resumed_losses = run(state, extra["data_step"], 10, ck)
  ck.close()
  assert extra["data_step"] == 5
  assert resumed_losses == straight_losses[5:]
  _assert_tree_equal(resumed, straight)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_restore_newest_good_falls_back_and_reports_each_skipped_step(tmp_path):
  with Checkpointer(tmp_path, save_every=2, keep=5) as ck:
    for step in (2, 4, 6):
      ck.maybe_save(step, _state(step), {"data_step": step})
  for f in glob.glob(str(tmp_path / "6" / "state" / "**" / "d" / "*"), recursive=True):
    Path(f).write_bytes(Path(f).read_bytes()[:10])  # truncated
  ck = Checkpointer(tmp_path, 2, 5)
  restore = lambda step: ck.restore(step, abstract_state=_abstract(_state()))
  # Step 4 read fine, but the caller finds its state bad (say, not finite).
  bad_at_4 = lambda state: "not finite" if float(state["opt"]["mu"][0, 0]) == 4 else None
  state, extra, skipped = ck.restore_newest_good(restore, problem=bad_at_4)
  assert extra == {"data_step": 2} and float(state["opt"]["mu"][0, 0]) == 2
  assert len(skipped) == 2 and skipped[0][0] == 6 and skipped[0][1].startswith("unreadable: ")
  assert skipped[1] == (4, "not finite")
  # A chosen step is that step or an error, never another.
  _, extra, skipped = ck.restore_newest_good(restore, step=4)
  assert extra == {"data_step": 4} and skipped == []
  with pytest.raises(CheckpointCorruptError, match=r"checkpoint step 4 in .*: not finite$"):
    ck.restore_newest_good(restore, step=4, problem=bad_at_4)
  with pytest.raises(NoCheckpointError, match=r"step 5 .*does not exist; complete steps are \[2, 4, 6\]"):
    ck.restore_newest_good(restore, step=5)
  with pytest.raises(CheckpointCorruptError, match=r"^no good checkpoint in .*: step 6 \(unreadable: "
                                                   r".*\); step 4 \(bad\); step 2 \(bad\)$"):
    ck.restore_newest_good(restore, problem=lambda state: "bad")
  ck.close()


def test_failed_background_save_is_one_line_at_the_next_check(tmp_path, monkeypatch):
  """A save that fails while its files are written in the background (here: the disk fills up
  as the step is committed) raises CheckpointSaveError at the next check_saves or wait: one
  line naming the directory and the cause; the failed step is not listed."""
  from orbax.checkpoint._src.path import atomicity

  async def full(self, *args, **kwargs):
    raise OSError(28, "No space left on device")

  ck = Checkpointer(tmp_path, save_every=1, keep=5)
  assert ck.maybe_save(1, _state(1), {"data_step": 1})
  ck.wait()
  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", full)
  assert ck.maybe_save(2, _state(2), {"data_step": 2})
  with pytest.raises(CheckpointSaveError) as err:
    for _ in range(600):  # the background write finishes within moments
      ck.check_saves()
      time.sleep(0.05)
  message = str(err.value)
  assert "\n" not in message and str(tmp_path) in message
  assert message.endswith("OSError: [Errno 28] No space left on device"), message
  assert ck.all_steps() == [1]
  monkeypatch.undo()
  ck.close()


def test_a_save_the_disk_has_no_room_for_is_refused_up_front(tmp_path, monkeypatch):
  free = shutil.disk_usage(tmp_path)
  monkeypatch.setattr(checkpoint_lib.shutil, "disk_usage",
                      lambda path: free._replace(free=5 << 20))
  assert checkpoint_lib.space_problem(tmp_path, 0) is not None  # 5 MiB < the headroom
  with Checkpointer(tmp_path, save_every=1, keep=1) as ck:
    with pytest.raises(CheckpointSaveError, match=r"^cannot save checkpoint step 1: 5.0 MiB free on "
                                                  r"the disk of .*, a checkpoint needs 16.0 MiB"):
      ck.maybe_save(1, _state(), {"data_step": 1})
    assert ck.all_steps() == []


# ----------------------------------------------------------------------------- integrity

def _file_kind(relative: str) -> str:
  """`state/ocdbt.process_*/d/*` for `state/ocdbt.process_0/d/0a1b...`: files alike in role."""
  parts = relative.split("/")
  if len(parts) >= 2 and parts[-2] == "d":
    parts[-1] = "*"
  return "/".join(p if not p.startswith("ocdbt.process_") else "ocdbt.process_*" for p in parts)


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
  """One committed checkpoint (step 1) of a state of several dtypes, shapes and shardings."""
  directory = tmp_path_factory.mktemp("committed")
  mesh = _mesh((2,), ("data",))
  state = _state(3.0, mesh)
  state["opt"]["nu"] = jnp.asarray(np.random.default_rng(0).normal(size=(130, 64)), jnp.float32)
  state["opt"]["flag"] = jnp.asarray([True, False, True])
  with Checkpointer(directory, save_every=1, keep=1) as ck:
    ck.maybe_save(1, state, {"step": 1, "model": MODEL})
  return directory, jax.device_get(state)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_every_single_bit_flip_is_detected_or_harmless(committed):
  """A bit flipped at random positions of every file of a committed checkpoint (a few positions
  per file, dozens in all): each restore either raises a CheckpointError or gives back the saved
  arrays and `extra` exactly. Without the checksums, flips in the array chunks loaded as other
  values silently; at least one flip here is caught by them alone."""
  directory, saved = committed
  step_dir = directory / "1"
  files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.stat().st_size > 0)
  kinds = {}
  for f in files:
    kinds.setdefault(_file_kind(str(f.relative_to(step_dir))), []).append(f)
  assert {"state/_METADATA", "state/manifest.ocdbt", "extra/metadata"} <= set(kinds), sorted(kinds)
  assert any(k.endswith("/d/*") for k in kinds), sorted(kinds)
  rng = np.random.default_rng(7)
  outcomes, checksum_caught = {}, 0
  target = _abstract(saved)
  for kind, paths in sorted(kinds.items()):
    for _ in range(4 if kind.endswith("/d/*") or kind == "extra/metadata" else 2):
      f = paths[int(rng.integers(len(paths)))]
      raw = f.read_bytes()
      bit = int(rng.integers(len(raw) * 8))
      f.write_bytes(raw[:bit // 8] + bytes([raw[bit // 8] ^ (1 << bit % 8)]) + raw[bit // 8 + 1:])
      try:
        with Checkpointer(directory, 1, 1, read_only=True) as ck:
          state, extra = ck.restore(1, abstract_state=target)
      except CheckpointError as e:
        outcome = "detected"
        checksum_caught += isinstance(e, checkpoint_lib.CheckpointIntegrityError)
      else:
        assert extra == {"step": 1, "model": MODEL}, (kind, bit, extra)
        for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(saved)[0],
                                     jax.tree.leaves(state), strict=True):
          assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), (kind, bit, path)
        outcome = "harmless"
      finally:
        f.write_bytes(raw)
      outcomes.setdefault(kind, []).append(outcome)
  assert sum(len(v) for v in outcomes.values()) >= 24, outcomes
  assert checksum_caught >= 1, outcomes


def test_arrays_unlike_their_checksums_are_skipped_naming_the_array(tmp_path):
  """Step 4's `w` no longer matches the checksum committed with it (its record rewritten, the
  record's own CRC made to match): restore names the array, the fallback skips the step in one
  reason, and with verify=False the step restores as stored."""
  from distca_jax.train import integrity

  _seed_checkpoints(tmp_path)
  meta = tmp_path / "4" / "extra" / "metadata"
  extra = json.loads(meta.read_text())
  record = extra[integrity.INTEGRITY]
  name = "params/w"
  dtype, digits = record["arrays"][name].split(":")
  record["arrays"][name] = f"{dtype}:{int(digits, 16) ^ 1:016x}"
  del record["extra"]
  record["extra"] = integrity._extra_crc(extra)
  meta.write_text(json.dumps(extra))
  ck = Checkpointer(tmp_path, 2, 5, read_only=True)
  with pytest.raises(checkpoint_lib.CheckpointIntegrityError,
                     match=r"checkpoint step 4 in .*: checksum mismatch in state/params/w$"):
    ck.restore(abstract_state=_abstract(_state()))
  restore = lambda step: ck.restore(step, abstract_state=_abstract(_state()))
  _, older, skipped = ck.restore_newest_good(restore)
  assert older == {"data_step": 2} and skipped == [(4, "checksum mismatch in state/params/w")]
  trusting = Checkpointer(tmp_path, 2, 5, read_only=True, verify=False)
  _assert_tree_equal(trusting.restore(abstract_state=_abstract(_state()))[0], _state(4))
  # A changed value in `extra` itself (here the step) is caught by its CRC.
  extra["data_step"] = 5
  meta.write_text(json.dumps(extra))
  with pytest.raises(checkpoint_lib.CheckpointIntegrityError, match="checksum mismatch in its `extra`"):
    Checkpointer(tmp_path, 2, 5, read_only=True).read_extra(4)


def _numpy_checksum(x: np.ndarray) -> str:
  """The checksum from its definition (integrity.py), in numpy: each element's bits as uint32
  words times an odd weight of its flat index, summed modulo 2**32, for two weight seeds."""
  words = (x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)).astype(np.uint64).ravel()
  i = np.arange(words.size, dtype=np.uint64)
  out = []
  for seed in (0x3C6EF372, 0x1B873593):
    m = 0xFFFFFFFF
    h = (i * 0x9E3779B1 + seed) & m
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & m
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & m
    w = (h ^ (h >> 16)) | 1
    out.append(int(np.sum((words * w) & m) & m))
  return f"{x.dtype}:{out[0]:08x}{out[1]:08x}"


def test_checksums_follow_their_definition_on_any_sharding():
  """The device checksums equal a numpy computation of their definition, on every sharding of
  the array (the sum's order does not matter), and change with any single flipped bit."""
  from distca_jax.train import integrity

  mesh = _mesh((2, 4), ("data", "tensor"))
  rng = np.random.default_rng(3)
  x = rng.normal(size=(16, 24)).astype(np.float32)
  arrays = {"f32": x, "bf16": np.asarray(jnp.asarray(x, jnp.bfloat16)), "i32": np.arange(40, dtype=np.int32)}
  want = {k: _numpy_checksum(v) for k, v in arrays.items()}
  assert integrity.array_checksums(arrays) == want
  for spec in (P("data", "tensor"), P("tensor", None), P()):
    placed = {k: jax.device_put(v, NamedSharding(mesh, spec if v.ndim == 2 else P()))
              for k, v in arrays.items()}
    assert integrity.array_checksums(placed) == want
  words = x.view(np.uint32).copy()
  for _ in range(32):
    flipped = words.copy()
    flipped.flat[rng.integers(words.size)] ^= np.uint32(1 << int(rng.integers(32)))
    assert integrity.array_checksums({"f32": flipped.view(np.float32)})["f32"] != want["f32"]
