"""Copy drills: short sequences dense in the copies a tool-using solver makes, the warm-up of the demo's format SFT.

Why (issue 9; measured in BENCHMARKS.md "Copying numbers"): a solver that calls the tool must copy the question's
numbers into its program. In whole transcripts those copies are a few tokens among hundreds of template and prompt
tokens, and the tiny model did not learn them from transcripts alone. Each drill strings together a few questions,
each in a user turn followed by the assistant turn that calls the tool with its program, exactly as a transcript
lays them out. The layout matters: the copy crosses the assistant turn's opening (its reason and the tool call's
JSON, ~30 tokens). Drills that put each program right after its question taught a copy the model did not use inside
transcripts (teacher-forced, the first program's numbers right 7-44% of the time by seed, against 55-73% for the
outputs' copies into answers, which transcripts teach well enough, so the drills leave them out).

Questions come from the training split of the synthetic tasks. Drill `index` of `seed` is always the same sequence.
"""

from __future__ import annotations

import random
from typing import Sequence

from transformers import PreTrainedTokenizerBase

from rstar_jax.agent.tool_call import ToolCall, tool_call_text
from rstar_jax.data.synthetic import KINDS, synthetic_task
from rstar_jax.data.synthetic_sft import INTROS
from rstar_jax.tokenizers.special_tokens import IM_END, IM_START

MAX_DIFFICULTY = 3


def _turn(role: str, text: str) -> str:
    return f"{IM_START}{role}\n{text}{IM_END}\n"


def _question_and_program(rng: random.Random, seed: int, kinds: Sequence[str]) -> str:
    task = synthetic_task(rng.randrange(1 << 30), seed, rng.randint(1, MAX_DIFFICULTY), rng.choice(kinds), "train")
    call = tool_call_text(ToolCall(code=task.solution_code))
    return _turn("user", task.problem.question) + _turn("assistant", f"<reason>{rng.choice(INTROS)}</reason>\n{call}")


def copy_drill_text(index: int, seed: int = 0, snippets: int = 4, kinds: Sequence[str] = KINDS) -> str:
    """Drill `index` of `seed` as text: `snippets` questions, each in a user turn followed by the assistant turn
    that calls the tool with its program, laid out as in a transcript."""
    if snippets < 1:
        raise ValueError(f"a copy drill needs at least one snippet, got {snippets}")
    rng = random.Random(f"copy-drill:{seed}:{index}")
    return "".join(_question_and_program(rng, seed, kinds) for _ in range(snippets))


def copy_drill_ids(index: int, tokenizer: PreTrainedTokenizerBase, seed: int = 0, snippets: int = 4,
                   kinds: Sequence[str] = KINDS) -> tuple[int, ...]:
    """The token ids of drill `index` (every one is trained on: loss mask all ones)."""
    return tuple(tokenizer.encode(copy_drill_text(index, seed, snippets, kinds), add_special_tokens=False))
