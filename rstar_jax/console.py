"""What a person at the console sees while a long command runs: phase lines and progress bars (one helper for
every entry point, so the demo, SFT, RL and evaluation read alike).

Phases print one line when they start and one with their own duration when they end; long loops show a tqdm bar
with the step, the figures that matter (loss, accuracy) and the time left. Bars go to stderr and fall back to plain
lines when stderr is not a terminal (CI logs, files), so logs stay readable.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Iterator, TextIO

from tqdm.auto import tqdm


_LOG_FILES: list[TextIO] = []


def say(message: str) -> None:
    """One line on stdout, flushed at once (so it interleaves correctly with bars and subprocess output), and in
    the log file when one is open (`log_to`)."""
    print(message, flush=True)
    _write_logs(message)


def _write_logs(message: str) -> None:
    for handle in _LOG_FILES:
        handle.write(message + "\n")
        handle.flush()


@contextlib.contextmanager
def log_to(path: str | Path) -> Iterator[Path]:
    """Copy every `say` line (phases and progress included) to `path` while inside; prints the path once."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        _LOG_FILES.append(handle)
        say(f"log: {path}")
        try:
            yield path
        finally:
            _LOG_FILES.remove(handle)


@contextlib.contextmanager
def phase(label: str) -> Iterator[dict[str, float]]:
    """Print `label ...` now and `label: done in N s` (this phase's own time) when the block ends; the yielded
    dict then holds that time as "seconds"."""
    say(f"{label} ...")
    started = time.monotonic()
    timing: dict[str, float] = {}
    yield timing
    timing["seconds"] = time.monotonic() - started
    say(f"{label}: done in {timing['seconds']:.0f} s")


class Progress:
    """A progress bar over `total` steps (`advance(**figures)` after each), counted in `unit`s; a plain line every
    `every` steps when stderr is not a terminal (and in the log file either way)."""

    def __init__(self, total: int, label: str, initial: int = 0, every: int = 10, unit: str = "step") -> None:
        self._interactive = sys.stderr.isatty()
        self._every, self._label, self._total = every, label, total
        self._done, self._started = initial, time.monotonic()
        self._initial, self._unit = initial, unit
        self._bar = tqdm(total=total, initial=initial, desc=label, unit=unit, dynamic_ncols=True,
                         disable=not self._interactive)

    def advance(self, **figures: float | int | str) -> None:
        """One more step done; `figures` (e.g. loss=0.41) are shown beside the bar."""
        self._done += 1
        shown = {name: (f"{value:.4g}" if isinstance(value, float) else value) for name, value in figures.items()}
        if self._interactive:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)
        if self._done % self._every == 0 or self._done == self._total:
            elapsed = time.monotonic() - self._started
            rate = (self._done - self._initial) / max(elapsed, 1e-9)
            left = (self._total - self._done) / rate if rate > 0 else float("nan")
            details = " ".join(f"{name}={value}" for name, value in shown.items())
            line = (f"  {self._label}: {self._unit} {self._done}/{self._total} {details} ({elapsed:.0f} s, ~{left:.0f} s "
                    f"left)")
            if self._interactive:  # the bar shows it on the terminal; the log file still gets the line
                _write_logs(line)
            else:
                say(line)

    def extend(self, steps: int) -> None:
        """`steps` more steps than planned (a run that decided to go on)."""
        self._total += steps
        self._bar.total = self._total
        self._bar.refresh()

    def close(self) -> None:
        """Finish the bar."""
        self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
