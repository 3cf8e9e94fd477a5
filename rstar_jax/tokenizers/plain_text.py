"""Token ids for untrusted text (a program's output) in which no control token can appear.

A tokenizer matches its added tokens (`<|im_end|>`, `<tool_call>`, ...) anywhere in the text it encodes, special or
not, so a program that prints `<tool_call>` would hand the model the real tool-call token as context. Here each
added token's text is encoded in two pieces (its first character, then the rest), which no added token matches;
the ids still decode to exactly the text (SPEC section 2: the tool response is the program's output, verbatim).
"""

from __future__ import annotations

import functools
import re

from transformers import PreTrainedTokenizerBase


@functools.lru_cache(maxsize=16)
def _added_token_pattern(tokenizer: PreTrainedTokenizerBase) -> re.Pattern[str] | None:
    """One alternation of every added token's text, longest first, captured so `split` keeps them."""
    texts = sorted((text for text in tokenizer.get_added_vocab() if len(text) > 1), key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None


def plain_text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Ids that decode to `text` and contain no added-token id that the text spelled out."""
    pattern = _added_token_pattern(tokenizer)
    pieces = [text] if pattern is None else pattern.split(text)
    ids: list[int] = []
    for index, piece in enumerate(pieces):
        parts = (piece[:1], piece[1:]) if index % 2 else (piece,)  # odd pieces are added tokens' texts
        for part in parts:
            if part:
                ids += tokenizer.encode(part, add_special_tokens=False)
    return ids
