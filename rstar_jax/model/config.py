"""The shape and numerics of a Qwen2/Qwen3 decoder, and its translation to and from a Hugging Face config.json.

One frozen (hashable) dataclass so it can be a static argument of jitted functions and a gin-configurable
constructor, so a gin file can define a model size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gin
import jax
import jax.numpy as jnp

FAMILIES: tuple[str, ...] = ("qwen2", "qwen3")
DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots_saveable", "dots_attention_saveable")
ATTENTION_IMPLS: tuple[str, ...] = ("dense", "causal_blockwise", "dot_product", "cpu_fused", "pallas", "auto")
PRECISIONS: dict[str, jax.lax.Precision] = {"default": jax.lax.Precision.DEFAULT, "high": jax.lax.Precision.HIGH,
                                            "highest": jax.lax.Precision.HIGHEST}

_ARCHITECTURES: dict[str, str] = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_HF_DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything that fixes a Qwen2/Qwen3 decoder's parameters and arithmetic.

    `head_dim` None means hidden_size // num_heads; `qkv_bias` / `qk_norm` None mean the family's default
    (Qwen2: q/k/v bias, no q/k norm; Qwen3: q/k norm, no bias). `o_bias` is Qwen3's `attention_bias` on o_proj.
    `remat_policy` only affects training memory and time (none; full: each layer recomputed in the backward pass;
    dots_saveable: only matmul outputs kept, the rest recomputed; dots_attention_saveable: also the fused
    attention's output and log-sum-exp, cpu_fused's or pallas'; see `backbone`), never the numbers beyond float
    rounding.
    `matmul_precision` is XLA's precision for float32 matmuls: "default" lets GPUs/TPUs use reduced-precision
    passes (TF32, bf16), "highest" gives full float32 (what transformers parity at 1e-4 needs on those devices;
    CPU is always full precision). `attention_impl` picks the training attention (issue 12; every one gives the
    dense numbers, see `attention.causal_attention`): "dense" (the reference; `attention_block_size` > 0 streams
    its keys in blocks of that size), "causal_blockwise" (blocks of `attention_block_size` > 0, the blocks above
    the diagonal skipped), "dot_product" (`jax.nn.dot_product_attention`, cuDNN's fused kernel on CUDA for
    16-bit compute), "cpu_fused" (`rstar_jax.kernels.cpu_attention`: one fused C++ call each way on XLA:CPU,
    float32, one device), "pallas" (`rstar_jax.kernels.pallas_attention`: Pallas flash attention, forward and
    backward, for GPUs; interpret mode, slow, on a CPU) or "auto" (issue 22 item 3: "pallas" on a GPU, "cpu_fused"
    on a CPU where its kernel builds, else "causal_blockwise" with one warning saying why, in blocks of
    `attention_block_size`, or 512 when that is 0; see `attention.resolve_attention_impl`). Decoding over a KV cache
    uses `attention.stacked_cached_attention` (with "cpu_fused", or "auto" resolved to it, a decode step reads the
    cache in place through a C++ kernel).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    family: str = "qwen3"
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool | None = None
    o_bias: bool = False
    qk_norm: bool | None = None
    max_position_embeddings: int = 32768
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat_policy: str = "none"
    matmul_precision: str = "default"
    attention_impl: str = "dense"
    attention_block_size: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads});"
                                 " give head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be a positive even integer (RoPE), got {self.head_dim}")
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.family == "qwen2")
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", self.family == "qwen3")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"ModelConfig.{name} must be one of {tuple(DTYPES)}, got {getattr(self, name)!r}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
        if self.matmul_precision not in PRECISIONS:
            raise ValueError(f"ModelConfig.matmul_precision must be one of {tuple(PRECISIONS)}, "
                             f"got {self.matmul_precision!r}")
        if not isinstance(self.attention_block_size, int) or self.attention_block_size < 0:
            raise ValueError(f"ModelConfig.attention_block_size must be a non-negative integer, "
                             f"got {self.attention_block_size!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.attention_impl must be one of {ATTENTION_IMPLS}, "
                             f"got {self.attention_impl!r}")
        if self.attention_impl == "causal_blockwise" and not self.attention_block_size:
            raise ValueError("ModelConfig.attention_impl 'causal_blockwise' needs attention_block_size > 0")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("ModelConfig.rope_theta and rms_norm_eps must be positive")

    @property
    def jnp_dtype(self) -> Any:
        """Compute dtype of activations and matmuls."""
        return DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self) -> Any:
        """Storage dtype of the parameters."""
        return DTYPES[self.param_dtype]

    @property
    def jax_precision(self) -> jax.lax.Precision:
        """Precision of every matmul and einsum in the model."""
        return PRECISIONS[self.matmul_precision]

    @property
    def num_groups(self) -> int:
        """Query heads sharing one key/value head (the GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **overrides: Any) -> "ModelConfig":
        """Read a Hugging Face Qwen2/Qwen3 config.json dict; reject features this model does not implement.

        Handles both transformers 4 (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5 (`rope_parameters`,
        `dtype`) spellings. `overrides` replace fields after reading; param_dtype and dtype are decided by
        `model_precision` (explicit, else gin's bindings, else the checkpoint's). Fields the folder does not fix
        (remat, attention, matmul precision) come from gin's ModelConfig bindings, as for any ModelConfig.
        """
        family = _family_of(d)
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}: only 'silu' (SwiGLU) is implemented")
        if d.get("use_sliding_window", False):
            raise ValueError("sliding-window attention (use_sliding_window: true) is not implemented")
        layer_types = d.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types):
            raise ValueError(f"unsupported layer_types {sorted(set(layer_types))}: "
                             "only 'full_attention' is implemented")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ValueError(f"config.json lacks required field(s) {missing}")
        attention_bias = bool(d.get("attention_bias", False))
        checkpoint_dtype = _normalise_dtype(d.get("torch_dtype") or d.get("dtype") or "float32")
        precision = model_precision(checkpoint_dtype, param_dtype=overrides.pop("param_dtype", None),
                                    dtype=overrides.pop("dtype", None))
        eos = d.get("eos_token_id")
        fields: dict[str, Any] = dict(
            family=family,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or None,
            rope_theta=float(_rope_theta(d)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            qk_norm=family == "qwen3",
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            **precision,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=d.get("pad_token_id"),
        )
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json transformers and vLLM read for this model (both rope spellings, both dtype keys)."""
        if self.family == "qwen2" and (not self.qkv_bias or self.o_bias or self.qk_norm):
            raise ValueError("a Qwen2 checkpoint has q/k/v bias, no o_proj bias and no q/k norm; this config differs")
        if self.family == "qwen3" and (self.qkv_bias != self.o_bias or not self.qk_norm):
            raise ValueError("a Qwen3 checkpoint has q/k norm and one attention_bias flag for q/k/v/o; "
                             "this config differs")
        architecture = {v: k for k, v in _ARCHITECTURES.items()}[self.family]
        d: dict[str, Any] = {
            "architectures": [architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "sliding_window": None,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": self.param_dtype,
            "dtype": self.param_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.family == "qwen3":
            d["attention_bias"] = self.qkv_bias
        return d


def model_precision(checkpoint_dtype: str | None = None, *, param_dtype: str | None = None,
                    dtype: str | None = None) -> dict[str, str]:
    """The storage and compute dtypes a model is built with: {"param_dtype": ..., "dtype": ...} (issue 22 item 1).

    The one decision the trainer, the SFT run, evaluation and the dry run share (they all build their
    `ModelConfig` through `from_hf_dict` or from gin, which end here), so the dry run plans what runs. Each dtype is,
    in order: the explicit argument; gin's `ModelConfig` binding (the recipe's float32 master weights and bfloat16
    compute); the checkpoint's dtype (`checkpoint_dtype`, from config.json); float32. Why gin before the folder:
    Qwen3 ships bfloat16 weights, and bfloat16 master weights lose a 1e-6 AdamW update to rounding (a bfloat16
    weight of 0.02 moves in steps of 1.2e-4), so a run that took the folder's dtype would train without changing.
    """
    bound: dict[str, str] = {}
    for name in ("param_dtype", "dtype"):
        try:
            bound[name] = gin.query_parameter(f"ModelConfig.{name}")
        except ValueError:  # gin's word for "not bound"
            continue
    fallback = _normalise_dtype(checkpoint_dtype) if checkpoint_dtype is not None else "float32"
    return {"param_dtype": _normalise_dtype(param_dtype or bound.get("param_dtype") or fallback),
            "dtype": _normalise_dtype(dtype or bound.get("dtype") or fallback)}


def _family_of(d: dict[str, Any]) -> str:
    """Model family from `architectures` (preferred) or `model_type`; a clear error for anything else."""
    architectures = d.get("architectures") or []
    if architectures:
        known = [_ARCHITECTURES[a] for a in architectures if a in _ARCHITECTURES]
        if not known:
            raise ValueError(f"unsupported architecture {architectures}: supported are {sorted(_ARCHITECTURES)}")
        return known[0]
    model_type = d.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r} (no architectures given): supported are {FAMILIES}")
    return model_type


def _rope_theta(d: dict[str, Any]) -> float:
    """RoPE base from either spelling; rejects any RoPE scaling other than the default in either field."""
    theta = d.get("rope_theta", 10000.0)
    for key in ("rope_scaling", "rope_parameters"):
        params = d.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"config.json field {key} must be an object, got {params!r}")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise ValueError(f"unsupported RoPE scaling {key}.rope_type={kind!r}: only 'default' RoPE is implemented")
        theta = params.get("rope_theta", theta)
    return theta


def _normalise_dtype(name: Any) -> str:
    """'torch.bfloat16' / 'bf16' / 'bfloat16' -> 'bfloat16'; a clear error for dtypes with no JAX counterpart here."""
    text = str(name).removeprefix("torch.")
    text = _HF_DTYPE_ALIASES.get(text, text)
    if text not in DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {name!r}: supported are {tuple(DTYPES)}")
    return text
