"""Where a jitted step's time goes: a per-op profile from a JAX profiler trace, grouped into a few categories.

Issue 12 asks each learner configuration to say how far it is from the matmul peak and where the rest goes. The
XLA:CPU runtime records one trace event per executed op (fusion, dot, copy, ...); each op is named back to its HLO
instruction in the compiled module, whose `op_name` metadata says which part of the model made it. Control-flow
ops (while, conditional, call) contain other ops' events and are left out of the sums; events of independent ops
may overlap on the two cores, so the categories can add up to slightly more than the wall-clock step.

    categorise(op, op_name) decides the category; `profile_step` traces a few calls and returns the table.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import re
import tempfile
from typing import Any, Callable

import jax

CONTAINERS = ("while", "conditional", "call")
# (category, predicate on (opcode, op_name)), first match wins.
CATEGORIES: tuple[tuple[str, Callable[[str, str], bool]], ...] = (
    ("matmul: attention scores and values", lambda op, name: _is_dot(op, name) and "/attn/" in name
     and "_proj" not in name),
    ("matmul: output head", lambda op, name: _is_dot(op, name) and ("token_head" in name or "bte," in name
                                                                    or "btv," in name or "_fused" in name)),
    ("matmul: layer projections and MLP", lambda op, name: _is_dot(op, name)),
    ("attention softmax and masks", lambda op, name: "/attn/" in name and "_proj" not in name
     and "norm" not in name and "rope" not in name),
    ("optimizer", lambda op, name: any(key in name for key in ("optax", "adam", "clip_by_global_norm",
                                                               "apply_updates", "tree_add", "update_moment"))),
    ("layer-stack residuals (scan slices, stacking)", lambda op, name: any(
        key in name for key in ("dynamic_slice", "dynamic_update_slice", "dynamic_index", "dynamic_update_index"))
     or op == "wrapped_broadcast"),
    ("layout copies and transposes", lambda op, name: op in ("copy", "transpose") or name.endswith("transpose")),
    ("output head softmax and gather", lambda op, name: "token_head" in name or "_fused" in name),
    ("norms, RoPE, SwiGLU, residual adds", lambda op, name: True),
)


@dataclasses.dataclass(frozen=True)
class OpTime:
    """One HLO op's mean time per call."""

    name: str
    category: str
    op_name: str
    ms: float
    count: int


def _is_dot(op: str, name: str) -> bool:
    return op in ("dot", "ynn_fusion", "xnn_fusion", "onednn") or name.endswith("dot_general")


def categorise(op: str, op_name: str) -> str:
    """The category of an HLO op from its opcode (or fusion kind) and the `op_name` of its metadata."""
    for category, matches in CATEGORIES:
        if matches(op, op_name):
            return category
    raise AssertionError("the last category matches everything")


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Instruction name -> (opcode or fusion kind, op_name metadata) for every instruction of a compiled module."""
    ops = {}
    for line in hlo_text.splitlines():
        match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", line)
        if not match:
            continue
        name, rest = match.groups()
        opcode = re.search(r"\s([a-z][a-z0-9\-_]*)\(", " " + rest.split(", metadata=")[0])
        op = opcode.group(1) if opcode else "?"
        kind = re.search(r'"kind":"__(\w+?)"', rest)
        if op == "fusion" and kind:
            op = kind.group(1)  # e.g. ynn_fusion: a library dot with its fused operands
        elif op == "fusion" and name.startswith("wrapped_"):
            op = name.split(".")[0]
        op_name = re.search(r'op_name="([^"]*)"', rest)
        ops[name] = (op, op_name.group(1) if op_name else "")
    return ops


def profile_step(step: Callable[..., Any], args: tuple[Any, ...], calls: int = 3) -> list[OpTime]:
    """Trace `calls` calls of the jitted `step(*args)` (compiled and warmed here first) and return every op's mean
    time per call, longest first."""
    jax.block_until_ready(step(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(step(*args))
        trace_file = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
        with gzip.open(trace_file) as handle:
            trace = json.load(handle)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ops = hlo_ops(step.lower(*args).compile().as_text())
    totals: dict[str, float] = collections.Counter()
    counts: dict[str, int] = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event["name"] in ops:
            totals[event["name"]] += event.get("dur", 0.0)
            counts[event["name"]] += 1
    times = []
    for name, micros in totals.items():
        op, op_name = ops[name]
        if op in CONTAINERS:
            continue
        times.append(OpTime(name, categorise(op, op_name), op_name, micros / calls / 1e3, counts[name] // calls))
    return sorted(times, key=lambda time: -time.ms)


def by_category(times: list[OpTime]) -> dict[str, float]:
    """Milliseconds per call in each category, largest first."""
    sums: dict[str, float] = collections.Counter()
    for time in times:
        sums[time.category] += time.ms
    return dict(sorted(sums.items(), key=lambda item: -item[1]))
