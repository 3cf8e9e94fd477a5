"""Model-test helpers: tiny random Qwen2/Qwen3 models built by transformers itself (offline) as the reference.

transformers initialises norms to 1 and biases to 0, which would leave those code paths untested, so every tensor
is redrawn from a seeded torch generator: weights ~ N(0, 1/fan_in) (activations keep unit scale through the
layers, giving logits of order 1-10), embeddings ~ N(0, 1), norm scales ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transformers

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2, max_position_embeddings=128)


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter so norms and biases differ from their trivial init (see module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise
            elif name.endswith(".bias"):
                value = 0.1 * noise
            elif "embed_tokens" in name:
                value = noise
            else:
                value = noise / param.shape[-1] ** 0.5
            param.copy_(value.to(param.dtype))


def build_hf_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                   **overrides: Any) -> torch.nn.Module:
    """A randomised Qwen2ForCausalLM / Qwen3ForCausalLM in eval mode, drawn in float32 then cast to `dtype`."""
    config_class, model_class = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**SMALL, **overrides}))
    randomise_(model, seed)
    return model.to(dtype).eval()


def hf_logits(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray | None = None,
              positions: np.ndarray | None = None) -> np.ndarray:
    """float32 logits from transformers (eager forward, no cache)."""
    kwargs: dict[str, Any] = {}
    if mask is not None:
        kwargs["attention_mask"] = torch.from_numpy(mask.astype(np.int64))
    if positions is not None:
        kwargs["position_ids"] = torch.from_numpy(positions.astype(np.int64))
    with torch.no_grad():
        return model(torch.from_numpy(ids.astype(np.int64)), use_cache=False, **kwargs).logits.float().numpy()


def padded_batch(vocab_size: int, lengths: list[int], width: int, side: str, seed: int = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Random ids [B, width] with `lengths` real tokens per row, padded on `side` ('left' or 'right') with id 0."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros((len(lengths), width), np.int64)
    for row, length in enumerate(lengths):
        span = slice(width - length, width) if side == "left" else slice(0, length)
        ids[row, span] = rng.integers(1, vocab_size, length)
        mask[row, span] = 1
    return ids, mask


def mask_positions(mask: np.ndarray) -> np.ndarray:
    """cumsum(mask) - 1 clipped at 0: the positions rstar_jax uses, and transformers' generate() for left padding."""
    return np.maximum(np.cumsum(mask, axis=-1) - 1, 0)


def assert_logits_close(actual: np.ndarray, expected: np.ndarray, mask: np.ndarray) -> None:
    """Compare real positions: rtol 1e-4, atol 1e-5 x the largest |logit| (see test_parity's docstring)."""
    real = mask.astype(bool)
    atol = 1e-5 * float(np.abs(expected[real]).max())
    np.testing.assert_allclose(np.asarray(actual)[real], expected[real], rtol=1e-4, atol=atol)
