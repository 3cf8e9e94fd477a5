"""`python -m sandbox_server --host 127.0.0.1 --port PORT`: run the sandbox service (issue 3, point 1).

Flags override gin (`--gin_file`, `--gin_param 'SandboxConfig.workers = 8'`), which overrides the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys

from sandbox_server.config import SandboxConfig, load_config
from sandbox_server.http_app import SandboxService, serve
from sandbox_server.pool import ZygoteStartError
from sandbox_server.preflight import isolation_problems, probe_workers

log = logging.getLogger("sandbox_server")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line flags; every SandboxConfig field is a flag (default: whatever gin or the code says)."""
    parser = argparse.ArgumentParser(prog="python -m sandbox_server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--gin_file", action="append", default=[], help="gin file(s) binding SandboxConfig")
    parser.add_argument("--gin_param", action="append", default=[], help="gin binding(s), e.g. SandboxConfig.workers=8")
    for field in dataclasses.fields(SandboxConfig):
        flag = "--" + field.name.replace("_", "-")
        about = f"overrides SandboxConfig.{field.name} (default {field.default!r})"
        if field.type in ("bool", bool):
            parser.add_argument(flag, dest=field.name, action="store_true", default=None, help=about)
        elif field.name == "preload_modules":
            comma_list = lambda text: tuple(filter(None, text.split(",")))  # noqa: E731
            parser.add_argument(flag, dest=field.name, type=comma_list, help="comma-separated; " + about)
        else:
            kind = float if "float" in str(field.type) else int
            parser.add_argument(flag, dest=field.name, type=kind, default=None, help=about)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Load the configuration, check isolation and the workers' interpreter, serve until SIGINT/SIGTERM, then shut
    down gracefully."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(SandboxConfig)}
    try:
        config = load_config(args.gin_file, args.gin_param, overrides)
    except ValueError as exc:
        print(f"sandbox_server: {exc}", file=sys.stderr)
        return 2
    problems = isolation_problems()
    if problems and not config.allow_unisolated:
        print(
            "sandbox_server: refusing to run without isolation:\n  - " + "\n  - ".join(problems)
            + "\n(pass --allow-unisolated to run anyway, with only rlimits and process-group kills)",
            file=sys.stderr,
        )  # fmt: skip
        return 3
    if problems:
        log.warning("running UNISOLATED: %s", "; ".join(problems))
    checked = _checked_for_workers(config, isolate=not problems)
    if checked is None:
        return 3
    try:
        return asyncio.run(_run(checked, not problems, args.host, args.port))
    except ZygoteStartError as exc:
        print(f"sandbox_server: a worker failed to start: {exc}", file=sys.stderr)
        return 4


def _checked_for_workers(config: SandboxConfig, isolate: bool) -> SandboxConfig | None:
    """Probe the workers' interpreter. None, after saying why on stderr, when the isolated workers could not read
    something they need; else `config` less the preload modules that are not installed (a warning names them)."""
    probe = probe_workers(config.preload_modules, isolate)
    if probe.view_problems:
        print("\n".join(f"sandbox_server: refusing to start: {line}" for line in probe.view_problems), file=sys.stderr)
        return None
    if probe.missing_modules:
        log.warning(
            "preload_modules not installed for %s, skipped: %s", sys.executable, ", ".join(probe.missing_modules)
        )
    kept = tuple(name for name in config.preload_modules if name not in probe.missing_modules)
    return dataclasses.replace(config, preload_modules=kept)


async def _run(config: SandboxConfig, isolate: bool, host: str, port: int) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    log.info("starting %d workers (isolated=%s) on %s:%d", config.workers, isolate, host, port)
    await serve(SandboxService(config, isolate), host, port, stop)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
