"""Prompt ids come from the chat template once, with the tool schema, and end in an open assistant turn."""

from __future__ import annotations

import json

import gin
import pytest

from rstar_jax.agent import TOOL_NAME, TOOL_SCHEMA, prompt_messages, prompt_text, prompt_token_ids
from rstar_jax.tokenizers import load_tokenizer


@pytest.mark.parametrize("name", ["tiny", "qwen2.5"])
def test_prompt_ids_encode_the_rendered_prompt(name: str) -> None:
    tokenizer = load_tokenizer(name)
    ids = prompt_token_ids(tokenizer, "What is 2^100 mod 7?")
    text = prompt_text(tokenizer, "What is 2^100 mod 7?")
    assert tokenizer.decode(ids) == text
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert text.endswith("What is 2^100 mod 7?<|im_end|>\n<|im_start|>assistant\n")
    assert json.dumps(TOOL_SCHEMA, ensure_ascii=False) in text
    assert TOOL_SCHEMA["function"]["name"] == TOOL_NAME == "execute_python_code_with_standard_io"
    assert TOOL_SCHEMA["function"]["parameters"]["required"] == ["code", "input"]


def test_system_prompt_and_user_prefix_are_gin_knobs() -> None:
    with gin.unlock_config():
        gin.parse_config(['prompt_messages.system_prompt = "Be brief."', 'prompt_messages.user_prefix = "Q: "'])
    try:
        assert prompt_messages("1+1?") == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Q: 1+1?"},
        ]
    finally:
        gin.clear_config()


@pytest.mark.parametrize("question", ["", "   ", None])
def test_empty_question_is_rejected(question) -> None:
    with pytest.raises(ValueError, match="non-empty question"):
        prompt_messages(question)
