"""One metrics writer for every training run, SFT and RL: a JSON-lines log and TensorBoard event files.

The JSON-lines file (`metrics.jsonl`, one object per step with a "step" key) is the record a resumed run continues:
on resume, entries after the restored checkpoint's step are dropped (they are redone), so the file of a killed and
resumed run reads exactly like an uninterrupted run's. TensorBoard events are written with tensorboardX, which is
told the resume step so that events past it are purged from view.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from tensorboardX import SummaryWriter

from rstar_jax.files import atomic_write_text

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def read_metrics(path: str | Path, up_to_step: int | None = None) -> list[dict[str, Any]]:
    """The entries of a metrics JSON-lines file (those with step <= `up_to_step` when given; [] if no file)."""
    path = Path(path)
    if not path.is_file():
        return []
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [entry for entry in entries if up_to_step is None or entry["step"] <= up_to_step]


class MetricsWriter:
    """Appends one entry per step to RUN_DIR/metrics.jsonl and RUN_DIR/tensorboard/, continuing after `resume_step`
    (entries past it from a killed run are dropped)."""

    def __init__(self, run_dir: str | Path, resume_step: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.entries = read_metrics(self.path, resume_step)
        atomic_write_text(self.path, "".join(json.dumps(entry) + "\n" for entry in self.entries))
        self._handle = self.path.open("a")
        self._tensorboard = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR), purge_step=resume_step + 1)

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Record `metrics` (numbers, or small dicts of numbers such as counts by status) for `step`."""
        entry = {"step": int(step), **metrics}
        self._handle.write(json.dumps(entry) + "\n")
        self._handle.flush()
        self.entries.append(entry)
        for name, value in _scalars(metrics):
            self._tensorboard.add_scalar(name, value, global_step=int(step))
        return entry

    def close(self) -> None:
        """Flush and close both outputs."""
        self._handle.close()
        self._tensorboard.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _scalars(metrics: Mapping[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    """Flatten numbers and nested dicts of numbers into (name, value) pairs; other values are not plotted."""
    pairs = []
    for name, value in metrics.items():
        if isinstance(value, Mapping):
            pairs += _scalars(value, f"{prefix}{name}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            pairs.append((f"{prefix}{name}", float(value)))
    return pairs
