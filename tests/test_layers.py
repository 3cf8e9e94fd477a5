"""The package layering DESIGN.md draws, checked on every module's imports (issue 25: "the import graph").

`train` builds on rollouts, rewards and RL maths but never on `eval` (evaluation sits beside training, and both
import the shared pieces: `rstar_jax.rl.metrics`, `rstar_jax.rollout.verified`); the library reaches the sandbox
server only through its client (the server is a separate program); nothing in the library imports the entry points.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rstar_jax"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; the package uses no relative imports)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            modules.add(node.module or "")
    return modules


def library_imports() -> dict[str, set[str]]:
    """{module path relative to the package: the modules it imports} for every module of rstar_jax."""
    return {str(path.relative_to(PACKAGE)): imported_modules(path) for path in sorted(PACKAGE.rglob("*.py"))}


def offending(imports: dict[str, set[str]], importer: str, forbidden: str, allowed: tuple[str, ...] = ()) -> list[str]:
    """'module -> import' pairs where a module under `importer` imports something under `forbidden`."""
    return [f"{module} -> {name}" for module, names in imports.items() if module.startswith(importer)
            for name in sorted(names)
            if (name == forbidden or name.startswith(forbidden + ".")) and name not in allowed]


@pytest.mark.parametrize("importer, forbidden, allowed", [
    ("train/", "rstar_jax.eval", ()),
    ("", "sandbox_server", ("sandbox_server.client",)),
    ("", "experiments", ()),
], ids=["train-not-eval", "sandbox-only-through-its-client", "no-entry-points"])
def test_the_library_keeps_its_layers(importer: str, forbidden: str, allowed: tuple[str, ...]) -> None:
    assert offending(library_imports(), importer, forbidden, allowed) == []


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The check can fail: a module importing the sandbox's API directly is reported."""
    module = tmp_path / "probe.py"
    module.write_text("from sandbox_server.api import ToolResult\nimport rstar_jax.eval.agentic\n")
    imports = {"train/probe.py": imported_modules(module)}
    assert offending(imports, "", "sandbox_server", ("sandbox_server.client",)) == [
        "train/probe.py -> sandbox_server.api"]
    assert offending(imports, "train/", "rstar_jax.eval") == ["train/probe.py -> rstar_jax.eval.agentic"]
