"""Write the CPU demo model's Hugging Face folder from a seeded random init (issue 2, item 7).

    python -m experiments.make_tiny_model --out artifacts/tiny-model [--seed 0] [--gin_param ...]

The folder (config.json, model.safetensors, generation_config.json and the tiny tokenizer's files) loads in
transformers, in vLLM and through `rstar_jax.model.load_hf`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import jax

from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import CausalLM
from rstar_jax.model.folder import seeded_model

TINY_MODEL_GIN = "model/tiny.gin"


def make_tiny_model(out: str | Path, seed: int = 0, tokenizer: str = "tiny") -> CausalLM:
    """Build the gin-configured model from `seed`, write it and `tokenizer`'s files to `out`; returns the model."""
    return seeded_model(out, seed, tokenizer)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder to write (created; existing weights replaced)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default="tiny", help="tokenizer name or folder to ship with the model")
    parser.add_argument("--gin_file", action="append", default=[TINY_MODEL_GIN])
    parser.add_argument("--gin_param", action="append", default=[], help="e.g. 'ModelConfig.num_layers = 2'")
    args = parser.parse_args(argv)
    parse_gin(args.gin_file, args.gin_param)
    model = make_tiny_model(args.out, args.seed, args.tokenizer)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(model.params))
    print(f"wrote {args.out}: {model.config.family}, {n_params:,} parameters, seed {args.seed}")


if __name__ == "__main__":
    main()
