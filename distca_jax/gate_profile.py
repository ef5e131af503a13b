"""The step gate's cost profile file (`attention.gate_profile`): reading and checking it.

Apart from `gate.py` so the config can check the file at load without importing the gate, which
imports the config."""

from __future__ import annotations

import functools
import json
from pathlib import Path

# The shipped profile, fitted on the step times of `gate_fit.json`'s setup.
FIT_DATA = Path(__file__).with_name("gate_fit.json")

# A cost profile's numbers (`attention_cost` is per kernel, `fit_kernel` names the fit's), and
# those a profile may leave out, with their value then: a profile written before CAD's fixed cost
# was split had its machinery inside `exchange_fixed`.
PROFILE_COSTS = ("exchange_fixed", "exchange_flops_per_byte", "network_byte_cost", "machinery")
OPTIONAL_COSTS = {"machinery": 0.0}


@functools.cache
def read_profile(path: str | None = None) -> dict:
  """The gate's fitted cost profile at `path` (`attention.gate_profile`; None: the shipped
  `gate_fit.json`): `fit_kernel`, `attention_cost` per kernel, and `PROFILE_COSTS`, as
  `launch/fit_gate.py --write-profile` writes it. Raises ValueError saying what is wrong."""
  where = Path(path) if path else FIT_DATA
  try:
    data = json.loads(where.read_text())
  except (OSError, ValueError) as e:
    raise ValueError(f"{str(where)!r} is not a readable JSON cost profile ({e})") from None
  costs = data.get("attention_cost") if isinstance(data, dict) else None
  if not isinstance(costs, dict) or data.get("fit_kernel") not in costs:
    raise ValueError(f"{str(where)!r}: a cost profile has `attention_cost` per kernel and its "
                     "`fit_kernel` among them (launch/fit_gate.py --write-profile writes one)")
  data = {**OPTIONAL_COSTS, **data}
  for name, value in [*costs.items(), *((k, data.get(k)) for k in PROFILE_COSTS)]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
      raise ValueError(f"{str(where)!r}: {name} must be a number >= 0, got {value!r}")
  return data


