"""Loading the project's tokenizers offline (issue 2 item 6): Qwen2.5's from shared data, and the tiny one.

Both come back as transformers fast tokenizers in which every chat and tool token of SPEC section 2 is one id.
Qwen2.5's vocabulary lacks `<tool_response>` / `</tool_response>` (Qwen3 added them); they are added here as plain
tokens, which gives them ids 151665 and 151666, the ids Qwen3 uses, inside Qwen2.5's padded embedding table (151936
rows). The Qwen2.5 folder ships no tokenizer.json, so loading converts the slow files; loaded tokenizers are cached
per path and shared, so callers must not modify them.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from tokenizers import AddedToken
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rstar_jax.paths import DATA_DIR_ENV, shared_data_dir
from rstar_jax.tokenizers.special_tokens import CONTROL_TOKENS, TOOL_TOKENS

TINY_TOKENIZER_DIR = Path(__file__).resolve().parent / "tiny"


def resolve_tokenizer_path(name_or_path: str | os.PathLike[str]) -> Path:
    """Folder of a named tokenizer ("qwen2.5" in the shared data dir, "tiny") or of a given path."""
    name = os.fspath(name_or_path)
    if name == "qwen2.5":
        path = shared_data_dir() / "tokenizers" / "qwen2.5"
    elif name == "tiny":
        path = TINY_TOKENIZER_DIR
    else:
        path = Path(name)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer {name!r}: folder {path} does not exist (names: 'qwen2.5', 'tiny', or a tokenizer folder; "
            f"set {DATA_DIR_ENV} to relocate the shared data)"
        )
    return path.resolve()


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """A fast tokenizer with every chat/tool token as a single id (SPEC section 2), loaded offline and cached."""
    return _load_cached(str(resolve_tokenizer_path(name_or_path)))


@functools.lru_cache(maxsize=8)
def _load_cached(path: str) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not tokenizer.is_fast:
        raise TypeError(f"tokenizer at {path} loaded as a slow tokenizer; a fast one is required")
    vocab = tokenizer.get_vocab()
    missing_control = [token for token in CONTROL_TOKENS if token not in vocab]
    if missing_control:
        raise ValueError(f"tokenizer at {path} lacks the chat control tokens {missing_control}")
    missing_tool = [token for token in TOOL_TOKENS if token not in vocab]
    if missing_tool:
        tokenizer.add_tokens([AddedToken(token, normalized=False, special=False) for token in missing_tool])
    return tokenizer
