"""How experiments/bench/product_failures.py sorts a product trajectory: by the first thing in it that went wrong."""

import pytest

from experiments.bench.product_failures import factors, first_failure

QUESTION = "Compute 523 * 63."
INTRO = "<reason>I will let Python do the exact arithmetic.</reason>\n<tool_call>\n"


def call(first: str, second: str, last_line: str = "print(result)") -> str:
    return (INTRO + '{"name": "execute_python_code_with_standard_io", "arguments": {"code": "result = '
            + f'{first} * {second}\\n{last_line}", "input": ""}}}}\n</tool_call>')


def answer(value: str) -> str:
    return f"<reason>The program printed {value}.</reason>\n<answer>\\boxed{{{value}}}</answer>"


def output(value: str) -> str:
    return f"<tool_response>\nstdout:\n{value}\n</tool_response>"


@pytest.mark.parametrize("model_text, tool_text, correct, expected", [
    (call("523", "63") + answer("32949"), output("32949"), True, "right"),
    ("<reason>It is 32949.</reason>\n<answer>\\boxed{32949}</answer>", "", False, "no program"),
    (call("523", "71") + answer("37133"), output("37133"), False, "second factor miscopied"),
    (call("609", "63") + answer("38367"), output("38367"), False, "first factor miscopied"),
    (call("510", "32") + answer("16320"), output("16320"), False, "both factors miscopied"),
    (call("523", "63", "print(reslt)") + call("184", "30") + answer("5520"), output("NameError") + output("5520"),
     False, "right program, no output"),
    (call("523", "63") + answer("32955"), output("32949"), False, "output miscopied into the answer"),
    (call("523", "63") + "<reason>The program printed 32949.</reason>", output("32949"), False, "output, no answer"),
], ids=["right", "no-program", "second", "first", "both", "never-fixed", "answer", "no-answer"])
def test_a_trajectory_is_sorted_by_its_first_failure(model_text, tool_text, correct, expected):
    assert first_failure(QUESTION, model_text, tool_text, correct) == expected


def test_only_product_questions_have_factors():
    assert factors(QUESTION) == ("523", "63")
    with pytest.raises(ValueError, match="not a product question"):
        factors("What is the sum of the digits of 16^9?")
