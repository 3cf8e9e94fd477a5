"""Copy drills (rstar_jax.data.copy_drills): seeded, in the transcripts' chat layout, and consistent piece by piece."""

import re

import pytest

from rstar_jax.agent.tool_call import ToolCall, parse_tool_calls
from rstar_jax.data.copy_drills import assistant_mask, copy_drill_ids, copy_drill_text, filled_drill_ids
from rstar_jax.data.synthetic_sft import INTROS
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.tokenizers.special_tokens import IM_END, IM_START

TURN = re.compile(re.escape(IM_START) + r"(user|assistant)\n(.*?)" + re.escape(IM_END) + "\n", re.DOTALL)
LISTED = re.compile(r"\d+(?:(?: |, | \* )\d+)+")  # a repeat piece's user turn: numbers and separators only


def turns(text: str) -> list[tuple[str, str]]:
    """The (role, content) turns of a drill; asserts that nothing lies outside them."""
    found = TURN.findall(text)
    assert "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in found) == text
    return found


def test_a_drill_is_a_pure_function_of_index_and_seed():
    assert copy_drill_text(5, seed=1, snippets=3) == copy_drill_text(5, seed=1, snippets=3)
    assert copy_drill_text(5, seed=1, snippets=3) != copy_drill_text(6, seed=1, snippets=3)
    assert copy_drill_text(5, seed=1, snippets=3) != copy_drill_text(5, seed=2, snippets=3)


def test_every_piece_pairs_a_user_turn_with_the_assistant_turn_that_copies_from_it():
    pieces = {"program": 0, "answer": 0}
    for index in range(40):
        found = turns(copy_drill_text(index, seed=0, snippets=3))
        assert len(found) == 6 and [role for role, _ in found] == ["user", "assistant"] * 3
        for (_, user), (_, assistant) in zip(found[::2], found[1::2]):
            if user.startswith("<tool_response>"):
                printed = re.search(r"\n(\d+)\n", user).group(1)
                assert assistant == (f"<reason>The program printed {printed}.</reason>\n"
                                     f"<answer>\\boxed{{{printed}}}</answer>")
                pieces["answer"] += 1
            else:
                reason, _, call_text = assistant.partition("</reason>\n")
                assert reason.removeprefix("<reason>") in INTROS
                (call,) = parse_tool_calls(call_text)
                assert isinstance(call, ToolCall)
                # The program computes from the question's own numbers: the copy the drill teaches.
                question_numbers = set(re.findall(r"\d+", user))
                assert set(re.findall(r"\d+", call.code)) & question_numbers
                pieces["program"] += 1
    assert min(pieces.values()) > 40  # both kinds of piece, about half each of 120


def test_drill_ids_are_the_texts_tokens_and_snippets_are_checked():
    tokenizer = load_tokenizer("tiny")
    ids = copy_drill_ids(3, tokenizer, seed=0, snippets=2)
    assert tokenizer.decode(ids) == copy_drill_text(3, seed=0, snippets=2)
    with pytest.raises(ValueError, match="at least one snippet"):
        copy_drill_text(0, snippets=0)


def test_a_filled_drill_is_its_pieces_cut_to_exactly_length_plus_one_tokens():
    tokenizer = load_tokenizer("tiny")
    for index in range(6):
        ids = filled_drill_ids(index, tokenizer, 300, seed=1)
        assert len(ids) == 301  # 300 next-token predictions: a row with no padding
        # The same pieces as the snippet drill, in the same order; only the last one is cut.
        assert ids == copy_drill_ids(index, tokenizer, seed=1, snippets=12)[:301]
    with pytest.raises(ValueError, match="positive length"):
        filled_drill_ids(0, tokenizer, 0)


def test_a_retry_copies_the_questions_numbers_into_the_fixed_call_after_the_real_error():
    retries = 0
    for index in range(30):
        found = turns(copy_drill_text(index, seed=0, snippets=3, retries=0.5))
        for position, (role, text) in enumerate(found):
            if role != "user" or not text.startswith("<tool_response>\nfailed"):
                continue
            (_, question), (_, first), (_, fixed) = found[position - 2], found[position - 1], found[position + 1]
            (faulty_call,) = parse_tool_calls(first.partition("</reason>\n")[2])
            (fixed_call,) = parse_tool_calls(fixed.partition("</reason>\n")[2])
            # The faulty program is the fixed one with its last line broken; the fix copies the question's numbers.
            assert faulty_call.code.splitlines()[:-1] == fixed_call.code.splitlines()[:-1]
            assert fixed_call.code.endswith("print(result)") and not faulty_call.code.endswith("print(result)")
            assert set(re.findall(r"\d+", fixed_call.code)) & set(re.findall(r"\d+", question))
            assert re.match(r"<reason>The program failed with a (SyntaxError|NameError)\. I fix the code", fixed)
            assert re.search(r"(SyntaxError|NameError)", text)
            retries += 1
    assert 30 <= retries <= 60  # about half of 90 pieces
    # The default drills hold no retry.
    assert "failed" not in copy_drill_text(0, seed=0, snippets=12)
    with pytest.raises(ValueError, match="retry and repeat pieces"):
        copy_drill_text(0, retries=1.0)


def test_repeat_pieces_list_numbers_that_the_assistant_turn_copies_in_order():
    repeats = others = 0
    for index in range(30):
        found = turns(copy_drill_text(index, seed=0, snippets=3, repeats=0.5))
        for (_, user), (_, assistant) in zip(found[::2], found[1::2]):
            numbers = LISTED.fullmatch(user)
            if numbers is None:
                others += 1
                continue
            repeats += 1
            assert assistant == user and 4 <= len(re.findall(r"\d+", user)) <= 10
            assert all(len(number) <= 3 for number in re.findall(r"\d+", user))
    assert 30 <= repeats <= 60 and repeats + others == 90  # about half of 90 pieces
    assert copy_drill_text(7, seed=0, snippets=3) == copy_drill_text(7, seed=0, snippets=3, repeats=0.0)
    with pytest.raises(ValueError, match="sum below 1"):
        copy_drill_text(0, retries=0.5, repeats=0.5)


def test_a_share_of_listed_numbers_has_4_to_6_digits_and_two_tokens():
    tokenizer = load_tokenizer("tiny")
    listed = []
    for index in range(40):
        found = turns(copy_drill_text(index, seed=0, snippets=3, repeats=0.9, long_numbers=0.3))
        listed += [number for _, user in found[::2] if LISTED.fullmatch(user) for number in re.findall(r"\d+", user)]
    long = [number for number in listed if len(number) >= 4]
    assert all(len(number) <= 6 and int(number) >= 1000 for number in long)
    assert all(len(tokenizer.encode(number, add_special_tokens=False)) == 2 for number in long)
    assert 0.22 <= len(long) / len(listed) <= 0.38 and len(listed) > 500  # 30%
    with pytest.raises(ValueError, match="long listed numbers"):
        copy_drill_text(0, repeats=0.5, long_numbers=1.5)


def test_the_assistant_mask_trains_exactly_the_assistant_turns_of_a_row():
    tokenizer = load_tokenizer("tiny")
    for index in range(6):
        text = copy_drill_text(index, seed=0, snippets=3, repeats=0.3)
        ids = copy_drill_ids(index, tokenizer, seed=0, snippets=3, repeats=0.3)
        mask = assistant_mask(ids, tokenizer)
        assert len(mask) == len(ids)
        trained = tokenizer.decode([token for token, kept in zip(ids, mask) if kept])
        assert trained == "".join(content + IM_END for role, content in turns(text) if role == "assistant")
    # A filled row cut inside an assistant turn keeps training that turn's tokens up to the cut.
    ids = filled_drill_ids(3, tokenizer, 192, seed=0, repeats=0.15)
    mask = assistant_mask(ids, tokenizer)
    last_header = max(i for i, token in enumerate(ids) if token == tokenizer.convert_tokens_to_ids(IM_START))
    assert 0 < sum(mask) < len(ids) and mask[-1] == int(tokenizer.decode(ids[last_header:]).startswith(
        f"{IM_START}assistant\n"))
