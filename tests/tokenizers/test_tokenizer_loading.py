"""Both tokenizers load offline, hold every chat/tool token as one id and round-trip the agent's text."""

from __future__ import annotations

import os

import pytest
from transformers import AutoTokenizer

from rstar_jax.paths import shared_data_dir
from rstar_jax.tokenizers import CHAT_TOOL_TOKENS, load_tokenizer, resolve_tokenizer_path
from rstar_jax.tokenizers.loading import TINY_TOKENIZER_DIR

NAMES = ("tiny", "qwen2.5")

REPRESENTATIVE_TEXTS = (
    "Compute 48213 * 90734.",
    "What is the remainder when 537^812 is divided by 991?",
    'import math\nresult = str(math.factorial(83)).count(\'7\')\nprint(result)\n\tif x  >= 3:\n        pass',
    "<reason>The program printed 4374493942.</reason>\n<answer>\\boxed{4374493942}</answer>",
    "Traceback (most recent call last):\n  File \"<string>\", line 1\nNameError: name 'reslt' is not defined",
    "Unicode: café, ∑_{k=1}^{n} k², 数学, emoji 🙂, tabs\tand  double  spaces  ",
    "<|im_start|>user\n<tool_response>\nsucceeded, 3 ms\nstdout:\n42\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n",
)


@pytest.mark.parametrize("name", NAMES)
def test_each_chat_and_tool_token_is_exactly_one_id(name: str) -> None:
    tokenizer = load_tokenizer(name)
    ids = [tokenizer.encode(token, add_special_tokens=False) for token in CHAT_TOOL_TOKENS]
    assert all(len(token_ids) == 1 for token_ids in ids), dict(zip(CHAT_TOOL_TOKENS, ids))
    assert len({token_ids[0] for token_ids in ids}) == len(CHAT_TOOL_TOKENS)
    for token, token_ids in zip(CHAT_TOOL_TOKENS, ids):
        assert tokenizer.decode(token_ids) == token


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("text", REPRESENTATIVE_TEXTS)
def test_encode_decode_round_trip(name: str, text: str) -> None:
    tokenizer = load_tokenizer(name)
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_qwen_digits_are_single_tokens() -> None:
    tokenizer = load_tokenizer("qwen2.5")
    ids = tokenizer.encode("1234567890", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == list("1234567890")


def test_tiny_numbers_are_chunks_of_up_to_three_digits_each_one_token() -> None:
    tokenizer = load_tokenizer("tiny")
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("1234567890 15007 x=042", add_special_tokens=False)]
    assert pieces == ["123", "456", "789", "0", " ", "150", "07", " ", "x", "=", "042"]
    chunks = [f"{value:0{width}d}" for width in (1, 2, 3) for value in range(10**width)]
    assert all(len(tokenizer.encode(chunk, add_special_tokens=False)) == 1 for chunk in chunks)


def test_qwen_tokenizer_ids_match_qwen_and_tool_response_takes_qwen3_ids() -> None:
    tokenizer = load_tokenizer("qwen2.5")
    vocab = tokenizer.get_vocab()
    assert (vocab["<|endoftext|>"], vocab["<|im_start|>"], vocab["<|im_end|>"]) == (151643, 151644, 151645)
    assert (vocab["<tool_call>"], vocab["</tool_call>"]) == (151657, 151658)
    # Absent from Qwen2.5; added at the ids Qwen3 gives them, inside the 151,936-row embedding table.
    assert (vocab["<tool_response>"], vocab["</tool_response>"]) == (151665, 151666)
    assert len(tokenizer) == 151667
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    # Plain text keeps Qwen2.5's own ids (from its BPE files, e.g. "Hello" = 9707).
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [9707, 1879]


def test_tiny_tokenizer_is_small_and_loads_with_auto_tokenizer_offline() -> None:
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR, local_files_only=True)
    assert tokenizer.is_fast
    assert len(tokenizer) <= 2048
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.chat_template is not None and "tool_call" in tokenizer.chat_template
    assert sorted(os.listdir(TINY_TOKENIZER_DIR)) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_loads_are_cached_per_path() -> None:
    assert load_tokenizer("tiny") is load_tokenizer(TINY_TOKENIZER_DIR)
    assert load_tokenizer("qwen2.5") is load_tokenizer(shared_data_dir() / "tokenizers" / "qwen2.5")


def test_shared_data_dir_follows_the_environment_override(tmp_path, monkeypatch) -> None:
    (tmp_path / "tokenizers").mkdir()
    (tmp_path / "tokenizers" / "qwen2.5").symlink_to(shared_data_dir() / "tokenizers" / "qwen2.5")
    monkeypatch.setenv("RSTAR_DATA_DIR", str(tmp_path))
    assert shared_data_dir() == tmp_path
    assert resolve_tokenizer_path("qwen2.5") == (tmp_path / "tokenizers" / "qwen2.5").resolve()


def test_unknown_tokenizer_names_the_missing_folder(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-tokenizer"):
        load_tokenizer(tmp_path / "no-such-tokenizer")
