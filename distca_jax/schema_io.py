"""Configuration schemas as text: YAML files and `key.sub=value` overrides read into a schema
(`load`), and a schema written back as YAML (`to_yaml`) or as `--help` lines (`describe`).

The types, rules, merging and checks are `distca_jax/schema.py`'s; this module only turns text
into the mappings it merges, and instances into text. Errors are `ConfigError`s that name the
file or the override a bad value comes from.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
import typing
from pathlib import Path
from typing import Any

import yaml

from distca_jax.schema import (ConfigError, check, describe_type, field_hints, merge,
                               split_annotation)


# ----------------------------------------------------------------------------- reading


class _UniqueKeyLoader(yaml.SafeLoader):
  """PyYAML's safe loader, refusing a mapping that repeats a key (PyYAML keeps the last one)."""

  def construct_mapping(self, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
      if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may repeat keys by design
        continue
      key = self.construct_object(key_node, deep=True)
      if isinstance(key, typing.Hashable):
        if key in seen:
          raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                                  key_node.start_mark)
        seen.add(key)
    return super().construct_mapping(node, deep)


def _yaml_error(e: yaml.YAMLError) -> str:
  """One line: what is wrong and where (PyYAML's own message spans several)."""
  mark = getattr(e, "problem_mark", None)
  what = getattr(e, "problem", None) or str(e).splitlines()[0]
  where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
  return f"{' '.join(str(what).split())}{where}"


def parse_yaml(text: str, where: str):
  """`text` parsed as YAML (duplicate keys refused); a ConfigError starting with `where`."""
  try:
    return yaml.load(text, Loader=_UniqueKeyLoader)
  except yaml.YAMLError as e:
    raise ConfigError(f"{where}: not valid YAML: {_yaml_error(e)}") from None
  except RecursionError:
    raise ConfigError(f"{where}: nested too deeply") from None


def parse_override(text: str) -> dict[str, Any]:
  """`"a.b=3"` -> `{"a": {"b": 3}}`, the value parsed as YAML (`true`, `1e-4`, `[1, 2]`)."""
  if "=" not in text:
    raise ConfigError(f"override {text!r}: expected key.sub=value")
  key, raw = text.split("=", 1)
  key = key.strip()
  if not key or any(not part for part in key.split(".")):
    raise ConfigError(f"override {text!r}: empty key")
  out = parse_yaml(raw, f"override {text!r}") if raw.strip() else None
  for part in reversed(key.split(".")):
    out = {part: out}
  return out


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
  """The top-level mapping of a YAML config file; a ConfigError naming the file otherwise."""
  where = f"config file {path}"
  path = Path(path)
  if not path.exists():
    raise ConfigError(f"{where} does not exist")
  if path.is_dir():
    raise ConfigError(f"{where}: is a directory, not a YAML file")
  try:
    text = path.read_bytes().decode("utf-8")
  except UnicodeDecodeError:
    raise ConfigError(f"{where}: not a text (UTF-8) file") from None
  except OSError as e:
    raise ConfigError(f"{where}: cannot be read ({e.strerror or e})") from None
  if "\0" in text:
    raise ConfigError(f"{where}: not a text file (it holds NUL bytes)")
  data = parse_yaml(text, where)
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
  return data


def load(default, path: str | Path | None = None, overrides=()):
  """`default` (a schema instance), then the YAML file at `path` (if any), then each `key=value`
  override, then every field's rules. Cross-field checks are the schema's own module's
  (`config_checks.validate`, `sim/config.validate`)."""
  config = default
  if path is not None:
    config = merge(config, read_yaml_mapping(path))
  for text in overrides:
    config = merge(config, parse_override(text))
  return check(config)


# ----------------------------------------------------------------------------- printing


def to_dict(obj) -> dict[str, Any]:
  """A schema instance as nested dicts and lists (JSON- and YAML-ready)."""
  def plain(v):
    if isinstance(v, dict):
      return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
      return [plain(x) for x in v]
    return v
  return plain(dataclasses.asdict(obj))


class _Dumper(yaml.SafeDumper):
  """Sections as blocks, lists on one line (`gpus: [64, 128]`)."""


_Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v,
                                                                flow_style=True))


def to_yaml(obj) -> str:
  """A schema instance as YAML that `load` reads back to the same instance."""
  return yaml.dump(to_dict(obj), Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                   width=100, allow_unicode=True)


def _yaml_scalar(value) -> str:
  return yaml.safe_dump(to_dict(value) if dataclasses.is_dataclass(value) else
                        list(value) if isinstance(value, tuple) else value,
                        default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def _comments(cls) -> dict[str, str]:
  """The comment above each field of `cls` (or the one at its line's end), read from the source:
  its first sentence (two if the first is short), for `--help`."""
  try:
    lines = inspect.getsource(cls).splitlines()
  except (OSError, TypeError):
    return {}
  out, block = {}, []
  for line in lines:
    stripped = line.strip()
    if stripped.startswith("#"):
      block.append(stripped.lstrip("#").strip())
      continue
    # A field's first line (`name: type = default`, or a type continued on the next lines).
    match = re.match(r"\s+(\w+): [^#]*?(#\s*(.*))?$", line)
    if match:
      text = " ".join(block) or (match.group(3) or "")
      sentences = re.split(r"(?<=\.)\s", text)
      # The first sentence, and the second where the first is short (often a bare label).
      short = len(sentences) > 1 and len(sentences[0]) < 80
      out[match.group(1)] = " ".join(sentences[:2] if short else sentences[:1]).rstrip(".")
    block = []
  return out


def describe(schema, prefix: str = "", heading: str = "") -> list[str]:
  """The schema as `--help` lines: per section its docstring, then every field with what it
  accepts, its default in brackets, and the first sentence of its comment."""
  hints, fields = field_hints(schema), dataclasses.fields(schema)
  default = schema()
  doc = (schema.__doc__ or "").strip()
  if doc.startswith(f"{schema.__name__}("):  # dataclass's generated docstring
    doc = ""
  title = heading or prefix.rstrip(".") or "top level"
  lines = [f"{title}:" + (f" {doc.splitlines()[0]}" if doc else "")]
  comments = _comments(schema)
  nested = []
  if all(dataclasses.is_dataclass(split_annotation(hints[f.name])[0]) for f in fields):
    lines = []  # only sections: no heading of its own
  for f in fields:
    kind = split_annotation(hints[f.name])[0]
    item = typing.get_args(kind)[0] if typing.get_origin(kind) is tuple else None
    if dataclasses.is_dataclass(kind):
      nested.append((kind, f"{prefix}{f.name}.", ""))
      continue
    if dataclasses.is_dataclass(item):
      nested.append((item, f"{prefix}{f.name}[i].", f"{prefix}{f.name}: each entry"))
    value = _yaml_scalar(getattr(default, f.name))
    lines.append(f"  {prefix}{f.name}: {describe_type(hints[f.name])}  [{value}]")
    if comments.get(f.name):
      lines += textwrap.wrap(comments[f.name], 100, initial_indent=" " * 6,
                             subsequent_indent=" " * 6)
  for kind, sub, head in nested:
    lines += ([""] if lines else []) + describe(kind, sub, head)
  return lines
