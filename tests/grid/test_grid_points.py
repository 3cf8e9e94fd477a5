"""Grid expansion and run naming (rstar_jax/grid/points.py, axes.py): --grid text, JSON grid files, the ablation's
selector and seed axes, and the clear errors bad grids give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rstar_jax.grid.axes import seed_axis, selector_axis
from rstar_jax.grid.points import (MAX_NAME, Axis, AxisValue, GridError, Point, expand, load_grid_file,
                                   parse_grid_arg, point_name, split_top_level)


def test_a_grid_argument_becomes_one_binding_per_value() -> None:
    axis = parse_grid_arg("short/Stage.max_response_tokens=[256, 384]")
    assert axis.name == "short/Stage.max_response_tokens"
    assert [value.bindings for value in axis.values] == [("short/Stage.max_response_tokens = 256",),
                                                         ("short/Stage.max_response_tokens = 384",)]
    assert [value.label for value in axis.values] == ["short.Stage.max_response_tokens=256",
                                                      "short.Stage.max_response_tokens=384"]


def test_values_split_at_top_level_commas_only() -> None:
    assert split_top_level("@a/Stage(), 'x,y', (1, 2), [3, (4, 5)]") == ["@a/Stage()", "'x,y'", "(1, 2)",
                                                                         "[3, (4, 5)]"]
    axis = parse_grid_arg("make_selector.algorithm=['roc', 'grpo']")
    assert axis.values[1].bindings == ("make_selector.algorithm = 'grpo'",)
    assert axis.values[1].label == "make_selector.algorithm='grpo'"


def test_the_product_runs_every_combination_with_names_from_the_point_alone() -> None:
    axes = [parse_grid_arg("RLSettings.group_size=[2, 4]"), parse_grid_arg("short/Stage.max_turns=[3, 5]")]
    points = expand(axes, "/models/sft")
    assert [point.name for point in points] == [
        "RLSettings.group_size=2__short.Stage.max_turns=3", "RLSettings.group_size=2__short.Stage.max_turns=5",
        "RLSettings.group_size=4__short.Stage.max_turns=3", "RLSettings.group_size=4__short.Stage.max_turns=5"]
    assert points[1].bindings == ("RLSettings.group_size = 2", "short/Stage.max_turns = 5")
    assert all(point.model == "/models/sft" for point in points)
    # Adding a value to an axis renames nobody.
    more = expand([parse_grid_arg("RLSettings.group_size=[2, 4, 8]"), axes[1]], "/models/sft")
    assert {point.name for point in points} <= {point.name for point in more}
    assert Point.from_json(json.loads(json.dumps(points[2].to_json()))) == points[2]


def test_names_are_safe_and_long_ones_are_cut_with_a_hash() -> None:
    assert point_name(["make_selector.algorithm='roc'", "a b/c"]) == "make_selector.algorithm=roc__a_b_c"
    long_labels = ["x" * 80, "y" * 80]
    name = point_name(long_labels)
    assert len(name) == MAX_NAME and name == point_name(long_labels)
    assert name != point_name(["x" * 80, "y" * 79 + "z"])


def test_a_json_grid_file_gives_named_joint_values_and_plain_value_lists(tmp_path: Path) -> None:
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"comment": "two schedules", "axes": {
        "schedule": {"s256": ["short/Stage.max_response_tokens = 256", "longer/Stage.max_response_tokens = 384"],
                     "s384": ["short/Stage.max_response_tokens = 384", "longer/Stage.max_response_tokens = 512"]},
        "RLSettings.zero_variance": ["'drop'", "'refill'"], "HeldOutEval.greedy": [True],
        "JaxEngine.decode_windows": [[128, 256]]}}))
    schedule, variance, greedy, windows = load_grid_file(path)
    assert schedule.values[0] == AxisValue("s256", ("short/Stage.max_response_tokens = 256",
                                                    "longer/Stage.max_response_tokens = 384"))
    assert variance.values[1].bindings == ("RLSettings.zero_variance = 'refill'",)
    assert greedy.values[0].bindings == ("HeldOutEval.greedy = True",)
    assert windows.values[0].bindings == ("JaxEngine.decode_windows = [128, 256]",)
    points = expand([schedule, variance], "m")
    assert [point.name for point in points][:2] == ["s256__RLSettings.zero_variance=drop",
                                                    "s256__RLSettings.zero_variance=refill"]


def test_the_ablation_axes_cross_selectors_with_seeds_and_per_seed_models() -> None:
    selectors = selector_axis(["roc_paper", "roc_release", "penalty", "grpo"], [0.25, 1.0])
    assert [value.label for value in selectors.values] == ["roc_paper", "roc_release", "penalty_l0.25",
                                                           "penalty_l1", "grpo"]
    assert selectors.values[1].bindings == ("make_selector.algorithm = 'roc'", "RocSelector.mode = 'release'")
    assert selectors.values[2].bindings == ("make_selector.algorithm = 'penalty'",
                                            "PenaltySelector.penalty_lambda = 0.25")
    points = expand([selectors, seed_axis([0, 1], "/exp/seed{seed}/sft/model")], "/exp/seed{seed}/sft/model")
    assert len(points) == 10 and points[0].name == "roc_paper__seed0"
    assert points[1].model == "/exp/seed1/sft/model" and "RLSettings.seed = 1" in points[1].bindings
    assert points[0].group(["seed"]) == points[1].group(["seed"]) == "roc_paper"
    shared = expand([seed_axis([3])], "/one/model")
    assert shared[0].model == "/one/model"


@pytest.mark.parametrize("text, message", [
    ("RLSettings.group_size", "expected KEY=[v1, v2, ...]"),
    ("RLSettings.group_size=2, 4", "must be a bracketed list"),
    ("RLSettings.group_size=[]", "is empty"),
    ("RLSettings.group_size=[2, , 4]", "an empty value"),
    ("RLSettings.group_size=[2, 2]", "repeated values"),
    ("group_size=[2, 4]", "is not a gin parameter"),
    ("RLSettings.group size=[2]", "is not a gin parameter"),
    ("RLSettings.stages=[(1, 2))]", "unbalanced"),
    ("RLSettings.stages=[(1, 2]", "unclosed bracket"),
    ("make_selector.algorithm=['roc]", "unclosed quote"),
])
def test_bad_grid_text_gives_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(GridError, match=message.replace("[", r"\[").replace("(", r"\(")):
        parse_grid_arg(text)


def test_bad_grids_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(GridError, match="at least one axis"):
        expand([], "m")
    axis = parse_grid_arg("RLSettings.seed=[1, 2]")
    with pytest.raises(GridError, match="repeated grid axes"):
        expand([axis, axis], "m")
    clash = Axis("a", (AxisValue("x y", ("RLSettings.seed = 1",)), AxisValue("x_y", ("RLSettings.seed = 2",))))
    with pytest.raises(GridError, match="share the run name 'x_y'"):
        expand([clash], "m")
    for content, message in [("{", "grid file"), ('{"axes": {}}', "expected an object"),
                             ('{"axes": {"a": 3}}', "axis 'a'"),
                             ('{"axes": {"a": {"x": ["no binding"]}}}', "value 'x'"),
                             ('{"axes": {"RLSettings.seed": [1]}, "base": []}', "unknown keys")]:
        path = tmp_path / "grid.json"
        path.write_text(content)
        with pytest.raises(GridError, match=message):
            load_grid_file(path)
    with pytest.raises(GridError, match="unknown ablation arms"):
        selector_axis(["roc"])
    with pytest.raises(GridError, match="at least one lambda"):
        selector_axis(["penalty"], [])
    with pytest.raises(GridError, match="distinct"):
        seed_axis([1, 1])
