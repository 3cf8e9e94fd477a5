"""What the CPU demo measures over seeds, and one demo run read beside that range (issue 24).

The demo's outcome depends on its seed more than on anything else: whether the tiny model learns to copy numbers
within its budget decides where RL starts (held-out T=1 accuracy 7.3-32.8% over seeds before issue 24, 22-42% at
the committed range) and how much it gains. A single run's numbers say little without that spread, so seed runs
(`experiments.demo_seeds`) write every figure's range to a committed file, and the demo prints its figures beside
it, with what a figure outside it suggests (RULES). A range is only comparable with runs of its own configuration:
`config_fingerprint` hashes the bound gin config (every binding the gin files and parameters made) without the seed
bindings, so every seed of one configuration shares it, and so does a resumed run (the operative config would not:
a resumed demo skips finished work, and the configurables it reads drop out). A changed code default is not seen.

Pure: demo summaries (demo_summary.json) and gin-config text in, records, lines and markdown out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
from typing import Any, Callable, Mapping, Sequence

# The bindings `python -m experiments.demo --seed N` sets: they differ between seeds of one configuration.
SEED_PARAMETERS = ("train_sft.model_seed", "train_sft.data_seed", "RLSettings.seed")
# Bindings that lay the same computation out differently (rows per micro-batch, rows shared by trajectories, log-probs
# in chunks): they change float rounding only, as another machine does, so a run under them is still the range's.
LAYOUT_PARAMETERS = ("RLSettings.micro_batch_rows", "RLSettings.pack_length", "RLSettings.logprob_chunk")


@dataclasses.dataclass(frozen=True)
class Unit:
    """How a figure is shown: value x `scale` with `decimals` (a sign when `signed`), then `suffix`."""

    scale: float
    decimals: int
    signed: bool
    suffix: str


SHARE = Unit(100.0, 1, False, "%")
POINTS = Unit(100.0, 1, True, " points")
TOKENS = Unit(1.0, 0, False, " tokens")
SECONDS = Unit(1.0, 0, False, " s")


@dataclasses.dataclass(frozen=True)
class Figure:
    """One number of a demo summary: its name in a range record, its label, where the summary holds it."""

    name: str
    label: str
    path: tuple[str, ...]
    unit: Unit


FIGURES = (
    Figure("sft_t1", "SFT start, T=1", ("after_sft", "sampled", "accuracy"), SHARE),
    Figure("rl_t1", "after RL, T=1", ("after_rl", "sampled", "accuracy"), SHARE),
    Figure("change_t1", "paired change, T=1", ("paired_change", "sampled", "mean"), POINTS),
    Figure("sft_greedy", "SFT start, greedy", ("after_sft", "greedy", "accuracy"), SHARE),
    Figure("rl_greedy", "after RL, greedy", ("after_rl", "greedy", "accuracy"), SHARE),
    Figure("change_greedy", "paired change, greedy", ("paired_change", "greedy", "mean"), POINTS),
    Figure("sft_copies_3", "SFT, 3-digit copies right (teacher-forced)", ("sft_copies", "by_digits", "3"), SHARE),
    Figure("sft_pass", "SFT start, pass@k", ("after_sft", "sampled", "pass_at_k"), SHARE),
    Figure("rl_pass", "after RL, pass@k", ("after_rl", "sampled", "pass_at_k"), SHARE),
    Figure("sft_failed_correct", "SFT start, failed calls in correct trajectories",
           ("after_sft", "sampled", "tool_error_ratio_correct"), SHARE),
    Figure("rl_failed_correct", "after RL, failed calls in correct trajectories",
           ("after_rl", "sampled", "tool_error_ratio_correct"), SHARE),
    Figure("sft_failed_all", "SFT start, failed calls in all trajectories",
           ("after_sft", "sampled", "tool_error_ratio_all"), SHARE),
    Figure("rl_failed_all", "after RL, failed calls in all trajectories",
           ("after_rl", "sampled", "tool_error_ratio_all"), SHARE),
    Figure("rl_length", "after RL, response length", ("after_rl", "sampled", "response_length"), TOKENS),
    Figure("seconds_sft", "time, SFT", ("phase_seconds", "sft"), SECONDS),
    Figure("seconds_eval_before", "time, evaluation before RL", ("phase_seconds", "eval_before"), SECONDS),
    Figure("seconds_rl", "time, RL", ("phase_seconds", "rl"), SECONDS),
    Figure("seconds_eval_after", "time, evaluation after RL", ("phase_seconds", "eval_after"), SECONDS),
    Figure("seconds_total", "time, total", ("total_seconds",), SECONDS),
)
UNITS = {figure.name: figure.unit for figure in FIGURES}


@dataclasses.dataclass(frozen=True)
class Reading:
    """One run's figures beside a range record's (what RULES look at)."""

    values: Mapping[str, float]
    ranges: Mapping[str, Mapping[str, Any]]
    same_config: bool

    def side(self, name: str, margin: float = 1.0) -> str | None:
        """"below" the range's min, "above" `margin` x its max, else "inside"; None where the run or the range
        lacks the figure."""
        if name not in self.values or name not in self.ranges:
            return None
        value, span = self.values[name], self.ranges[name]
        return "below" if value < span["min"] else "above" if value > margin * span["max"] else "inside"


BROKEN_SANDBOX_RATIO = 0.9  # a working sandbox fails 17-40% of an SFT model's calls (its code), not nearly all
SLOW_MACHINE_MARGIN = 1.5
# What a run outside the range suggests: (whether it applies to the reading, the line said), every one that applies.
RULES: tuple[tuple[Callable[[Reading], bool], str], ...] = (
    (lambda run: not run.same_config,
     "your config differs from the one the range was measured with (another fingerprint): the range is only a "
     "rough guide"),
    (lambda run: run.side("sft_t1") == "below" and run.side("sft_copies_3") == "below",
     "SFT start and 3-digit copies below the range: a weak SFT draw (the model did not learn to copy numbers, "
     "which products and modular powers need; accuracy_by_kind in demo_summary.json shows which kinds it lost) or a "
     "changed config"),
    (lambda run: run.side("sft_t1") == "below" and run.side("sft_copies_3") != "below",
     "SFT start below the range: a weak SFT draw (accuracy_by_kind in demo_summary.json shows which kinds it lost) "
     "or a changed config"),
    (lambda run: max(run.values.get("sft_failed_all", 0.0), run.values.get("rl_failed_all", 0.0))
     >= BROKEN_SANDBOX_RATIO,
     f"at least {100 * BROKEN_SANDBOX_RATIO:.0f}% of the tool calls failed: a broken sandbox (the calls get no "
     "tool output; check demo.log for the sandbox server's errors)"),
    (lambda run: run.side("change_t1") == "below" and run.side("sft_t1") == "inside",
     "the T=1 gain is below the range from a normal SFT start: RL did not learn (check rl/metrics.jsonl: rewards, "
     "groups kept, grad_norm)"),
    (lambda run: run.side("seconds_total", SLOW_MACHINE_MARGIN) == "above",
     f"total time over {SLOW_MACHINE_MARGIN:g}x the range's slowest seed: a slower or busy machine"),
)


def config_fingerprint(bound_config: str) -> str:
    """A short hash of a bound gin config (OUT/bound_config.gin, `gin.config_str()`) without the SEED_PARAMETERS and
    LAYOUT_PARAMETERS bindings: equal for every seed of one configuration, different when any other binding differs."""
    ignored = SEED_PARAMETERS + LAYOUT_PARAMETERS
    kept = [line for line in bound_config.splitlines() if line.split("=", 1)[0].strip() not in ignored]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def sft_copies(sft_summary: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of the last copy check a format SFT made (its summary.json's "copy_checks":
    `rstar_jax.train.copy_gate`): copy accuracy, multi-digit share, by digits and by kind; {} without a check."""
    checks = sft_summary.get("copy_checks") or []
    return {key: checks[-1][key] for key in ("copy_accuracy", "multi_digit", "by_digits", "by_kind")} if checks else {}


def figure_values(summary: Mapping[str, Any]) -> dict[str, float]:
    """Each FIGURES value a demo summary holds, by name (the greedy ones are absent when the demo ran without)."""
    values = {}
    for figure in FIGURES:
        value: Any = summary
        for key in figure.path:
            value = value.get(key) if isinstance(value, Mapping) else None
        if isinstance(value, (int, float)):
            values[figure.name] = float(value)
    return values


def build_range(summaries: Sequence[Mapping[str, Any]], fingerprints: Sequence[str]) -> dict[str, Any]:
    """The range record of seed runs of one configuration (their demo summaries and config fingerprints): the
    fingerprint, the seeds, and for each figure every run holds its min, max, mean and per-seed values (in the
    order of `seeds`). ValueError for no runs or runs of different configurations (a range over them would mix
    configurations)."""
    if not summaries or len(summaries) != len(fingerprints):
        raise ValueError(f"a range needs one fingerprint per summary, at least one: {len(summaries)} summaries, "
                         f"{len(fingerprints)} fingerprints")
    if len(set(fingerprints)) > 1:
        raise ValueError(f"the runs have different configs (fingerprints {sorted(set(fingerprints))}): a range "
                         "needs runs that differ only in their seed")
    per_run = [figure_values(summary) for summary in summaries]
    figures = {}
    for figure in FIGURES:
        values = [run[figure.name] for run in per_run if figure.name in run]
        if len(values) == len(per_run):
            figures[figure.name] = {"min": min(values), "max": max(values), "mean": statistics.fmean(values),
                                    "values": values}
    return {"fingerprint": fingerprints[0], "seeds": [summary.get("seed") for summary in summaries],
            "figures": figures}


def compare_with_range(summary: Mapping[str, Any], fingerprint: str, record: Mapping[str, Any]) -> list[str]:
    """Lines a person reads: each figure of the run beside the range (marked where it falls outside), then what
    the RULES that apply suggest."""
    values = figure_values(summary)
    reading = Reading(values, record["figures"], fingerprint == record["fingerprint"])
    seeds = len(record["seeds"])
    lines = []
    for figure in FIGURES:
        side = reading.side(figure.name)
        if side is None:
            continue
        span = reading.ranges[figure.name]
        lines.append(f"{figure.label}: {show(values[figure.name], figure.unit)}   ({seeds} seeds: "
                     f"{show_span(span['min'], span['max'], figure.unit)})"
                     + ("" if side == "inside" else f"   {side} the range"))
    return lines + [f"-> {message}" for applies, message in RULES if applies(reading)]


def show(value: float, unit: Unit) -> str:
    """A figure as a person reads it ("7.3%", "+12.5 points", "141 tokens", "724 s")."""
    return _number(value, unit) + unit.suffix


def show_span(low: float, high: float, unit: Unit) -> str:
    """A range as a person reads it ("21.4-32.8%", "+2.1 to +16.7 points")."""
    return f"{_number(low, unit)}{' to ' if unit.signed else '-'}{_number(high, unit)}{unit.suffix}"


def _number(value: float, unit: Unit) -> str:
    return f"{unit.scale * value:{'+' if unit.signed else ''}.{unit.decimals}f}"


# The per-seed table: (header, figures shown as "before -> after" or alone); the change column adds its error.
TABLE_COLUMNS = (
    ("SFT start, T=1", ("sft_t1",)), ("after RL, T=1", ("rl_t1",)),
    ("paired change, T=1 (± standard error)", ("change_t1",)), ("pass@k", ("sft_pass", "rl_pass")),
    ("greedy", ("sft_greedy", "rl_greedy")), ("3-digit copies after SFT", ("sft_copies_3",)),
    ("failed calls in correct trajectories", ("sft_failed_correct", "rl_failed_correct")),
    ("response length after RL", ("rl_length",)), ("time: SFT", ("seconds_sft",)),
    ("evaluation before", ("seconds_eval_before",)), ("RL", ("seconds_rl",)),
    ("evaluation after", ("seconds_eval_after",)), ("total", ("seconds_total",)),
)


def seeds_table(summaries: Sequence[Mapping[str, Any]], record: Mapping[str, Any]) -> str:
    """Markdown: one row per seed run (its summary) and a row of the means in `record` (`build_range` of them)."""
    first = summaries[0]["after_sft"]["sampled"]
    lines = [f"# The CPU demo over {len(summaries)} seeds", "",
             f"{first['problems']} held-out problems x {first['samples']} samples at T={first['temperature']:g}, "
             f"and greedy; config fingerprint `{record['fingerprint']}` (`rstar_jax.eval.seed_range`). Shares in "
             "percent, changes in points, before -> after RL.", "",
             "| seed | " + " | ".join(header for header, _ in TABLE_COLUMNS) + " |",
             "|" + "---|" * (len(TABLE_COLUMNS) + 1)]
    for summary in summaries:
        values = figure_values(summary)
        error = summary.get("paired_change", {}).get("sampled", {}).get("standard_error")
        cells = [_cell(values, names) + (f" ± {100 * error:.1f}" if names == ("change_t1",) and error is not None
                                         else "") for _, names in TABLE_COLUMNS]
        lines.append(f"| {summary.get('seed')} | " + " | ".join(cells) + " |")
    means = {name: span["mean"] for name, span in record["figures"].items()}
    lines.append("| mean | " + " | ".join(_cell(means, names) for _, names in TABLE_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def _cell(values: Mapping[str, float], names: Sequence[str]) -> str:
    return " -> ".join(show(values[name], UNITS[name]) if name in values else "-" for name in names)
