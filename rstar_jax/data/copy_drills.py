"""Copy drills: short sequences dense in the copies a tool-using solver makes, the warm-up of the demo's format SFT.

Why (issue 9; measured in BENCHMARKS.md): a solver that calls the tool must copy the question's numbers into its
program and the program's output into its answer. In whole transcripts those copies are a few tokens among hundreds
of template and prompt tokens, and the tiny model never learned them (it wrote the same numbers for every question,
1-3 of 64 answers right). Each drill strings together a few synthetic questions, each followed by its solution
program, and program outputs followed by the final answer that repeats them; trained on such short sequences the
model learns to copy within a few hundred steps, and the format SFT that follows builds on it.

Questions come from the training split of the synthetic tasks; the outputs are random numbers, not the tasks'
answers, so no drill states an answer. Drill `index` of `seed` is always the same sequence.
"""

from __future__ import annotations

import random
from typing import Sequence

from transformers import PreTrainedTokenizerBase

from rstar_jax.data.synthetic import KINDS, synthetic_task
from rstar_jax.data.synthetic_sft import final_turn_text

MAX_DIFFICULTY = 3


def _question_and_program(rng: random.Random, seed: int, kinds: Sequence[str]) -> str:
    task = synthetic_task(rng.randrange(1 << 30), seed, rng.randint(1, MAX_DIFFICULTY), rng.choice(kinds), "train")
    return f"{task.problem.question}\n{task.solution_code}\n"


def _output_and_answer(rng: random.Random) -> str:
    value = str(rng.randrange(10 ** rng.randint(1, 6)))
    return f"stdout:\n{value}\n{final_turn_text(value)}\n"


def copy_drill_text(index: int, seed: int = 0, snippets: int = 4, kinds: Sequence[str] = KINDS) -> str:
    """Drill `index` of `seed` as text: `snippets` pieces, each a question with its program or an output with the
    answer that copies it (half of each, in a seeded order)."""
    if snippets < 1:
        raise ValueError(f"a copy drill needs at least one snippet, got {snippets}")
    rng = random.Random(f"copy-drill:{seed}:{index}")
    return "".join(_question_and_program(rng, seed, kinds) if rng.random() < 0.5 else _output_and_answer(rng)
                   for _ in range(snippets))


def copy_drill_ids(index: int, tokenizer: PreTrainedTokenizerBase, seed: int = 0, snippets: int = 4,
                   kinds: Sequence[str] = KINDS) -> tuple[int, ...]:
    """The token ids of drill `index` (every one is trained on: loss mask all ones)."""
    return tuple(tokenizer.encode(copy_drill_text(index, seed, snippets, kinds), add_special_tokens=False))
