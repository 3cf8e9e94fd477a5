"""The committed tiny tokenizer is what the build script makes, and its chat template lays chats out like Qwen2.5's."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from rstar_jax.agent.prompt import TOOL_SCHEMA
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.tokenizers.loading import TINY_TOKENIZER_DIR

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_tiny_tokenizer.py"
_SPEC = importlib.util.spec_from_file_location("build_tiny_tokenizer", _SCRIPT)
build_tiny_tokenizer = sys.modules[_SPEC.name] = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(build_tiny_tokenizer)

TOOL_CHAT = [
    {"role": "system", "content": "Solve it."},
    {"role": "user", "content": "Compute 12 * 34."},
    {
        "role": "assistant",
        "content": "<reason>Python.</reason>",
        "tool_calls": [
            {
                "type": "function",
                "function": {
                    "name": "execute_python_code_with_standard_io",
                    "arguments": {"code": "print(12 * 34)", "input": ""},
                },
            }
        ],
    },
    {"role": "tool", "content": "succeeded\nstdout:\n408"},
    {"role": "tool", "content": "second response"},
    {"role": "assistant", "content": "<answer>\\boxed{408}</answer>"},
    {"role": "user", "content": "Thanks."},
]


@pytest.mark.slow
def test_rebuild_is_byte_identical_to_the_committed_folder(tmp_path: Path) -> None:
    build_tiny_tokenizer.build(tmp_path)
    committed = sorted(p.name for p in TINY_TOKENIZER_DIR.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == committed
    for name in committed:
        assert (tmp_path / name).read_bytes() == (TINY_TOKENIZER_DIR / name).read_bytes(), name


def test_vocabulary_fits_in_2048_with_control_tokens_special_and_tool_tokens_plain() -> None:
    tokenizer_json = json.loads((TINY_TOKENIZER_DIR / "tokenizer.json").read_text())
    added = {token["content"]: token["special"] for token in tokenizer_json["added_tokens"]}
    assert added == {
        "<|endoftext|>": True,
        "<|im_start|>": True,
        "<|im_end|>": True,
        "<tool_call>": False,
        "</tool_call>": False,
        "<tool_response>": False,
        "</tool_response>": False,
    }
    assert len(load_tokenizer("tiny")) <= 2048


def _after_system_turn(text: str) -> str:
    return text.split("<|im_end|>\n", 1)[1]


def test_tiny_template_lays_out_a_tool_chat_like_qwen() -> None:
    tiny, qwen = load_tokenizer("tiny"), load_tokenizer("qwen2.5")
    tiny_text = tiny.apply_chat_template(TOOL_CHAT, tools=[TOOL_SCHEMA], tokenize=False, add_generation_prompt=True)
    qwen_text = qwen.apply_chat_template(TOOL_CHAT, tools=[TOOL_SCHEMA], tokenize=False, add_generation_prompt=True)
    assert _after_system_turn(tiny_text) == _after_system_turn(qwen_text)
    assert _after_system_turn(tiny_text) == (
        "<|im_start|>user\nCompute 12 * 34.<|im_end|>\n"
        "<|im_start|>assistant\n<reason>Python.</reason>\n<tool_call>\n"
        '{"name": "execute_python_code_with_standard_io", "arguments": {"code": "print(12 * 34)", "input": ""}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsucceeded\nstdout:\n408\n</tool_response>\n"
        "<tool_response>\nsecond response\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<answer>\\boxed{408}</answer><|im_end|>\n"
        "<|im_start|>user\nThanks.<|im_end|>\n<|im_start|>assistant\n"
    )
    system_turn = tiny_text.split("<|im_end|>\n", 1)[0]
    assert system_turn.startswith("<|im_start|>system\nSolve it.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOL_SCHEMA, ensure_ascii=False) + "\n</tools>" in system_turn


def test_tiny_template_without_tools_matches_qwen() -> None:
    chat = TOOL_CHAT[:2]
    texts = [
        load_tokenizer(name).apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        for name in ("tiny", "qwen2.5")
    ]
    assert texts[0] == texts[1] == (
        "<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\nCompute 12 * 34.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
