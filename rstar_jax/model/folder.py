"""A complete Hugging Face model folder from the learner's parameters: what transformers, vLLM and `load_hf` read.

Weights and config (`save_hf`), the tokenizer's files copied beside them, and generation_config.json with the
model's special ids. Every place that hands a model to another program (the seeded demo model, a trained SFT or RL
model, the folder vLLM servers start from) writes it through here, so those folders never differ in shape.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import jax
from rstar_jax.model.config import ModelConfig, model_precision
from rstar_jax.model.causal_lm import CausalLM
from rstar_jax.model.hf_io import save_hf
from rstar_jax.model.lm import Params, init_params
from rstar_jax.tokenizers import resolve_tokenizer_path

# What a tokenizer consists of. A tokenizer is often named by a model folder (the one training started from), whose
# weights and config must not be copied over the ones just written.
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                   "chat_template*")


def save_model_folder(config: ModelConfig, params: Params, out: str | Path, tokenizer: str) -> Path:
    """Write `params` as an HF folder at `out` with `tokenizer`'s files (a name such as "tiny", or a folder)."""
    out = Path(out)
    save_hf((config, jax.device_get(params)), out)
    for source in sorted(resolve_tokenizer_path(tokenizer).iterdir()):
        if source.is_file() and any(fnmatch.fnmatch(source.name, pattern) for pattern in TOKENIZER_FILES):
            shutil.copyfile(source, out / source.name)
    generation = {"eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id,
                  "bos_token_id": config.bos_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def seeded_model(out: str | Path, seed: int = 0, tokenizer: str = "tiny") -> CausalLM:
    """The gin-configured `ModelConfig` (dtypes by `model_precision`, as every model is built) initialised from
    `seed`, written to `out` with `tokenizer`; returns it."""
    config = ModelConfig(**model_precision())
    model = CausalLM(config, init_params(config, jax.random.key(seed)))
    save_model_folder(config, model.params, out, tokenizer)
    return model
