"""Grids of gin bindings: axes, their expansion into points, and each point's run-directory name (DESIGN: "Everything
is a gin parameter", so a sweep or an ablation is a set of bindings per run).

Pure. An axis is a list of values; a value is a label, the gin bindings it adds and, optionally, the model folder
its runs start from (the ablation's per-seed SFT models). A grid is the product of its axes; a point's name joins
its values' labels with "__" and depends on that point alone, so adding an axis value never renames other runs.

Grid text, from the command line (`--grid`): `KEY=[v1, v2, ...]` with KEY a gin parameter (`[scope/]Name.param`)
and each value gin text (`'grpo'`, `1e-4`, `(64, 128)`, `@a/Stage()`). From a JSON file: {"axes": {AXIS: VALUES}}
where VALUES is a list (AXIS is then the gin parameter, each value gin text if a string, else a JSON number, bool
or list written as gin) or an object {LABEL: [binding, ...]} of named joint settings (e.g. a stage-length schedule
binding two stages at once).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

KEY_PATTERN = re.compile(r"^(?:[A-Za-z_][\w.]*/)*[A-Za-z_][\w.]*\.[A-Za-z_]\w*$")
MAX_NAME = 100
_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]+")
_BRACKETS = {"(": ")", "[": "]", "{": "}"}


class GridError(ValueError):
    """A grid that cannot be run: malformed text, an empty axis, duplicate values or clashing run names."""


@dataclasses.dataclass(frozen=True)
class AxisValue:
    """One value of an axis: its `label` (part of run names), the gin `bindings` it adds and the `model` folder its
    runs start from (None: the grid's default model)."""

    label: str
    bindings: tuple[str, ...]
    model: str | None = None


@dataclasses.dataclass(frozen=True)
class Axis:
    """A named list of values; a grid runs every combination of its axes' values."""

    name: str
    values: tuple[AxisValue, ...]


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of a grid: its `name` (the run directory), each axis's label, all its gin bindings, its start model."""

    name: str
    labels: tuple[tuple[str, str], ...]
    bindings: tuple[str, ...]
    model: str

    def group(self, over: Sequence[str] = ()) -> str:
        """The point's name without the axes in `over` (e.g. "seed"): runs that differ only there share a group."""
        kept = [label for axis, label in self.labels if axis not in over]
        return "__".join(kept) or "all"

    def to_json(self) -> dict[str, Any]:
        """The point as stored in its run directory (point.json)."""
        return {"name": self.name, "labels": dict(self.labels), "bindings": list(self.bindings), "model": self.model}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Point":
        """The inverse of `to_json`."""
        return cls(data["name"], tuple(data["labels"].items()), tuple(data["bindings"]), data["model"])


def slug(text: str) -> str:
    """`text` made safe as part of a directory name: quotes dropped, runs of other unsafe characters turned to '_'."""
    return _UNSAFE.sub("_", text.replace("'", "").replace('"', "")).strip("_") or "_"


def point_name(labels: Sequence[str]) -> str:
    """The run-directory name of a point with these axis labels (SPEC-free bookkeeping): the slugs joined by "__",
    cut to MAX_NAME characters with a hash of the whole name appended when longer."""
    name = "__".join(slug(label) for label in labels)
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return f"{name[:MAX_NAME - 11]}-{digest}"


def split_top_level(text: str) -> list[str]:
    """Split gin value text at commas outside brackets and quotes (`1, (2, 3), 'a,b'` -> three items)."""
    items, depth, quote, current = [], [], None, []
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in _BRACKETS:
            depth.append(_BRACKETS[char])
        elif char in ")]}":
            if not depth or depth.pop() != char:
                raise GridError(f"unbalanced {char!r} in {text!r}")
        elif char == "," and not depth:
            items.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    if quote or depth:
        raise GridError(f"unclosed {'quote' if quote else 'bracket'} in {text!r}")
    items.append("".join(current).strip())
    if items == [""]:
        return []
    return items


def check_key(key: str, where: str) -> str:
    """`key` if it names a gin parameter (`[scope/]Name.param`), else a GridError saying what `where` should be."""
    key = key.strip()
    if not KEY_PATTERN.match(key):
        raise GridError(f"{where}: {key!r} is not a gin parameter; expected [scope/]Configurable.parameter, e.g. "
                        f"RLSettings.group_size or short/Stage.max_response_tokens")
    return key


def value_axis(key: str, values: Sequence[str], where: str) -> Axis:
    """An axis over one gin parameter: one value per gin text, labelled KEY=VALUE (scopes' '/' as '.')."""
    key = check_key(key, where)
    if not values:
        raise GridError(f"{where}: the list of values for {key} is empty")
    if any(not value for value in values):
        raise GridError(f"{where}: an empty value in the list for {key}")
    if len(set(values)) != len(values):
        raise GridError(f"{where}: repeated values for {key}: {list(values)}")
    label_key = key.replace("/", ".")
    return Axis(key, tuple(AxisValue(f"{label_key}={value}", (f"{key} = {value}",)) for value in values))


def parse_grid_arg(text: str) -> Axis:
    """One `--grid KEY=[v1, v2, ...]` argument as an axis (GridError with the expected form when malformed)."""
    where = f"--grid {text!r}"
    key, equals, values = text.partition("=")
    if not equals:
        raise GridError(f"{where}: expected KEY=[v1, v2, ...], e.g. 'RLSettings.group_size=[2, 4]'")
    values = values.strip()
    if not (values.startswith("[") and values.endswith("]")):
        raise GridError(f"{where}: the values must be a bracketed list, e.g. {key.strip()}=[2, 4]")
    return value_axis(key, split_top_level(values[1:-1]), where)


def gin_text(value: Any) -> str:
    """A JSON grid-file value as gin text: strings verbatim (write "'grpo'" for a gin string), bools as
    True/False, numbers as written, lists as gin lists."""
    if isinstance(value, bool):
        return repr(value)
    if isinstance(value, (int, float, str)):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(gin_text(item) for item in value) + "]"
    raise GridError(f"grid value {value!r} is not a string, number, bool or list")


def axes_from_json(data: Any, where: str) -> list[Axis]:
    """The axes of a parsed JSON grid file (module docstring for the format)."""
    if not isinstance(data, dict) or not isinstance(data.get("axes"), dict) or not data["axes"]:
        raise GridError(f"{where}: expected an object {{\"axes\": {{AXIS: [values] or {{label: [bindings]}}}}}}")
    unknown = set(data) - {"axes", "comment"}
    if unknown:
        raise GridError(f"{where}: unknown keys {sorted(unknown)} (allowed: axes, comment)")
    axes = []
    for name, values in data["axes"].items():
        if isinstance(values, list):
            axes.append(value_axis(name, [gin_text(value) for value in values], f"{where}, axis {name!r}"))
        elif isinstance(values, dict) and values:
            named = []
            for label, bindings in values.items():
                if (not isinstance(bindings, list) or not bindings
                        or not all(isinstance(b, str) and "=" in b for b in bindings)):
                    raise GridError(f"{where}, axis {name!r}, value {label!r}: expected a non-empty list of gin "
                                    f"bindings like \"short/Stage.max_response_tokens = 256\"")
                for binding in bindings:
                    check_key(binding.partition("=")[0], f"{where}, axis {name!r}, value {label!r}")
                named.append(AxisValue(label, tuple(bindings)))
            axes.append(Axis(name, tuple(named)))
        else:
            raise GridError(f"{where}, axis {name!r}: expected a non-empty list of values or an object of named "
                            f"binding lists")
    return axes


def load_grid_file(path: str | Path) -> list[Axis]:
    """The axes of a JSON grid file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GridError(f"grid file {path}: {exc}") from exc
    return axes_from_json(data, f"grid file {path}")


def expand(axes: Sequence[Axis], model: str) -> list[Point]:
    """Every combination of the axes' values (the last axis varies fastest) as points starting from `model` unless
    a value names its own; GridError for no axes, repeated axis names or two points with the same run name."""
    if not axes:
        raise GridError("a grid needs at least one axis (e.g. --grid 'RLSettings.group_size=[2, 4]')")
    names = [axis.name for axis in axes]
    if len(set(names)) != len(names):
        raise GridError(f"repeated grid axes: {names}")
    points: list[Point] = []
    for combination in itertools.product(*(axis.values for axis in axes)):
        models = [value.model for value in combination if value.model is not None]
        labels = tuple((axis.name, value.label) for axis, value in zip(axes, combination))
        bindings = tuple(binding for value in combination for binding in value.bindings)
        points.append(Point(point_name([label for _, label in labels]), labels, bindings,
                            models[-1] if models else model))
    seen: dict[str, Point] = {}
    for point in points:
        if point.name in seen and seen[point.name] != point:
            raise GridError(f"two grid points share the run name {point.name!r}: {dict(seen[point.name].labels)} "
                            f"and {dict(point.labels)}; give their values distinct labels")
        seen[point.name] = point
    return points
