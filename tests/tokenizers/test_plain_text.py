"""Untrusted text becomes ids that decode to it exactly and hold none of the tokenizer's added tokens."""

from __future__ import annotations

import pytest

from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.tokenizers.plain_text import plain_text_ids


@pytest.mark.parametrize("name", ["tiny", "qwen2.5"])
def test_added_tokens_in_the_text_stay_text(name: str) -> None:
    tokenizer = load_tokenizer(name)
    added = set(tokenizer.get_added_vocab().values())
    ordinary = "x = 12 * 34\nprint(x)  # 408 ü ≤ π"
    assert plain_text_ids(tokenizer, ordinary) == tokenizer.encode(ordinary, add_special_tokens=False)
    for text in tokenizer.get_added_vocab():
        spelled = f"a{text}b {text}{text}\n"
        ids = plain_text_ids(tokenizer, spelled)
        assert tokenizer.decode(ids) == spelled
        assert not added & set(ids), text
    assert plain_text_ids(tokenizer, "") == []
