"""The copy probe's classifier (experiments/bench/copy_probe.py): which tokens of a chat-layout text are copies, and
of which kind; the BENCHMARKS figures by kind rest on it."""

from __future__ import annotations

from rstar_jax.train.copies import copied_positions, held_out_copies
from rstar_jax.data.copy_drills import copy_drill_text
from rstar_jax.tokenizers import load_tokenizer


def _copies(text: str) -> list[tuple[str, str]]:
    tokenizer = load_tokenizer("tiny")
    ids, kinds = copied_positions(tokenizer, text)
    assert tokenizer.decode(ids) == text
    return [(tokenizer.decode([token]), kind) for token, kind in zip(ids, kinds) if kind is not None]


def test_each_copy_an_assistant_turn_makes_is_named_by_where_it_comes_from():
    # Drill 3 of seed 0: a question and its call, then two questions each with a failed call and its fix.
    text = copy_drill_text(3, seed=0, snippets=3, retries=0.4)
    copies = _copies(text)
    first = [piece for piece, kind in copies if kind == "first_call"]
    retry = [piece for piece, kind in copies if kind == "retry"]
    # Every number of a first program repeats its question's (8692, 18687 and 9869; 86 and 18; 7969 and 661), and
    # each fix repeats them again after the error.
    assert first == ["869", "2", "186", "87", "986", "9", "86", "18", "796", "9", "661"]
    assert retry == ["86", "18", "796", "9", "661"]
    assert {kind for _, kind in copies} == {"first_call", "retry"}


def test_outputs_boxed_into_the_answer_are_answer_copies_and_user_turns_are_not_counted():
    text = ("<|im_start|>user\n<tool_response>\nsucceeded, exit code 0\nstdout:\n8712\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<reason>The program printed 8712.</reason>\n<answer>\\boxed{8712}</answer>"
            "<|im_end|>\n<|im_start|>user\n<tool_response>\nsucceeded, exit code 0\nstdout:\n8712\n</tool_response>"
            "<|im_end|>\n")
    assert _copies(text) == [("871", "answer"), ("2", "answer")] * 2


def test_each_copied_target_carries_its_digit_count_aligned_with_the_batch_targets():
    """The by-digits split (3-digit chunks are the copies the demo model misses) reads the same targets as the kinds."""
    tokenizer = load_tokenizer("tiny")
    text = ("<|im_start|>user\n<tool_response>\nsucceeded, exit code 0\nstdout:\n8712\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<reason>The program printed 8712.</reason><|im_end|>\n")
    batch, kinds, digits = held_out_copies(tokenizer, [text])
    copied = kinds[0] != None  # noqa: E711 (elementwise)
    assert [tokenizer.decode([token]) for token in batch.targets[0][copied]] == ["871", "2"]
    assert digits[0][copied].tolist() == [3, 1] and list(kinds[0][copied]) == ["answer", "answer"]
    # Not copies: "exit code 0" and the stdout's 8712.
    assert sorted(count for count in digits[0][~copied].tolist() if count) == [1, 1, 3]
