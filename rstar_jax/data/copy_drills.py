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
from rstar_jax.data.synthetic import KINDS, synthetic_task
from rstar_jax.data.synthetic_sft import INTROS, final_turn_text
from rstar_jax.tokenizers.special_tokens import IM_END, IM_START

MAX_DIFFICULTY = 3


def _turn(role: str, text: str) -> str:
    return f"{IM_START}{role}\n{text}{IM_END}\n"


def _question_and_program(rng: random.Random, seed: int, kinds: Sequence[str]) -> str:
    task = synthetic_task(rng.randrange(1 << 30), seed, rng.randint(1, MAX_DIFFICULTY), rng.choice(kinds), "train")
    call = tool_call_text(ToolCall(code=task.solution_code))
    return _turn("user", task.problem.question) + _turn("assistant", f"<reason>{rng.choice(INTROS)}</reason>\n{call}")


def _output_and_answer(rng: random.Random) -> str:
    value = str(rng.randrange(10 ** rng.randint(1, 6)))
    response = format_tool_response(FixedOutcome("ok", value + "\n", "", 0, 0.0), show_duration=False)
    return _turn("user", f"<tool_response>\n{response}\n</tool_response>") + _turn("assistant", final_turn_text(value))


def _pieces(index: int, seed: int, kinds: Sequence[str]) -> Iterator[str]:
    """Drill `index` of `seed`'s pieces, endlessly: questions with their tool calls or tool responses with the final
    turns that box them, half of each in a seeded order."""
    rng = random.Random(f"copy-drill:{seed}:{index}")
    while True:
        yield _question_and_program(rng, seed, kinds) if rng.random() < 0.5 else _output_and_answer(rng)


def copy_drill_text(index: int, seed: int = 0, snippets: int = 4, kinds: Sequence[str] = KINDS) -> str:
    """Drill `index` of `seed` as text: `snippets` pieces in the transcripts' chat layout, each a question with the
    tool call that runs its program or a tool response with the final turn that boxes its output (half of each, in a
    seeded order)."""
    if snippets < 1:
        raise ValueError(f"a copy drill needs at least one snippet, got {snippets}")
    return "".join(itertools.islice(_pieces(index, seed, kinds), snippets))


def copy_drill_ids(index: int, tokenizer: PreTrainedTokenizerBase, seed: int = 0, snippets: int = 4,
                   kinds: Sequence[str] = KINDS) -> tuple[int, ...]:
    """The token ids of drill `index` (every one is trained on: loss mask all ones)."""
    return tuple(tokenizer.encode(copy_drill_text(index, seed, snippets, kinds), add_special_tokens=False))


def filled_drill_ids(index: int, tokenizer: PreTrainedTokenizerBase, length: int, seed: int = 0,
                     kinds: Sequence[str] = KINDS) -> tuple[int, ...]:
    """Drill `index`'s pieces, as many as it takes, cut to exactly `length` + 1 tokens: a training row of `length`
    next-token predictions with no padding (a row of whole pieces pads to its batch's longest, ~40% of the demo's
    drill rows). The first pieces are those of `copy_drill_text(index, seed)`; only the last is cut."""
    if length < 1:
        raise ValueError(f"a filled drill needs a positive length, got {length}")
    ids: list[int] = []
    pieces = _pieces(index, seed, kinds)
    while len(ids) <= length:
        ids += tokenizer.encode(next(pieces), add_special_tokens=False)  # each piece starts with a special token
    return tuple(ids[:length + 1])
