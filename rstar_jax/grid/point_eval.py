"""A grid point's held-out evaluation (SPEC 7 as the demo scales it: gin `HeldOutEval`): the start model's (cached
per model folder, evaluation settings and rollout backend, so the arms of an ablation that share an SFT model evaluate
it once) and the trained model's, gathered into the point's summary. Both run on the engines of the point's
`RolloutBackend` (the one its training used) and are checked by the verifier passed in.

The start model's figures are cached in CACHE_DIR/<key>.json, key = hash of the folder's resolved path, the
`HeldOutEval` settings (problems, samples, temperature, turns, tokens, seed) and the `RolloutBackend` (engines,
slots, token limit, router): evaluation is seeded, so the same model under the same settings on the same engines
gives the same figures. Bindings that change the prompt format but neither of the two do not change the key: use a
fresh grid folder after such a change.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from rstar_jax.console import phase
from rstar_jax.eval.heldout import HeldOutEval
from rstar_jax.grid.runner import write_json
from rstar_jax.model import load_hf
from rstar_jax.reward.verifier import Verifier
from rstar_jax.rollout.backends import RolloutBackend
from rstar_jax.tokenizers import load_tokenizer

START_EVAL_DIR = "start_eval"


def evaluate_folder(evaluation: HeldOutEval, model_dir: str | Path, sandbox_url: str, verifier: Verifier,
                    backend: RolloutBackend, work_dir: str | Path) -> dict[str, dict[str, Any]]:
    """{"sampled": summary, "greedy": summary} of the HF folder `model_dir` under `evaluation` (SPEC 7), on the
    engines `backend` starts (a vLLM fleet it launches is served from WORK_DIR/serving_model)."""
    model = load_hf(model_dir)
    results = evaluation.run(model.config, model.params, str(model_dir), load_tokenizer(str(model_dir)),
                             [sandbox_url], verifier, backend, work_dir)
    return {mode: result.summary for mode, result in results.items()}


def start_eval_key(model_dir: str | Path, evaluation: HeldOutEval, backend: RolloutBackend) -> str:
    """The cache key of a start model's evaluation: its folder's resolved path, the evaluation settings and the
    rollout backend."""
    text = json.dumps({"model": str(Path(model_dir).resolve()), "eval": repr(evaluation), "backend": repr(backend)})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_start_eval(evaluation: HeldOutEval, model_dir: str | Path, sandbox_url: str, verifier: Verifier,
                      backend: RolloutBackend, cache_dir: str | Path,
                      work_dir: str | Path) -> dict[str, dict[str, Any]]:
    """The start model's held-out figures (SPEC 7): read from `cache_dir` when evaluated before, else evaluated
    (engines of `backend`, a launched vLLM fleet served from `work_dir`) and stored there."""
    path = Path(cache_dir) / f"{start_eval_key(model_dir, evaluation, backend)}.json"
    if path.is_file():
        return json.loads(path.read_text())["results"]
    with phase(f"held-out evaluation of the start model {model_dir}"):
        results = evaluate_folder(evaluation, model_dir, sandbox_url, verifier, backend, work_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"model": str(Path(model_dir).resolve()), "eval": repr(evaluation), "backend": repr(backend),
                      "results": results})
    return results


def point_summary(evaluation: HeldOutEval, start_model: str | Path, trained_model: str | Path, sandbox_url: str,
                  verifier: Verifier, backend: RolloutBackend, cache_dir: str | Path,
                  work_dir: str | Path) -> dict[str, Any]:
    """A finished point's summary: held-out figures of the start model (cached) and the trained one (SPEC 7), under
    `evaluation`, on the engines of `backend` (a launched vLLM fleet served from `work_dir`), answers checked by
    `verifier`; with the evaluation's settings, the backend and the seconds."""
    started = time.monotonic()
    start = cached_start_eval(evaluation, start_model, sandbox_url, verifier, backend, cache_dir, work_dir)
    start_seconds = time.monotonic() - started
    with phase(f"held-out evaluation of the trained model {trained_model}") as timing:
        after = evaluate_folder(evaluation, trained_model, sandbox_url, verifier, backend, work_dir)
    return {"start_model": str(start_model), "trained_model": str(trained_model), "evaluation": repr(evaluation),
            "backend": repr(backend), "start": start, "after": after,
            "seconds": {"eval_start": start_seconds, "eval_after": timing["seconds"]}}
