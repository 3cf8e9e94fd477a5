"""Hand-made demo run folders for the seed-range tests: demo_summary.json with the figures given, and a bound
config whose seed bindings carry the run's seed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG = """# Parameters for HeldOutEval:
# ==============================================================================
HeldOutEval.samples = 3
HeldOutEval.seed = 12345

# Parameters for RLSettings:
# ==============================================================================
RLSettings.group_size = 4
RLSettings.seed = {seed}

# Parameters for train_sft:
# ==============================================================================
train_sft.data_seed = {seed}
train_sft.model_seed = {seed}
train_sft.steps = 300
"""


def evaluation(accuracy: float, pass_at_k: float, failed_correct: float, failed_all: float, length: float,
               samples: int = 3) -> dict[str, Any]:
    return {"problems": 64, "samples": samples, "temperature": 1.0 if samples > 1 else 0.0, "accuracy": accuracy,
            "pass_at_k": pass_at_k, "tool_error_ratio_correct": failed_correct, "tool_error_ratio_all": failed_all,
            "response_length": length, "tool_calls": 1.2, "finish_reasons": {"answered": 64 * samples}}


def summary(seed: int | None = 0, sft: float = 0.25, rl: float = 0.45, greedy: tuple[float, float] | None = (0.6, 0.8),
            failed_all: tuple[float, float] = (0.4, 0.1), total: float = 800.0, error: float = 0.03,
            copies: float = 0.8) -> dict[str, Any]:
    """A demo summary: T=1 accuracy `sft` -> `rl` (pass@k 0.2 above each), greedy (None: not evaluated), failed calls
    in all trajectories, total seconds (split 40/15/35/10% over the phases), the SFT's 3-digit copies right."""
    after_sft = {"sampled": evaluation(sft, sft + 0.2, 0.15, failed_all[0], 200.0)}
    after_rl = {"sampled": evaluation(rl, rl + 0.2, 0.02, failed_all[1], 140.0)}
    changes = {"sampled": {"mean": rl - sft, "standard_error": error, "problems": 64}}
    if greedy is not None:
        after_sft["greedy"] = evaluation(greedy[0], greedy[0], 0.1, failed_all[0], 150.0, samples=1)
        after_rl["greedy"] = evaluation(greedy[1], greedy[1], 0.0, failed_all[1], 120.0, samples=1)
        changes["greedy"] = {"mean": greedy[1] - greedy[0], "standard_error": 2 * error, "problems": 64}
    sft_copies = {"copy_accuracy": 0.9, "multi_digit": copies, "by_digits": {"1": 0.95, "2": 0.9, "3": copies},
                  "by_kind": {"first_call": 0.9, "retry": 0.2, "answer": 0.9}}
    return {"after_sft": after_sft, "after_rl": after_rl, "paired_change": changes, "sft_copies": sft_copies,
            "seed": seed, "total_seconds": total,
            "phase_seconds": {"sft": 0.4 * total, "eval_before": 0.15 * total, "rl": 0.35 * total,
                              "eval_after": 0.1 * total}}


def write_run(folder: Path, run: dict[str, Any], config: str = CONFIG) -> Path:
    """A demo run folder holding `run` as its summary and `config` (seeded with the run's seed) as its bound
    config."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "demo_summary.json").write_text(json.dumps(run))
    (folder / "bound_config.gin").write_text(config.format(seed=run["seed"]))
    return folder
