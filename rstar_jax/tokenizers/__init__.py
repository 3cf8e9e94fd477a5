"""Tokenizers: Qwen2.5's (offline, from shared data) and the tiny demo tokenizer, both with the chat/tool tokens."""

from rstar_jax.tokenizers.loading import load_tokenizer, resolve_tokenizer_path
from rstar_jax.tokenizers.special_tokens import CHAT_TOOL_TOKENS

__all__ = ["CHAT_TOOL_TOKENS", "load_tokenizer", "resolve_tokenizer_path"]
