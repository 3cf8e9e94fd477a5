"""Build the tiny byte-level BPE tokenizer of the CPU demo models (issue 2 item 6) into a HF tokenizer folder.

It is trained on synthetic text shaped like the demo's own traffic: the agent prompt with the tool schema, synthetic
tool-task questions and their SFT transcripts, and tool responses. Numbers are cut into chunks of one to three
digits from the left, each chunk one token (as GPT-4's and Llama 3's tokenizers do; Qwen keeps single digits), and
every chunk "0" ... "999" (leading zeros included) is in the vocabulary. Why: a tool-using solver copies numbers
from the question into its program and from the output into its answer; with one token per digit the tiny model
never learned to (its copy accuracy stayed at chance over 350 warm-up steps, where with chunks it reached 100% after
about 300; BENCHMARKS.md), because a digit recurs everywhere and cannot say which earlier position to copy from.
The chat and tool tokens of SPEC section 2 are single ids, and the whole vocabulary holds at most 2,048 entries. The
same arguments always give byte-identical files; the committed copy lives in rstar_jax/tokenizers/tiny/.

    python scripts/build_tiny_tokenizer.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers.utils.chat_template_utils import render_jinja_template

from rstar_jax.agent.prompt import TOOL_SCHEMA
from rstar_jax.data.synthetic import synthetic_tasks
from rstar_jax.data.synthetic_sft import SolutionPlan, plan_solutions, transcript_messages
from rstar_jax.tokenizers.loading import TINY_TOKENIZER_DIR
from rstar_jax.tokenizers.special_tokens import (
    CHAT_TOOL_TOKENS,
    CONTROL_TOKENS,
    END_OF_TEXT,
    IM_END,
    IM_START,
    TOOL_TOKENS,
)
from sandbox_server.api import ToolResult

VOCAB_SIZE = 2048
NUMBER_CHUNK_REPEATS = 40  # each 1-3 digit chunk this often in the corpus, so every one becomes a token
CORPUS_TASKS = 600
CORPUS_SEED = 1234
CHAT_TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "rstar_jax" / "tokenizers" / "chatml_tools.jinja"

# Pre-tokenisation: numbers in chunks of up to three digits, words with an optional leading space, runs of
# punctuation, whitespace.
_PRE_TOKEN_PATTERN = r"\p{{N}}{{1,{digits}}}| ?\p{{L}}+| ?[^\s\p{{L}}\p{{N}}]+|\s+(?!\S)|\s+"
DIGITS_PER_TOKEN = 3
_ADDED_TOKEN_SPLIT = re.compile("|".join(re.escape(token) for token in CHAT_TOOL_TOKENS))
# Error output of the faulty SFT programs as the sandbox reports it, so error responses tokenise compactly too.
_ERROR_OUTPUT = {
    "name": 'Traceback (most recent call last):\n  File "<code>", line 2, in <module>\n'
    "NameError: name 'answer' is not defined\n",
    "syntax": '  File "<code>", line 2\nSyntaxError: \'(\' was never closed\n',
}



def _outcomes(plan: SolutionPlan) -> list[_RepresentativeOutcome]:
    answer = ToolResult("ok", plan.task.problem.answer + "\n", "", 0, 20.0)
    if plan.faulty_code is None:
        return [answer]
    error = ToolResult("error", "", _ERROR_OUTPUT[plan.fault], 1, 20.0)
    return [error, answer]


def corpus(num_tasks: int = CORPUS_TASKS, seed: int = CORPUS_SEED,
           digits_per_token: int = DIGITS_PER_TOKEN) -> Iterator[str]:
    """The training text: whole SFT transcripts rendered by the tiny chat template, at difficulties 1 to 3.

    The text is cut at the chat/tool tokens, which always encode as single ids and so must not shape the merges.
    """
    template = CHAT_TEMPLATE_PATH.read_text()
    for difficulty in (1, 2, 3):
        tasks = synthetic_tasks(num_tasks // 3, seed=seed, difficulty=difficulty)
        for plan in plan_solutions(tasks, seed=seed, faulty_fraction=0.25):
            messages = transcript_messages(plan, _outcomes(plan))
            rendered, _ = render_jinja_template([messages], tools=[TOOL_SCHEMA], chat_template=template)
            yield from _ADDED_TOKEN_SPLIT.split(rendered[0])
    yield from number_chunks(digits_per_token)


def number_chunks(digits_per_token: int) -> Iterator[str]:
    """Every chunk of 1 to `digits_per_token` digits ("0" ... "999" for 3, with leading zeros, as chunks inside
    longer numbers have them), each repeated so that BPE merges it into one token."""
    for width in range(1, digits_per_token + 1):
        for value in range(10**width):
            yield " ".join([f"{value:0{width}d}"] * NUMBER_CHUNK_REPEATS)


def train_tokenizer(vocab_size: int = VOCAB_SIZE, digits_per_token: int = DIGITS_PER_TOKEN) -> Tokenizer:
    """Train the byte-level BPE; the chat control tokens are special, the tool tags plain added tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRE_TOKEN_PATTERN.format(digits=digits_per_token)), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(digits_per_token=digits_per_token), trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False) for token in TOOL_TOKENS])
    if tokenizer.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tiny tokenizer has {tokenizer.get_vocab_size()} entries, more than {vocab_size}")
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json: eos/pad as in Qwen2.5, the ChatML tool template, no text clean-up."""
    return {
        "add_bos_token": False,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE_PATH.read_text(),
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "model_max_length": 32768,
        "pad_token": END_OF_TEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def special_tokens_map() -> dict[str, object]:
    """special_tokens_map.json, for loaders that read special tokens from it."""
    return {"additional_special_tokens": [IM_START, IM_END], "eos_token": IM_END, "pad_token": END_OF_TEXT}


def _write_json(path: Path, content: dict[str, object]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


def build(out_dir: Path, digits_per_token: int = DIGITS_PER_TOKEN) -> Path:
    """Train and write the complete HF tokenizer folder (tokenizer.json, config with chat template, specials);
    `digits_per_token` 1 gives the Qwen-like variant the copy benchmark compares against."""
    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(digits_per_token=digits_per_token).save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config())
    _write_json(out_dir / "special_tokens_map.json", special_tokens_map())
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TINY_TOKENIZER_DIR, help="folder to write the tokenizer to")
    print(build(parser.parse_args().out))


if __name__ == "__main__":
    main()
