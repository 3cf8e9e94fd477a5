"""The demo's range over seeds (rstar_jax.eval.seed_range): aggregation of hand-made summaries, the config
fingerprint, each line a run is read with and each rule of what a figure outside the range suggests."""

import math

import pytest

from demo_summaries import CONFIG, summary
from rstar_jax.eval.seed_range import (FIGURES, build_range, compare_with_range, config_fingerprint, figure_values,
                                       seeds_table, sft_copies)

RUNS = [summary(0, sft=0.214, rl=0.484, total=700.0, copies=0.7), summary(1, sft=0.328, rl=0.479, total=760.0),
        summary(2, sft=0.30, rl=0.42, total=820.0, copies=0.9)]
FINGERPRINT = config_fingerprint(CONFIG.format(seed=0))
RANGE = build_range(RUNS, [FINGERPRINT] * 3)


def rule_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("-> ")]


def test_the_fingerprint_ignores_the_seed_and_layout_bindings_but_no_other_binding():
    assert config_fingerprint(CONFIG.format(seed=0)) == config_fingerprint(CONFIG.format(seed=7))
    layout = "RLSettings.micro_batch_rows = 2\nRLSettings.pack_length = 1024\nRLSettings.logprob_chunk = 128"
    with_layout = CONFIG.format(seed=0).replace("RLSettings.group_size = 4", "RLSettings.group_size = 4\n" + layout)
    assert with_layout != CONFIG.format(seed=0) and config_fingerprint(with_layout) == FINGERPRINT
    for old, new in (("train_sft.steps = 300", "train_sft.steps = 200"), ("HeldOutEval.seed = 12345",
                                                                        "HeldOutEval.seed = 1")):
        assert config_fingerprint(CONFIG.format(seed=0).replace(old, new)) != FINGERPRINT, new


def test_the_range_holds_each_figure_min_max_mean_and_values_in_seed_order():
    assert RANGE["fingerprint"] == FINGERPRINT and RANGE["seeds"] == [0, 1, 2]
    sft = RANGE["figures"]["sft_t1"]
    assert sft["values"] == [0.214, 0.328, 0.30] and (sft["min"], sft["max"]) == (0.214, 0.328)
    assert math.isclose(sft["mean"], (0.214 + 0.328 + 0.30) / 3)
    change = RANGE["figures"]["change_t1"]
    assert change["min"] == pytest.approx(0.12) and change["max"] == pytest.approx(0.27)
    assert RANGE["figures"]["seconds_total"]["values"] == [700.0, 760.0, 820.0]
    assert RANGE["figures"]["seconds_rl"]["max"] == pytest.approx(0.35 * 820)
    assert set(RANGE["figures"]) == {figure.name for figure in FIGURES}


def test_a_figure_some_run_lacks_is_left_out_and_mixed_configs_are_refused():
    record = build_range([*RUNS, summary(3, greedy=None)], [FINGERPRINT] * 4)
    assert "sft_greedy" not in record["figures"] and "sft_t1" in record["figures"]
    with pytest.raises(ValueError, match="different configs"):
        build_range(RUNS, [FINGERPRINT, FINGERPRINT, "another"])
    with pytest.raises(ValueError, match="one fingerprint per summary"):
        build_range([], [])


def test_a_run_inside_the_range_reads_figure_by_figure_with_nothing_to_explain():
    lines = compare_with_range(summary(5, sft=0.25, rl=0.45, total=750.0), FINGERPRINT, RANGE)
    assert lines[0] == "SFT start, T=1: 25.0%   (3 seeds: 21.4-32.8%)"
    assert "paired change, T=1: +20.0 points   (3 seeds: +12.0 to +27.0 points)" in lines
    assert "time, total: 750 s   (3 seeds: 700-820 s)" in lines
    assert len(lines) == len(FIGURES) and rule_lines(lines) == []


def test_a_weak_sft_start_is_marked_and_explained_by_its_copies():
    lines = compare_with_range(summary(5, sft=0.073, rl=0.073, total=750.0, copies=0.1), FINGERPRINT, RANGE)
    assert lines[0] == "SFT start, T=1: 7.3%   (3 seeds: 21.4-32.8%)   below the range"
    assert "SFT, 3-digit copies right (teacher-forced): 10.0%   (3 seeds: 70.0-90.0%)   below the range" in lines
    (rule,) = rule_lines(lines)  # the gain is below the range too, but from a weak start: not RL's fault
    assert "weak SFT draw" in rule and "did not learn to copy numbers" in rule and "changed config" in rule
    # The same start with copies inside the range: still a weak draw, but not of the copy.
    (rule,) = rule_lines(compare_with_range(summary(5, sft=0.073, rl=0.073, total=750.0), FINGERPRINT, RANGE))
    assert "weak SFT draw" in rule and "copy" not in rule


def test_the_copy_figures_are_the_last_check_the_sft_made():
    first = {"step": 680, "phase": "copy_check", "passed": False, "copy_accuracy": 0.5, "multi_digit": 0.4,
             "by_digits": {"3": 0.3}, "by_kind": {"answer": 0.6}}
    last = {**first, "step": 770, "passed": True, "multi_digit": 0.9, "by_digits": {"3": 0.88}}
    assert sft_copies({"copy_checks": [first, last]}) == {"copy_accuracy": 0.5, "multi_digit": 0.9,
                                                          "by_digits": {"3": 0.88}, "by_kind": {"answer": 0.6}}
    assert sft_copies({"copy_checks": []}) == {} and sft_copies({"steps": 680}) == {}
    assert figure_values({**summary(5), "sft_copies": {}}).keys() == figure_values(summary(5)).keys() - {"sft_copies_3"}


def test_a_gain_below_the_range_from_a_normal_start_points_at_rl():
    (rule,) = rule_lines(compare_with_range(summary(5, sft=0.25, rl=0.27, total=750.0), FINGERPRINT, RANGE))
    assert "RL did not learn" in rule and "rl/metrics.jsonl" in rule


def test_nearly_every_tool_call_failing_points_at_the_sandbox():
    for failed in ((1.0, 0.1), (0.4, 0.95)):
        (rule,) = rule_lines(compare_with_range(summary(5, failed_all=failed, total=750.0), FINGERPRINT, RANGE))
        assert "broken sandbox" in rule
    assert rule_lines(compare_with_range(summary(5, failed_all=(0.6, 0.3), total=750.0), FINGERPRINT, RANGE)) == []


def test_another_config_makes_the_range_a_rough_guide():
    other = config_fingerprint(CONFIG.format(seed=0).replace("train_sft.steps = 300", "train_sft.steps = 30"))
    (rule,) = rule_lines(compare_with_range(summary(5, total=750.0), other, RANGE))
    assert "your config differs from the one the range was measured with" in rule and "rough guide" in rule


def test_only_a_total_time_far_above_the_range_blames_the_machine():
    lines = compare_with_range(summary(5, total=1000.0), FINGERPRINT, RANGE)  # above, but under 1.5 x 820 s
    assert "time, total: 1000 s   (3 seeds: 700-820 s)   above the range" in lines and rule_lines(lines) == []
    (rule,) = rule_lines(compare_with_range(summary(5, total=1300.0), FINGERPRINT, RANGE))
    assert "slower or busy machine" in rule


def test_figures_the_range_lacks_are_not_shown():
    record = build_range([summary(0, greedy=None)], [FINGERPRINT])
    lines = compare_with_range(summary(5), FINGERPRINT, record)
    assert not any("greedy" in line for line in lines) and "1 seeds" in lines[0]
    assert set(figure_values(summary(5))) - set(record["figures"]) == {"sft_greedy", "rl_greedy", "change_greedy"}


def test_the_table_has_a_row_per_seed_and_the_mean():
    lines = seeds_table(RUNS, RANGE).splitlines()
    assert lines[0] == "# The CPU demo over 3 seeds" and "64 held-out problems x 3 samples at T=1" in lines[2]
    header, rows = lines[4], lines[6:]
    assert header.startswith("| seed | SFT start, T=1 | after RL, T=1 | paired change, T=1 (± standard error) |")
    assert [row.split(" | ")[0] for row in rows] == ["| 0", "| 1", "| 2", "| mean"]
    cells = rows[0].strip("| ").split(" | ")
    assert cells[1:6] == ["21.4%", "48.4%", "+27.0 points ± 3.0", "41.4% -> 68.4%", "60.0% -> 80.0%"]
    assert cells[-1] == "700 s"
    mean = rows[-1].strip("| ").split(" | ")
    assert mean[1] == "28.1%" and mean[-1] == "760 s"  # (21.4 + 32.8 + 30.0) / 3, (700 + 760 + 820) / 3
    assert mean[3] == "+18.0 points"  # (27.0 + 15.1 + 12.0) / 3, without an error: not one run's
