"""Gin configuration for every entry point (DESIGN: "Everything is a gin parameter").

One parser so that every command treats a bad binding the same way (a `GinConfigError` naming it, before any
work starts) and every run can write its operative config (and its bound one) beside its outputs.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable, Sequence

import gin

from rstar_jax.paths import REPO_ROOT

GIN_DIR = REPO_ROOT / "gin"
# `include 'gin/...'` inside a gin file (the paper configs) resolves from the repo root, whatever the working directory.
gin.add_config_file_search_path(str(REPO_ROOT))


class GinConfigError(ValueError):
    """A gin file or binding that does not parse or names something unknown."""


def parse_gin(gin_files: Sequence[str] = (), gin_params: Sequence[str] = ()) -> None:
    """Parse gin files (paths, or relative to the repo's gin/ folder) and then bindings, which win.

    Raises GinConfigError with the offending file or binding in the message; gin's own errors for an unknown
    configurable or a misspelled parameter are wrapped, not swallowed.
    """
    files = [_resolve(name) for name in gin_files]
    try:
        gin.parse_config_files_and_bindings(files, list(gin_params), finalize_config=False)
    except (ValueError, KeyError, TypeError, SyntaxError, OSError, RuntimeError, NameError) as exc:
        raise GinConfigError(f"invalid gin configuration (files={files}, bindings={list(gin_params)}): {exc}") from exc


def knob_help(gin_files: Sequence[str], knobs: Sequence[str]) -> str:
    """The text a command's --help ends with: each knob (a gin binding such as "RLSettings.group_size") with the
    value the command's default gin files give it, or "(code default)" where they leave it unbound.

    Parses the files in a scratch config and clears it again, so calling this before argparse costs nothing else.
    """
    lines = [f"main gin knobs (their values from {', '.join(gin_files)}; change with --gin_param):"]
    try:
        parse_gin(gin_files)
        for knob in knobs:
            try:
                value = repr(gin.query_parameter(knob))
            except ValueError:
                value = _code_default(knob)
            lines.append(f"  {knob} = {value}")
    finally:
        gin.clear_config()
    return "\n".join(lines)


def _code_default(knob: str) -> str:
    """The default a configurable's signature gives `knob` ("scope/Name.param"), for knobs no gin file binds."""
    selector, _, parameter = knob.rpartition("/")[2].rpartition(".")
    configurable = gin.config._REGISTRY.get_match(selector)  # gin has no public lookup of a configurable's defaults
    if configurable is None:
        raise GinConfigError(f"no configurable named {selector!r} (knob {knob!r})")
    default = inspect.signature(configurable.wrapped).parameters[parameter].default
    return repr(default) + " (code default)"


def write_operative_config(run_dir: str | Path) -> Path:
    """Write the gin config the run actually used (every binding that was read) to RUN_DIR/operative_config.gin."""
    path = Path(run_dir) / "operative_config.gin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(gin.operative_config_str())
    return path


def write_bound_config(run_dir: str | Path) -> Path:
    """Write every binding the gin files and parameters made, read by the run or not, to RUN_DIR/bound_config.gin.
    Unlike the operative config it does not depend on what the run called: a resumed run that skips finished work
    (and the configurables that work reads) writes the same file as a fresh one."""
    path = Path(run_dir) / "bound_config.gin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(gin.config_str())
    return path


def _resolve(name: str) -> str:
    """A gin file as given if it exists, else under the repo's gin/ folder; a clear error if neither."""
    for candidate in (Path(name), GIN_DIR / name):
        if candidate.is_file():
            return str(candidate)
    raise GinConfigError(f"gin file {name!r} not found (looked in the working directory and {GIN_DIR})")


def gin_kwargs(configurable: Callable[..., Any]) -> dict[str, Any]:
    """The arguments a gin-configurable function gets when called without them: its signature's defaults, then
    what the parsed gin config binds (unscoped)."""
    defaults = {name: parameter.default for name, parameter in inspect.signature(configurable).parameters.items()
                if parameter.default is not inspect.Parameter.empty}
    return {**defaults, **gin.get_bindings(configurable)}
