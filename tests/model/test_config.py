"""ModelConfig: reading both transformers 4 and 5 config.json spellings, writing one transformers accepts, gin."""

import gin
import pytest
import transformers

from rstar_jax.model import ModelConfig

# A transformers-4-era Qwen2 config.json (as published for Qwen2.5 models, shrunk): top-level rope_theta,
# torch_dtype, no head_dim, rope_scaling null, sliding window off.
LEGACY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 64,
    "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
    "vocab_size": 300, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
    "rope_scaling": None, "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 21,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}


def test_legacy_qwen2_fields():
    config = ModelConfig.from_hf_dict(LEGACY_QWEN2)
    assert (config.family, config.head_dim, config.num_kv_heads, config.num_groups) == ("qwen2", 8, 2, 4)
    assert config.rope_theta == 1e6 and config.rms_norm_eps == 1e-5 and config.tie_word_embeddings
    assert config.qkv_bias and not config.o_bias and not config.qk_norm
    assert config.param_dtype == config.dtype == "bfloat16" and config.max_position_embeddings == 4096
    overridden = ModelConfig.from_hf_dict(LEGACY_QWEN2, dtype="float32", param_dtype=None)
    assert overridden.dtype == "float32" and overridden.param_dtype == "bfloat16"


@pytest.mark.parametrize("family, attention_bias", [("qwen2", None), ("qwen3", True), ("qwen3", False)])
def test_to_hf_dict_round_trips_through_transformers(family, attention_bias):
    config = ModelConfig(family=family, vocab_size=50, hidden_size=24, intermediate_size=30, num_layers=2,
                         num_heads=6, num_kv_heads=3, head_dim=10 if family == "qwen3" else None, rope_theta=5e5,
                         rms_norm_eps=1e-5, qkv_bias=attention_bias, o_bias=bool(attention_bias),
                         max_position_embeddings=256, eos_token_id=(3, 4))
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
    assert ModelConfig.from_hf_dict(hf_config.to_dict()) == config
    assert hf_config.rope_parameters["rope_theta"] == 5e5 and hf_config.num_key_value_heads == 3


def test_configs_transformers_cannot_express_are_refused_on_export():
    with pytest.raises(ValueError, match="Qwen3 checkpoint has q/k norm"):
        ModelConfig(family="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                    num_kv_heads=1, qkv_bias=True, o_bias=False).to_hf_dict()


@pytest.mark.parametrize("fields, message", [
    (dict(family="llama"), "family must be one of"),
    (dict(num_heads=6, num_kv_heads=4), r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"),
    (dict(hidden_size=30), "give head_dim explicitly"),
    (dict(head_dim=7), "positive even integer"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(remat_policy="some"), "remat_policy must be one of"),
    (dict(matmul_precision="tf32"), "matmul_precision must be one of"),
    (dict(attention_block_size=-1), "attention_block_size must be a non-negative integer"),
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
])
def test_invalid_fields_are_named(fields, message):
    base = dict(vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**base, **fields})


def test_gin_defines_a_model():
    with gin.unlock_config():
        gin.parse_config("""
            ModelConfig.vocab_size = 64
            ModelConfig.hidden_size = 32
            ModelConfig.intermediate_size = 48
            ModelConfig.num_layers = 2
            ModelConfig.num_heads = 4
            ModelConfig.num_kv_heads = 2
            ModelConfig.remat_policy = 'full'
        """)
    try:
        config = ModelConfig()
        assert config.num_layers == 2 and config.head_dim == 8 and config.remat_policy == "full"
        assert hash(config) == hash(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                                                num_heads=4, num_kv_heads=2, remat_policy="full"))
    finally:
        gin.clear_config()
