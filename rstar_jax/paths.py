"""Where the repository and the shared data live: a leaf module every package may import (DESIGN: packages depend
downwards only, and the tokenizers, data and gin set-up all need these two places)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR_ENV = "RSTAR_DATA_DIR"


def shared_data_dir() -> Path:
    """The directory named data sets and the Qwen tokenizer live in: `$RSTAR_DATA_DIR`, else `../shared/data` beside
    the repository root."""
    override = os.environ.get(DATA_DIR_ENV)
    return Path(override) if override else REPO_ROOT.parent / "shared" / "data"
