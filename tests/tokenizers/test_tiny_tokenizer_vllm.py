"""vLLM loads the tiny tokenizer folder and tokenises and renders chats exactly as transformers does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rstar_jax.agent import TOOL_SCHEMA, prompt_messages
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.tokenizers.loading import TINY_TOKENIZER_DIR

pytestmark = pytest.mark.slow

TEXT = (
    "<|im_start|>user\nCompute 48213 * 90734.<tool_call>\n{}\n</tool_call>"
    "<tool_response>\n</tool_response><|im_end|>"
)

# Run in a child process so vLLM's import-time set-up (logging, environment) stays out of the test session.
_VLLM_SCRIPT = """
import json, sys
from vllm.tokenizers import get_tokenizer
request = json.loads(sys.stdin.read())
tokenizer = get_tokenizer(request["path"])
ids = tokenizer.encode(request["text"], add_special_tokens=False)
prompt = tokenizer.apply_chat_template(request["messages"], tools=request["tools"], tokenize=False,
                                       add_generation_prompt=True)
print(json.dumps({"ids": ids, "decoded": tokenizer.decode(ids), "prompt": prompt, "vocab": len(tokenizer)}))
"""


def test_vllm_tokenises_and_renders_like_transformers() -> None:
    messages = prompt_messages("Compute 12 * 34.")
    request = {"path": str(TINY_TOKENIZER_DIR), "text": TEXT, "messages": messages, "tools": [TOOL_SCHEMA]}
    run = subprocess.run(
        [sys.executable, "-c", _VLLM_SCRIPT], input=json.dumps(request), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    tokenizer = load_tokenizer("tiny")
    assert result["ids"] == tokenizer.encode(TEXT, add_special_tokens=False)
    assert result["decoded"] == TEXT
    assert result["prompt"] == tokenizer.apply_chat_template(
        messages, tools=[TOOL_SCHEMA], tokenize=False, add_generation_prompt=True
    )
    assert result["vocab"] == len(tokenizer) <= 2048
