"""Benchmark evaluation (SPEC section 7): avg@k pass@1 and pass@k of a model on AIME24, AIME25, HMMT25, MATH-500,
AMC23 and GSM8K, through the agent loop with the Python tool.

    python -m experiments.eval --model DIR_or_RUN --out OUT [--benchmarks aime24,math500] [--limit N]
                               [--gin_file ...] [--gin_param ...]

DIR is an HF folder (config.json, weights, tokenizer); RUN an RL run folder (its checkpoints/, the latest step or
--step; config and tokenizer from RUN/model/ or --base_model). The protocol is gin `BenchmarkEval` (default files:
sft/tiny_format.gin and eval/tiny_cpu.gin, the tiny demo model on 2 CPU cores; the paper's protocol, avg@16 at
T = 0.6 with 30 turns and 30K tokens, is `--gin_file eval/paper.gin`), the engines gin `RolloutBackend` (JAX engines
or a vLLM fleet). Starts a sandbox server unless given --sandbox_url. Writes OUT/problems/<set>.jsonl (one record per
problem: id, answer, per-sample correctness, answers, response lengths, tool calls), OUT/summary.md and
OUT/summary.json (each set's problem count, k, avg@k and pass@k, beside the paper's reported rows), OUT/eval.log and
OUT/operative_config.gin. A rerun into the same OUT skips the sets it already finished (OUT/problems/<set>.row.json)
under the same model, protocol and --limit, and refuses if they differ.

"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import rstar_jax.train.sft_run  # noqa: F401  (registers train_sft & co., which sft/tiny_format.gin binds)
from rstar_jax.console import log_to, say
from rstar_jax.eval.agentic import EvalResult
from rstar_jax.eval.benchmark_report import problem_records_jsonl, set_row, summary_markdown
from rstar_jax.eval.benchmark_run import BenchmarkEval
from rstar_jax.eval.benchmarks import BENCHMARKS, load_benchmark, parse_benchmark_names
from rstar_jax.eval.finished_sets import finished_rows, mark_finished
from rstar_jax.eval.model_source import load_model, resolve_model_source
from rstar_jax.eval.references import SOURCE
from rstar_jax.gin_setup import GinConfigError, knob_help, parse_gin, write_operative_config
from rstar_jax.processes import running_sandbox
from rstar_jax.reward import VerifierPool
from rstar_jax.rollout.backends import RolloutBackend
from rstar_jax.tokenizers import load_tokenizer

DEFAULT_GIN = ("sft/tiny_format.gin", "eval/tiny_cpu.gin")
KNOBS = ("BenchmarkEval.samples", "BenchmarkEval.temperature", "BenchmarkEval.max_turns",
         "BenchmarkEval.max_response_tokens", "BenchmarkEval.seed", "RolloutBackend.backend",
         "RolloutBackend.slots", "RolloutBackend.max_len", "RolloutBackend.vllm_servers", "RolloutBackend.vllm_urls")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=knob_help(DEFAULT_GIN, KNOBS))
    parser.add_argument("--model", required=True, help="HF model folder, or RL run folder (its checkpoints/)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--benchmarks", default="all", help=f"comma-separated, from {', '.join(BENCHMARKS)} "
                        "(default: all)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems of each set")
    parser.add_argument("--step", type=int, default=None, help="RL checkpoint step (default: the latest)")
    parser.add_argument("--base_model", default=None, help="HF folder giving an RL run's config and tokenizer "
                        "(default: RUN/model)")
    parser.add_argument("--sandbox_url", action="append", default=[], help="running sandbox servers (default: "
                        "start one here)")
    parser.add_argument("--gin_file", action="append", default=None,
                        help=f"gin files (default: {', '.join(DEFAULT_GIN)})")
    parser.add_argument("--gin_param", action="append", default=[], help="e.g. 'BenchmarkEval.samples = 4'")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command-line entry point; returns summary.json's content. Every argument is checked before any work."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        names = parse_benchmark_names(args.benchmarks)
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        source = resolve_model_source(args.model, args.base_model, args.step)
        parse_gin(args.gin_file or DEFAULT_GIN, args.gin_param)
        protocol, backend = BenchmarkEval(), RolloutBackend()
        sets = {name: load_benchmark(name, args.limit) for name in names}
        tokenizer = load_tokenizer(source.base)
        protocol.check_fits(tokenizer, sets, backend.token_limit)
        out = Path(args.out)
        identity = {"model": source.describe(), "settings": protocol.settings(), "limit": args.limit}
        finished = finished_rows(out / "problems", names, identity)
    except (ValueError, FileNotFoundError, GinConfigError) as error:
        parser.error(str(error))
    command = "python -m experiments.eval " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    started = time.monotonic()
    rows: dict[str, dict[str, Any]] = dict(finished)

    def set_done(name: str, result: EvalResult, seconds: float) -> None:
        path = out / "problems" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(problem_records_jsonl(result, tokenizer))
        rows[name] = row = set_row(name, result, seconds)
        mark_finished(out / "problems", name, identity, row)
        say(f"{BENCHMARKS[name].title}: avg@{row['k']} {100 * row['avg_at_k']:.1f}%, pass@{row['k']} "
            f"{100 * row['pass_at_k']:.1f}% over {row['problems']} problems ({seconds:.0f} s); records in {path}")

    with log_to(out / "eval.log"):
        todo = {name: problems for name, problems in sets.items() if name not in finished}
        if finished:
            say(f"already evaluated in {out}: {', '.join(finished)}")
        to_evaluate = ", ".join(f"{name} ({len(problems)})" for name, problems in todo.items()) or "nothing more"
        say(f"evaluating {source.describe()} on {to_evaluate}: k = {protocol.samples} at T = "
            f"{protocol.temperature:g}, {protocol.max_turns} turns, {protocol.max_response_tokens} tokens, "
            f"{backend.backend} engines")
        if todo:
            config, params = load_model(source)
            with VerifierPool() as verifier, contextlib.ExitStack() as stack:
                sandbox_urls = args.sandbox_url or [stack.enter_context(running_sandbox(["--workers", "2"])).url]
                protocol.run(config, params, str(source.base), tokenizer, todo, sandbox_urls, verifier, backend, out,
                             set_done)
        engines = (f"{backend.jax_engines} in-process JAX engine(s) of {backend.slots} x {backend.max_len} tokens"
                   if backend.backend == "jax" else f"vLLM ({', '.join(backend.vllm_urls) or backend.vllm_servers})")
        summary = {"model": source.describe(), "command": command, "settings": protocol.settings(),
                   "backend": engines, "limit": args.limit, "seconds": time.monotonic() - started,
                   "references_source": SOURCE, "benchmarks": [rows[name] for name in names]}
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (out / "summary.md").write_text(summary_markdown(summary["benchmarks"], summary))
        write_operative_config(out)
        say(f"wrote {out / 'summary.md'} and {out / 'summary.json'} ({summary['seconds']:.0f} s)")
    return summary


if __name__ == "__main__":
    main()
