"""Copy drills: short sequences dense in the copies a tool-using solver makes, the warm-up of the demo's format SFT.

Why (issue 9; measured in BENCHMARKS.md): a solver that calls the tool must copy the question's numbers into its
program and the program's output into its answer. In whole transcripts those copies are a few tokens among hundreds
of template and prompt tokens, and the tiny model never learned them (it wrote the same numbers for every question,
1-3 of 64 answers right). Each drill strings together a few pieces laid out exactly as in a transcript: a user turn
with a synthetic question and the assistant turn that calls the tool with its program, or a tool response with an
output and the final turn that boxes it. The layout matters: the hard copy is the question's numbers into the
program across the assistant turn's opening (its reason and the tool call's JSON, ~30 tokens); drills that put the
program right after the question taught a copy that the model did not use inside transcripts (teacher-forced, the
first program's numbers were right 7-44% of the time depending on the seed, against 55-75% for the other copies).

A third kind of piece, a retry (a question, a first call whose last line is broken, the sandbox's error and the
fixed call), teaches the copy a transcript's second call makes: the question's numbers again, across a whole failed
turn. Drills of the first two kinds alone teach copies from the turn just before, which a retry's is not: the demo's
SFT models copied 9-15% of a fixed call's numbers, teacher-forced on held-out transcripts, against ~79% of a first
call's. A share of 0.3 retries raised that to 42-53% but cost the answers' copies more (BENCHMARKS.md, "Copying
numbers"), so the demo drills without them and has fewer SFT transcripts retry instead.

Questions come from the training split of the synthetic tasks; the outputs are random numbers, not the tasks'
answers, so no drill states an answer. Drill `index` of `seed` is always the same sequence.
"""

from __future__ import annotations

import itertools
import random
from typing import Iterator, Sequence

from transformers import PreTrainedTokenizerBase

from rstar_jax.agent.tool_call import ToolCall, tool_call_text
from rstar_jax.agent.tool_protocol import FixedOutcome
from rstar_jax.agent.tool_response import format_tool_response
from rstar_jax.data.synthetic import KINDS, SyntheticTask, synthetic_task
from rstar_jax.data.synthetic_sft import (DEFAULT_FAULT_KINDS, INTROS, SolutionPlan, assistant_turns,
                                          faulty_version, final_turn_text)
from rstar_jax.tokenizers.special_tokens import IM_END, IM_START

MAX_DIFFICULTY = 3
# The sandbox's stderr for each broken last line `synthetic_sft.faulty_version` writes ({line}: the line it is on;
# CPython 3.11's wording), so a retry shows the real error without running the tool. The sandbox test of the SFT
# transcripts holds them to the server's (tests/data/test_synthetic_sft_sandbox.py).
FAULT_STDERR = {
    "print(result": '  File "<code>", line {line}\n    print(result\n         ^\n'
                    "SyntaxError: '(' was never closed\n",
    "print result": '  File "<code>", line {line}\n    print result\n    ^^^^^^^^^^^^\n'
                    "SyntaxError: Missing parentheses in call to 'print'. Did you mean print(...)?\n",
    "print(answer)": 'Traceback (most recent call last):\n  File "<code>", line {line}, in <module>\n'
                     "    print(answer)\n           ^^^^^^\nNameError: name 'answer' is not defined\n",
    "print(reslt)": 'Traceback (most recent call last):\n  File "<code>", line {line}, in <module>\n'
                    "    print(reslt)\n           ^^^^^\nNameError: name 'reslt' is not defined\n",
}


def _turn(role: str, text: str) -> str:
    return f"{IM_START}{role}\n{text}{IM_END}\n"


def _tool_response_turn(outcome: FixedOutcome) -> str:
    return _turn("user", f"<tool_response>\n{format_tool_response(outcome, show_duration=False)}\n</tool_response>")


def _task(rng: random.Random, seed: int, kinds: Sequence[str]) -> SyntheticTask:
    return synthetic_task(rng.randrange(1 << 30), seed, rng.randint(1, MAX_DIFFICULTY), rng.choice(kinds), "train")


def _question_and_program(rng: random.Random, seed: int, kinds: Sequence[str]) -> str:
    task = _task(rng, seed, kinds)
    call = tool_call_text(ToolCall(code=task.solution_code))
    return _turn("user", task.problem.question) + _turn("assistant", f"<reason>{rng.choice(INTROS)}</reason>\n{call}")


def fault_outcome(faulty_code: str) -> FixedOutcome:
    """The sandbox's outcome for a program whose last line `faulty_version` broke (FAULT_STDERR)."""
    lines = faulty_code.splitlines()
    return FixedOutcome("error", "", FAULT_STDERR[lines[-1]].format(line=len(lines)), 1, 0.0)


def _question_and_retry(rng: random.Random, seed: int, kinds: Sequence[str]) -> str:
    """A question, the faulty first call, its error and the fixed call, worded as `synthetic_sft` words them."""
    task = _task(rng, seed, kinds)
    intro, fault = rng.choice(INTROS), rng.choice(DEFAULT_FAULT_KINDS)
    plan = SolutionPlan(task, intro, fault, faulty_version(task.solution_code, fault, rng))
    error = fault_outcome(plan.faulty_code)
    first, fix, _ = assistant_turns(plan, [error, FixedOutcome("ok", task.problem.answer + "\n", "", 0, 0.0)])
    return (_turn("user", task.problem.question) + _turn("assistant", first.text) + _tool_response_turn(error)
            + _turn("assistant", fix.text))


def _output_and_answer(rng: random.Random) -> str:
    value = str(rng.randrange(10 ** rng.randint(1, 6)))
    response = _tool_response_turn(FixedOutcome("ok", value + "\n", "", 0, 0.0))
    return response + _turn("assistant", final_turn_text(value))


def _listed_number(rng: random.Random, long_numbers: float) -> int:
    """A share `long_numbers` of 4-6 digits (two tokens), the rest half of 3 digits, half below 100 (one token)."""
    draw = rng.random()
    if draw < long_numbers:
        return rng.randrange(1000, 10 ** rng.randint(4, 6))
    return rng.randrange(100, 1000) if draw < long_numbers + (1.0 - long_numbers) / 2 else rng.randrange(100)


def _repeat(rng: random.Random, long_numbers: float) -> str:
    """A user turn listing 4-10 random numbers (`_listed_number`) and the assistant turn that repeats them."""
    numbers = [str(_listed_number(rng, long_numbers)) for _ in range(rng.randint(4, 10))]
    listed = rng.choice((" ", ", ", " * ")).join(numbers)
    return _turn("user", listed) + _turn("assistant", listed)


def _pieces(index: int, seed: int, kinds: Sequence[str], retries: float, repeats: float = 0.0,
            long_numbers: float = 0.0) -> Iterator[str]:
    """Drill `index` of `seed`'s pieces, endlessly, in a seeded order: a share `retries` of retries, a share
    `repeats` of number lists repeated (a share `long_numbers` of their numbers of two tokens), the rest half
    questions with their tool calls, half tool responses with the final turns that box them."""
    if not 0.0 <= retries < 1.0 or not 0.0 <= repeats < 1.0 or retries + repeats >= 1.0:
        raise ValueError(f"the shares of retry and repeat pieces must be within [0, 1) and sum below 1, got "
                         f"{retries} and {repeats}")
    if not 0.0 <= long_numbers <= 1.0:
        raise ValueError(f"the share of long listed numbers must be within [0, 1], got {long_numbers}")
    if not kinds or set(kinds) - set(KINDS):
        raise ValueError(f"drill questions need synthetic kinds among {KINDS}, got {tuple(kinds)}")
    rng = random.Random(f"copy-drill:{seed}:{index}")
    while True:
        draw = rng.random()
        if draw < retries:
            yield _question_and_retry(rng, seed, kinds)
        elif draw < retries + repeats:
            yield _repeat(rng, long_numbers)
        elif draw < retries + repeats + (1.0 - retries - repeats) / 2:
            yield _question_and_program(rng, seed, kinds)
        else:
            yield _output_and_answer(rng)


def copy_drill_text(index: int, seed: int = 0, snippets: int = 4, kinds: Sequence[str] = KINDS,
                    retries: float = 0.0, repeats: float = 0.0, long_numbers: float = 0.0) -> str:
    """Drill `index` of `seed` as text: `snippets` pieces in the transcripts' chat layout, each a question with the
    tool call that runs its program, a tool response with the final turn that boxes its output, or (a share
    `retries`) a question with a failed call, its error and the fixed call, or (a share `repeats`) a list of numbers
    repeated, a share `long_numbers` of them of 4-6 digits; in a seeded order."""
    if snippets < 1:
        raise ValueError(f"a copy drill needs at least one snippet, got {snippets}")
    return "".join(itertools.islice(_pieces(index, seed, kinds, retries, repeats, long_numbers), snippets))


def copy_drill_ids(index: int, tokenizer: PreTrainedTokenizerBase, seed: int = 0, snippets: int = 4,
                   kinds: Sequence[str] = KINDS, retries: float = 0.0, repeats: float = 0.0,
                   long_numbers: float = 0.0) -> tuple[int, ...]:
    """The token ids of drill `index` (`copy_drill_text`)."""
    return tuple(tokenizer.encode(copy_drill_text(index, seed, snippets, kinds, retries, repeats, long_numbers),
                                  add_special_tokens=False))


def assistant_mask(ids: Sequence[int], tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """1 on the tokens the assistant turns of a chat-layout row write (their text and closing `<|im_end|>`), 0 on
    everything else: user and tool turns, chat markers and role lines. A drill's questions, tool outputs and listed
    numbers are random, so a loss on them trains the model to predict noise; SFT transcripts train only the model's
    own turns (SPEC section 5). The row must start at a turn (as drills do); one cut inside a turn is masked to its
    end."""
    start_id, end_id = tokenizer.convert_tokens_to_ids(IM_START), tokenizer.convert_tokens_to_ids(IM_END)
    header = tokenizer.encode("assistant\n", add_special_tokens=False)
    mask, inside, skip = [], False, 0
    for position, token in enumerate(ids):
        if skip:
            mask.append(0)
            skip -= 1
        elif token == start_id:
            mask.append(0)
            inside = list(ids[position + 1:position + 1 + len(header)]) == header
            skip = len(header) if inside else 0
        else:
            mask.append(1 if inside else 0)
            if token == end_id:
                inside = False
    return tuple(mask)


def filled_drill_ids(index: int, tokenizer: PreTrainedTokenizerBase, length: int, seed: int = 0,
                     kinds: Sequence[str] = KINDS, retries: float = 0.0, repeats: float = 0.0,
                     long_numbers: float = 0.0) -> tuple[int, ...]:
    """Drill `index`'s pieces, as many as it takes, cut to exactly `length` + 1 tokens: a training row of `length`
    next-token predictions with no padding (a row of whole pieces pads to its batch's longest, ~40% of the demo's
    drill rows). The first pieces are those of `copy_drill_text(index, seed)`; only the last is cut."""
    if length < 1:
        raise ValueError(f"a filled drill needs a positive length, got {length}")
    ids: list[int] = []
    pieces = _pieces(index, seed, kinds, retries, repeats, long_numbers)
    while len(ids) <= length:
        ids += tokenizer.encode(next(pieces), add_special_tokens=False)  # each piece starts with a special token
    return tuple(ids[:length + 1])
