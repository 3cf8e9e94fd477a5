"""SFT examples for the tiny model: synthetic tool-task transcripts with real sandbox outputs, cached on disk.

SPEC section 5 starts RL from a model that already writes the agent format; on the CPU demo that format is taught
with the synthetic transcripts of `rstar_jax.data.synthetic_sft`, run against a real sandbox server started here.
The token ids are written to a JSON-lines file together with what produced them (task count, seed, the rendered
prompt), so a rerun or a resumed run trains on exactly the same ids without starting a sandbox again.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import gin
from transformers import PreTrainedTokenizerBase

from rstar_jax.agent.prompt import prompt_token_ids
from rstar_jax.agent.tool_protocol import FixedOutcome
from rstar_jax.agent.tool_response import format_tool_response
from rstar_jax.data.synthetic import synthetic_tasks
from rstar_jax.data.synthetic_sft import SftTranscript, final_turn_text, sft_transcripts
from rstar_jax.files import atomic_path
from rstar_jax.processes import running_sandbox
from sandbox_server.client import SandboxClient


_PROBE_OUTCOME = FixedOutcome("ok", "42\n", "", 0, 12.0)


@dataclass(frozen=True)
class TrainingSequence:
    """Token ids and the 0/1 loss mask of one training example (what `make_batch` reads)."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]


@gin.configurable
def sandbox_transcripts(count: int, seed: int, tokenizer: PreTrainedTokenizerBase, faulty_fraction: float,
                        fault_kinds: Sequence[str], server_args: Sequence[str] = ("--workers", "2")
                        ) -> list[SftTranscript]:
    """`count` synthetic-task transcripts (tasks and plans drawn from `seed`, `faulty_fraction` of them starting
    with a faulty call of one of `fault_kinds`) with the outputs of a real sandbox server, started for the duration
    of the call with `server_args` (e.g. its worker count)."""

    async def generate(url: str) -> list[SftTranscript]:
        async with SandboxClient([url]) as client:
            return await sft_transcripts(synthetic_tasks(count, seed=seed, split="train"), client, tokenizer,
                                         seed=seed, faulty_fraction=faulty_fraction, fault_kinds=fault_kinds)

    with running_sandbox(tuple(server_args)) as server:
        return asyncio.run(generate(server.url))


def configured_faults() -> tuple[float, tuple[str, ...]]:
    """The share of transcripts that start with a faulty call and the kinds of fault: `sft_transcripts`'
    `faulty_fraction` and `fault_kinds` as gin binds them, else that function's defaults."""
    parameters, bindings = inspect.signature(sft_transcripts).parameters, gin.get_bindings(sft_transcripts)
    fraction, kinds = (bindings.get(name, parameters[name].default) for name in ("faulty_fraction", "fault_kinds"))
    return fraction, tuple(kinds)


def cache_key(count: int, seed: int, tokenizer: PreTrainedTokenizerBase, faulty_fraction: float,
              fault_kinds: Sequence[str]) -> dict[str, Any]:
    """What decides a transcript set's ids: count, seed, the training split, the share and kinds of faulty first
    calls, the prompt rendering (system prompt, tokenizer), the tool-response layout and the final turn's wording."""
    probe = (prompt_token_ids(tokenizer, "What is 1 + 1?") + tokenizer.encode(format_tool_response(_PROBE_OUTCOME))
             + tokenizer.encode(final_turn_text("2")))
    return {"count": count, "seed": seed, "split": "train", "faulty_fraction": faulty_fraction,
            "fault_kinds": sorted(fault_kinds),
            "prompt_sha256": hashlib.sha256(json.dumps(probe).encode()).hexdigest()}


def write_sequences(path: Path, key: dict[str, Any], sequences: Sequence[TrainingSequence]) -> None:
    """A JSON-lines file: the key on the first line, then one {"token_ids", "loss_mask"} object per example."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as temporary, temporary.open("w") as handle:
        handle.write(json.dumps({"key": key}) + "\n")
        for sequence in sequences:
            handle.write(json.dumps({"token_ids": sequence.token_ids, "loss_mask": sequence.loss_mask}) + "\n")


def read_sequences(path: Path, key: dict[str, Any]) -> list[TrainingSequence] | None:
    """The cached examples at `path` if the file exists and was written for `key`; otherwise None."""
    if not path.is_file():
        return None
    with path.open() as handle:
        header = json.loads(handle.readline())
        if header.get("key") != key:
            return None
        rows = [json.loads(line) for line in handle]
    return [TrainingSequence(tuple(row["token_ids"]), tuple(row["loss_mask"])) for row in rows]


def cached_sft_sequences(path: Path, count: int, seed: int,
                         tokenizer: PreTrainedTokenizerBase) -> list[TrainingSequence]:
    """The training examples of `count` transcripts of `seed`: read from `path` when cached for the same key,
    else generated against a fresh sandbox server and written there."""
    faulty_fraction, fault_kinds = configured_faults()
    key = cache_key(count, seed, tokenizer, faulty_fraction, fault_kinds)
    cached = read_sequences(path, key)
    if cached is not None:
        return cached
    sequences = [TrainingSequence(t.trajectory.token_ids, t.trajectory.loss_mask)
                 for t in sandbox_transcripts(count, seed, tokenizer, faulty_fraction, fault_kinds)]
    write_sequences(path, key, sequences)
    return sequences
