"""Runtime options: each adapter declares its knobs; values are checked before a model loads.

A declaration names the option, its value shape, default and help; `validate` turns raw values
(from Python or a command line) into typed ones and names the first bad one and why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from engines.errors import OptionError

SHAPES = ("int", "float", "bool", "str", "choice", "floats")


class OptionSpec(msgspec.Struct, frozen=True):
    """One option of a runtime."""

    name: str
    shape: str  # one of SHAPES
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None


def _convert(spec: OptionSpec, value: Any) -> Any:
    if value is None:
        return None
    if spec.shape == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ValueError("expected true or false")
    if spec.shape == "int":
        if isinstance(value, bool) or not isinstance(value, (int, str)) or (isinstance(value, str) and not value.strip().lstrip("-").isdigit()):
            raise ValueError("expected a whole number")
        number = int(value)
    elif spec.shape == "float":
        if isinstance(value, bool):
            raise ValueError("expected a number")
        number = float(value)
    elif spec.shape == "floats":
        parts = value.split(",") if isinstance(value, str) else list(value)
        return tuple(float(part) for part in parts)
    elif spec.shape in ("str", "choice"):
        if not isinstance(value, str):
            raise ValueError("expected text")
        if spec.choices and value not in spec.choices:
            raise ValueError(f"expected one of {', '.join(spec.choices)}")
        return value
    else:
        raise ValueError(f"unknown option shape {spec.shape!r}")
    if spec.minimum is not None and number < spec.minimum:
        raise ValueError(f"must be >= {spec.minimum:g}")
    if spec.maximum is not None and number > spec.maximum:
        raise ValueError(f"must be <= {spec.maximum:g}")
    return number


def validate(runtime: str, specs: Sequence[OptionSpec], values: Mapping[str, Any],
             combinations: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every declared option with its typed value (defaults filled in). OptionError names the
    runtime, the option and what it accepts; `combinations` may refuse a mix of valid values."""
    by_name = {spec.name: spec for spec in specs}
    unknown = sorted(set(values) - set(by_name))
    if unknown:
        raise OptionError(f"{runtime}: unknown option {unknown[0]!r}; `superfluid runtime options {runtime}` "
                          f"lists the {len(by_name)} it takes")
    typed = {}
    for spec in specs:
        raw = values.get(spec.name, spec.default)
        try:
            typed[spec.name] = _convert(spec, raw)
        except (TypeError, ValueError) as exc:
            raise OptionError(f"{runtime} option {spec.name}={raw!r}: {exc} ({spec.help})") from None
    if combinations is not None:
        combinations(typed)
    return typed
