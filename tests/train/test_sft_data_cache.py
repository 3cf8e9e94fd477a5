"""The SFT transcript cache is reused only for the settings that made it: a changed share or kind of faulty first
calls (or count, or seed, or the last turn's wording) regenerates the transcripts instead of training on the old
ones."""

from __future__ import annotations

import gin

from rstar_jax.data.synthetic_sft import final_turn_text
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.train.sft_data import (TrainingSequence, cache_key, cached_sft_sequences, configured_faults,
                                      read_sequences, write_sequences)


def test_the_cache_is_read_back_only_under_the_key_that_wrote_it(tmp_path) -> None:
    tokenizer = load_tokenizer("tiny")
    sequences = [TrainingSequence((5, 6, 7), (0, 1, 1)), TrainingSequence((8,), (1,))]
    path = tmp_path / "transcripts.jsonl"
    gin.clear_config()
    try:
        assert configured_faults() == (0.25, ("name", "syntax"))  # the function's defaults
        key = cache_key(16, 3, tokenizer, 0.25, ("name", "syntax"))
        write_sequences(path, key, sequences)
        assert read_sequences(path, cache_key(16, 3, tokenizer, 0.25, ("syntax", "name"))) == sequences
        assert read_sequences(path, cache_key(16, 4, tokenizer, 0.25, ("name", "syntax"))) is None
        assert read_sequences(path, cache_key(32, 3, tokenizer, 0.25, ("name", "syntax"))) is None
        assert read_sequences(path, cache_key(16, 3, tokenizer, 0.5, ("name", "syntax"))) is None
        assert read_sequences(path, cache_key(16, 3, tokenizer, 0.25, ("trailing",))) is None
        gin.parse_config(["sft_transcripts.faulty_fraction = 0.5", "sft_transcripts.fault_kinds = ['trailing']"])
        assert configured_faults() == (0.5, ("trailing",))
        # Written under the bound settings, the cache is what `cached_sft_sequences` returns (no sandbox is started).
        write_sequences(path, cache_key(16, 3, tokenizer, 0.5, ("trailing",)), sequences[:1])
        assert cached_sft_sequences(path, 16, 3, tokenizer) == sequences[:1]
        # The last turn's wording is part of the key: transcripts that restate the output are not read back when
        # the binding says not to restate it.
        restated = cache_key(16, 3, tokenizer, 0.5, ("trailing",))
        gin.parse_config(["final_turn_text.restated = False"])
        assert final_turn_text("42") == "<reason>The program printed the answer.</reason>\n<answer>\\boxed{42}</answer>"
        assert cache_key(16, 3, tokenizer, 0.5, ("trailing",)) != restated
        assert read_sequences(path, cache_key(16, 3, tokenizer, 0.5, ("trailing",))) is None
    finally:
        gin.clear_config()
    assert read_sequences(tmp_path / "absent.jsonl", key) is None
