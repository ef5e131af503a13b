"""Typed configuration schemas: frozen dataclasses whose field types say what they accept, values
merged into them, and checks that name the field. The trainer's schema (`distca_jax/config.py`)
and the simulator's (`distca_jax/sim/config.py`) are both read by `schema_io.load` (YAML files
and `key.sub=value` overrides, `distca_jax/schema_io.py`), which merges and checks with this
module.

A field's type says what it accepts; `Annotated` adds the checks:

  bool, int, str              exactly that YAML type (a bool is not an int); ints fit 64 bits
  float                       a finite number (an int, or a string such as `1e-4` that PyYAML
                              reads as one); NaN and infinities are refused
  Literal["a", "b"]           a closed set; the error lists it
  X | None                    `null` or an X
  tuple[X, ...]               a YAML list of X
  tuple[D, ...], D a schema   a list of mappings, each over D's defaults
  D, a schema                 a mapping over the current value (YAML, then overrides)
  Annotated[X, rule, ...]     rules: `Range`, `NON_EMPTY`, `WRITABLE_DIR`; `ONE_OR_LIST`,
                              which lets a tuple field take one value for a one-item list; and
                              `Removed`, values a field no longer takes and what to use instead

A schema class may name its removed or renamed fields in a `RENAMED` class attribute (field ->
what to set instead): a config that still sets one gets an error saying so, not "unknown field".

Types are checked while the YAML and the overrides are merged; the rules once, on the merged
config (so a later override may fix an earlier value). Every error is a `ConfigError` whose message
starts with the dotted field (`optim.lr: ...`), the file, or the override it comes from.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar


class ConfigError(ValueError):
  """A configuration value is unknown, of the wrong type, out of range, or inconsistent."""


# ----------------------------------------------------------------------------- rules


@dataclasses.dataclass(frozen=True)
class Range:
  """Bounds of a number (`ge`/`gt`/`le`/`lt`), a step (`multiple_of`), and values allowed outside
  them (`also`, e.g. -1 for "all the rest"); `why` is said when a value is refused."""

  ge: float | None = None
  gt: float | None = None
  le: float | None = None
  lt: float | None = None
  multiple_of: int | None = None
  also: tuple = ()
  why: str = ""

  def holds(self, v) -> bool:
    """Whether the number `v` is inside the range (or one of `also`)."""
    if v in self.also:
      return True
    return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
            and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt)
            and (self.multiple_of is None or v % self.multiple_of == 0))

  def describe(self) -> str:
    """The range in words, as `--help` and errors say it: `>= 1`, `in [0, 1)`, `>= 1 or -1`."""
    lo = hi = None
    if self.ge is not None or self.gt is not None:
      lo = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}"
    if self.le is not None or self.lt is not None:
      hi = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})"
    if lo and hi:
      text = f"in {lo}, {hi}"
    elif lo:
      text = (">= " if lo[0] == "[" else "> ") + lo[1:]
    elif hi:
      text = ("<= " if hi[-1] == "]" else "< ") + hi[:-1]
    else:
      text = ""
    if self.multiple_of:
      text += (", " if text else "") + f"a multiple of {self.multiple_of}"
    if self.also:
      text += " or " + " or ".join(str(a) for a in self.also)
    return text

  def check(self, path: str, value, item: str = "") -> None:
    """A ConfigError naming `path` (and `item`, for a list's element) unless `value` holds."""
    if not self.holds(value):
      why = f" ({self.why})" if self.why else ""
      if item:
        raise ConfigError(f"{path}: {value!r} ({item}) must be {self.describe()}{why}")
      raise ConfigError(f"{path}: must be {self.describe()}{why}, got {value!r}")


def _num(x) -> str:
  """A bound as written: `2**32` for a large power of two, else the shortest float form."""
  if isinstance(x, int) and x > 2**20 and not x & (x - 1):
    return f"2**{x.bit_length() - 1}"
  return f"{x:g}"


class _Marker:
  """A rule without parameters; `text` is how `--help` says it."""

  def __init__(self, name: str, text: str):
    self.name, self.text = name, text

  def __repr__(self):
    return self.name


class Removed:
  """Values a field took once and no longer does, each with what to use instead:
  `Removed(shifted="use ragged")`. Giving one is a ConfigError that says it."""

  def __init__(self, **instead: str):
    self.instead = tuple(instead.items())

  def check(self, path: str, value) -> None:
    for old, why in self.instead:
      if value == old:
        raise ConfigError(f"{path}: {old!r} was removed; {why}")


# A tuple field that must hold at least one item.
NON_EMPTY = _Marker("NON_EMPTY", "non-empty")
# A tuple field that also takes a single value, read as a one-item list (`gpus=64`).
ONE_OR_LIST = _Marker("ONE_OR_LIST", "or one value")
# A directory the run writes into: it is a directory, or can be made one, and is writable.
WRITABLE_DIR = _Marker("WRITABLE_DIR", "a writable directory")

T = TypeVar("T")
PositiveInt = Annotated[int, Range(ge=1)]
NonNegInt = Annotated[int, Range(ge=0)]
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegFloat = Annotated[float, Range(ge=0)]
Probability = Annotated[float, Range(ge=0, lt=1)]  # Adam's betas, a tolerance
Fraction = Annotated[float, Range(ge=0, le=1)]
Seed = Annotated[int, Range(ge=0, lt=2**32, why="a uint32 seed")]
# Step numbers and counts: the optimizer counts steps in int32 on the device.
StepCount = Annotated[int, Range(ge=1, lt=2**31, why="an int32 step count")]
NonNegStepCount = Annotated[int, Range(ge=0, lt=2**31, why="an int32 step count")]
OutputDir = Annotated[str, WRITABLE_DIR]
# A sweep axis: a non-empty list, or one value.
Axis = Annotated[tuple[T, ...], NON_EMPTY, ONE_OR_LIST]


def check_writable_dir(path: str, value: str) -> None:
  """A ConfigError naming `path` unless `value` is a directory, or a path one can be made at, that
  this process can write into (tried with a temporary file: permission bits do not bind root, and
  a read-only mount shows only on writing)."""
  if not value:
    raise ConfigError(f"{path}: must name a directory, got ''")
  if re.match(r"[a-z][a-z0-9+.-]*://", value):  # gs://, s3://: the writer's file system checks it
    return
  try:
    target = Path(value).expanduser()
    probe = target
    while not probe.exists() and probe != probe.parent:
      probe = probe.parent
    if probe.exists() and not probe.is_dir():
      what = "is a file" if probe == target else f"lies under {str(probe)!r}, which is a file"
      raise ConfigError(f"{path}: {value!r} {what}, not a directory")
    try:
      fd, name = tempfile.mkstemp(dir=probe, prefix=".distca-write-check-")
    except OSError as e:
      raise ConfigError(f"{path}: {value!r} is not writable ({str(probe)!r}: "
                        f"{e.strerror or e})") from None
    os.close(fd)
    os.unlink(name)
  except ConfigError:
    raise
  except (OSError, ValueError, RuntimeError) as e:  # a NUL byte; `~user` with no such user
    raise ConfigError(f"{path}: {value!r} is not a usable directory ({e})") from None


# ----------------------------------------------------------------------------- types


def split_annotation(annotation) -> tuple[Any, tuple]:
  """(the type under `Annotated`, its rules); (annotation, ()) for a plain type."""
  if typing.get_origin(annotation) is Annotated:
    return annotation.__origin__, annotation.__metadata__
  return annotation, ()


def field_hints(cls) -> dict[str, Any]:
  """Each field of the schema class `cls` -> its annotation, `Annotated` rules kept."""
  return typing.get_type_hints(cls, include_extras=True)


def _coerce(path: str, annotation, value, current=None, rules: bool = False):
  """`value` as `annotation` (a ConfigError naming `path` if it is not one). `current`: a nested
  schema's value to merge a mapping over. `rules`: also apply the `Annotated` rules."""
  kind, meta = split_annotation(annotation)
  origin, args = typing.get_origin(kind), typing.get_args(kind)
  if ONE_OR_LIST in meta and not isinstance(value, (list, tuple)):
    value = [value]
  for rule in meta:
    if isinstance(rule, Removed):
      rule.check(path, value)
  if origin is Literal:
    if isinstance(value, bool) or value not in args:
      raise ConfigError(f"{path}: {value!r} is not allowed; choose one of {list(args)}")
    out = value
  elif origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    errors = []
    for arg in args:
      if arg is not type(None):
        try:
          return _coerce(path, arg, value, current, rules)
        except ConfigError as e:
          errors.append(str(e))
    if len(errors) > 1:  # e.g. `int >= 1 | auto`: say both
      raise ConfigError(f"{path}: expected {describe_type(annotation)}, got {value!r}")
    raise ConfigError(errors[0])
  elif dataclasses.is_dataclass(kind):
    if isinstance(value, kind):
      return check(value, f"{path}.") if rules else value
    if not isinstance(value, dict):
      names = [f.name for f in dataclasses.fields(kind)]
      raise ConfigError(f"{path}: expected a mapping of {names}, got {value!r}")
    return merge(current if current is not None else kind(), value, f"{path}.")
  elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{path}: expected a list, got {value!r}")
    item_kind, item_rules = split_annotation(args[0])
    out = tuple(_coerce(f"{path}[{i}]", item_kind, v, rules=rules) for i, v in enumerate(value))
    if rules:
      for i, v in enumerate(out):
        for rule in item_rules:
          if isinstance(rule, Range):
            rule.check(path, v, f"item {i}")
  else:
    out = _scalar(path, kind, value)
  if rules:
    for rule in meta:
      if isinstance(rule, Range):
        rule.check(path, out)
      elif rule is NON_EMPTY and not out:
        raise ConfigError(f"{path}: must not be empty")
      elif rule is WRITABLE_DIR:
        check_writable_dir(path, out)
  return out


def _scalar(path: str, kind, value):
  if kind is bool:
    if isinstance(value, bool):
      return value
    raise ConfigError(f"{path}: expected true or false, got {value!r}")
  if kind is int:
    if not isinstance(value, int) or isinstance(value, bool):
      raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if not -2**63 <= value < 2**63:
      raise ConfigError(f"{path}: {value} does not fit in 64 bits")
    return value
  if kind is float:
    number = None
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
      try:  # YAML 1.1 reads `1e-4` (no dot) as a string; accept any float literal.
        number = float(value)
      except OverflowError:  # an int past float's range
        number = math.inf
      except ValueError:
        pass
    if number is None:
      raise ConfigError(f"{path}: expected a number, got {value!r}")
    if not math.isfinite(number):
      raise ConfigError(f"{path}: must be a finite number, got {value!r}")
    return number
  if kind is str:
    if isinstance(value, str):
      return value
    raise ConfigError(f"{path}: expected a string, got {value!r}")
  raise ConfigError(f"{path}: unsupported field type {kind}")


# ----------------------------------------------------------------------------- merging and checks


def merge(obj, updates: dict, prefix: str = ""):
  """`obj` (a schema instance) with the fields of the nested mapping `updates` replaced, each
  coerced to its field's type. Rules are not applied (see `check`)."""
  if not isinstance(updates, dict):
    raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {updates!r}")
  hints = field_hints(type(obj))
  names = [f.name for f in dataclasses.fields(obj)]
  renamed = getattr(type(obj), "RENAMED", {})
  changes = {}
  for key, value in updates.items():
    path = f"{prefix}{key}"
    if key in renamed and key not in names:
      raise ConfigError(f"{path}: removed; {renamed[key]}")
    if key not in names:
      raise ConfigError(f"{path}: unknown field; known fields are {sorted(names)}")
    changes[key] = _coerce(path, hints[key], value, current=changes.get(key, getattr(obj, key)))
  return dataclasses.replace(obj, **changes)


def check(obj, prefix: str = ""):
  """Applies every field's rules (ranges, non-empty lists, writable directories) to `obj`, in
  field order; returns `obj`."""
  hints = field_hints(type(obj))
  for f in dataclasses.fields(obj):
    _coerce(f"{prefix}{f.name}", hints[f.name], getattr(obj, f.name), rules=True)
  return obj


# ----------------------------------------------------------------------------- describing


def describe_type(annotation) -> str:
  """What a field accepts, in words: `int >= 1`, `one of a, b`, `list of int, or null`."""
  kind, meta = split_annotation(annotation)
  origin, args = typing.get_origin(kind), typing.get_args(kind)
  if origin is Literal:
    text = "one of " + ", ".join(str(a) for a in args)
  elif origin in (typing.Union, types.UnionType):
    inner = [describe_type(a) for a in args if a is not type(None)]
    return " | ".join(inner) + (", or null" if type(None) in args else "")
  elif dataclasses.is_dataclass(kind):
    text = f"a {kind.__name__} mapping"
  elif origin is tuple:
    text = f"list of {describe_type(args[0])}"
    if dataclasses.is_dataclass(args[0]):
      text = f"list of {args[0].__name__} mappings"
  else:
    text = kind.__name__
  for rule in meta:
    if isinstance(rule, Range):
      text += f" {rule.describe()}" if rule.describe()[0] in "<>i" else f", {rule.describe()}"
      text += f" ({rule.why})" if rule.why else ""
    elif rule is NON_EMPTY:
      text = f"non-empty {text}"
    elif isinstance(rule, _Marker):
      text += f", {rule.text}"
  return text
