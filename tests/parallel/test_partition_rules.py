"""Partition rules on a hand-built parameter tree of the model's exact structure (issue 2 item 5).

The expected specs are written out by hand from the FSDP + tensor layout: the big non-tensor dimension over
'fsdp', heads / MLP / vocabulary over 'tensor', the stacked layer axis whole.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rstar_jax.parallel import (
    abstract_placed,
    activation_sharding,
    cache_shardings,
    cache_spec,
    constrain,
    fit_spec,
    make_mesh,
    param_shardings,
    param_specs,
    shard_params,
    shardings_like_params,
    use_mesh,
)

V, E, L, HQ, HKV, D, F = 64, 32, 2, 4, 2, 8, 48


def model_shaped_params(vocab=V, embed=E, tied=False, qkv_bias=True, o_bias=True, qk_norm=True):
    """A parameter tree with the structure rstar_jax.model.init_params produces (arange values, f32)."""
    shapes = {
        "embed": {"embedding": (vocab, embed)},
        "layers": {
            "input_norm": {"scale": (L, embed)},
            "attn": {
                "q_proj": {"kernel": (L, embed, HQ * D)},
                "k_proj": {"kernel": (L, embed, HKV * D)},
                "v_proj": {"kernel": (L, embed, HKV * D)},
                "o_proj": {"kernel": (L, HQ * D, embed)},
            },
            "post_attn_norm": {"scale": (L, embed)},
            "mlp": {
                "gate_proj": {"kernel": (L, embed, F)},
                "up_proj": {"kernel": (L, embed, F)},
                "down_proj": {"kernel": (L, F, embed)},
            },
        },
        "final_norm": {"scale": (embed,)},
    }
    attn = shapes["layers"]["attn"]
    if qkv_bias:
        attn["q_proj"]["bias"] = (L, HQ * D)
        attn["k_proj"]["bias"] = (L, HKV * D)
        attn["v_proj"]["bias"] = (L, HKV * D)
    if o_bias:
        attn["o_proj"]["bias"] = (L, embed)
    if qk_norm:
        attn["q_norm"] = {"scale": (L, D)}
        attn["k_norm"] = {"scale": (L, D)}
    if not tied:
        shapes["lm_head"] = {"kernel": (embed, vocab)}
    return jax.tree_util.tree_map(
        lambda shape: jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


EXPECTED_SPECS = {
    "embed": {"embedding": P("tensor", "fsdp")},
    "layers": {
        "input_norm": {"scale": P(None, None)},
        "attn": {
            "q_proj": {"kernel": P(None, "fsdp", "tensor"), "bias": P(None, "tensor")},
            "k_proj": {"kernel": P(None, "fsdp", "tensor"), "bias": P(None, "tensor")},
            "v_proj": {"kernel": P(None, "fsdp", "tensor"), "bias": P(None, "tensor")},
            "o_proj": {"kernel": P(None, "tensor", "fsdp"), "bias": P(None, None)},
            "q_norm": {"scale": P(None, None)},
            "k_norm": {"scale": P(None, None)},
        },
        "post_attn_norm": {"scale": P(None, None)},
        "mlp": {
            "gate_proj": {"kernel": P(None, "fsdp", "tensor")},
            "up_proj": {"kernel": P(None, "fsdp", "tensor")},
            "down_proj": {"kernel": P(None, "tensor", "fsdp")},
        },
    },
    "final_norm": {"scale": P(None)},
    "lm_head": {"kernel": P("fsdp", "tensor")},
}


def test_every_parameter_gets_its_hand_written_spec():
    assert param_specs(model_shaped_params()) == EXPECTED_SPECS


def test_specs_from_shapes_alone_match_specs_from_arrays():
    params = model_shaped_params()
    assert param_specs(jax.eval_shape(lambda: params)) == param_specs(params)


def test_optional_parameters_may_be_absent():
    specs = param_specs(model_shaped_params(tied=True, qkv_bias=False, o_bias=False, qk_norm=False))
    assert "lm_head" not in specs
    assert set(specs["layers"]["attn"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert specs["layers"]["attn"]["q_proj"] == {"kernel": P(None, "fsdp", "tensor")}


def test_unmatched_parameter_is_named_in_the_error():
    params = model_shaped_params()
    params["layers"]["attn"]["rotary"] = {"freqs": jnp.zeros((L, D))}
    with pytest.raises(ValueError, match=r"no partition rule matches parameter 'layers/attn/rotary/freqs'"):
        param_specs(params)


def test_rank_mismatch_is_named_in_the_error():
    params = model_shaped_params()
    params["final_norm"]["scale"] = jnp.zeros((L, E))
    with pytest.raises(ValueError, match=r"'final_norm/scale' has rank 2 but rule"):
        param_specs(params)


def test_rule_overlap_is_an_error():
    rules = ((r"final_norm/.*", ("embed",)), (r".*/scale", ("embed",)))
    with pytest.raises(ValueError, match=r"'final_norm/scale' matches several partition rules"):
        param_specs({"final_norm": {"scale": jnp.zeros((E,))}}, rules=rules)


@pytest.mark.parametrize(
    "sizes",
    [{"data": 2, "fsdp": 2, "tensor": 2}, {"data": 1, "fsdp": 8, "tensor": 1}, {"data": 2, "fsdp": 1, "tensor": 4}],
)
def test_shard_params_really_splits_each_parameter(sizes):
    mesh = make_mesh(**sizes)
    params = model_shaped_params()
    sharded = shard_params(params, mesh)
    for (path, array), spec in zip(
        jax.tree_util.tree_leaves_with_path(sharded), jax.tree_util.tree_leaves(EXPECTED_SPECS, is_leaf=_is_spec)
    ):
        assert array.sharding == NamedSharding(mesh, spec), path
        expected_local = tuple(
            dim // (1 if axis is None else mesh.shape[axis]) for dim, axis in zip(array.shape, tuple(spec))
        )
        assert array.addressable_shards[0].data.shape == expected_local, path
    np.testing.assert_array_equal(
        sharded["layers"]["mlp"]["down_proj"]["kernel"], params["layers"]["mlp"]["down_proj"]["kernel"]
    )
    q_kernel = sharded["layers"]["attn"]["q_proj"]["kernel"]
    assert q_kernel.addressable_shards[0].data.size * mesh.shape["fsdp"] * mesh.shape["tensor"] == q_kernel.size


def _is_spec(x):
    return isinstance(x, P)


def test_uneven_dimension_falls_back_to_replication():
    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    params = model_shaped_params(vocab=63, embed=30)  # 63 not divisible by tensor=2, 30 not by fsdp=4
    specs = param_specs(params, mesh)
    assert specs["embed"]["embedding"] == P(None, None)
    assert specs["lm_head"]["kernel"] == P(None, None)
    assert specs["layers"]["attn"]["q_proj"]["kernel"] == P(None, None, "tensor")
    assert specs["layers"]["mlp"]["down_proj"]["kernel"] == P(None, "tensor", None)
    sharded = shard_params(params, mesh)
    assert sharded["embed"]["embedding"].addressable_shards[0].data.shape == (63, 30)
    assert sharded["layers"]["attn"]["q_proj"]["kernel"].addressable_shards[0].data.shape == (L, 30, HQ * D // 2)


def test_fit_spec_keeps_the_longest_dividing_prefix_of_a_tuple():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    assert fit_spec(P(("data", "fsdp"), "tensor"), (4, 6), mesh) == P(("data", "fsdp"), "tensor")
    assert fit_spec(P(("data", "fsdp"), "tensor"), (2, 3), mesh) == P(("data",), None)
    assert fit_spec(P(("data", "fsdp"), None), (1, 3), mesh) == P(None, None)


def test_param_shardings_are_named_shardings_on_the_mesh():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    shardings = param_shardings(model_shaped_params(), mesh)
    assert shardings["lm_head"]["kernel"] == NamedSharding(mesh, P("fsdp", "tensor"))


def test_cache_spec_splits_batch_and_kv_heads():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    assert cache_spec((L, 4, HKV, 16, D)) == P(None, ("data", "fsdp"), "tensor", None, None)
    assert cache_spec((L, 2, 1, 16, D), mesh) == P(None, ("data",), None, None, None)
    assert cache_spec((4,), mesh) == P(("data", "fsdp"))
    with pytest.raises(ValueError, match=r"KV cache array has axes .* got rank 4"):
        cache_spec((L, 4, HKV, 16))


def test_cache_shardings_place_the_stacked_keys_and_values():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    cache = (jnp.zeros((L, 4, HKV, 16, D)), jnp.zeros((L, 4, HKV, 16, D)), jnp.zeros((4,), jnp.int32))
    keys, values, lengths = jax.device_put(cache, cache_shardings(cache, mesh))
    for array in (keys, values):
        assert array.sharding.spec == P(None, ("data", "fsdp"), "tensor", None, None)
        assert array.addressable_shards[0].data.shape == (L, 1, 1, 16, D)
    assert lengths.sharding.spec == P(("data", "fsdp"))


def test_constrain_is_identity_without_a_mesh_and_shards_with_one():
    x = jnp.arange(4 * 6 * 8, dtype=jnp.float32).reshape(4, 6, 8)
    assert constrain(x, "batch", "seq", "heads") is x
    mesh = make_mesh(data=2, fsdp=2, tensor=2)

    @jax.jit
    def double(x):
        with use_mesh(mesh):
            return constrain(x * 2, "batch", "seq", "heads")

    y = double(x)
    np.testing.assert_array_equal(y, x * 2)
    assert y.sharding.spec == P(("data", "fsdp"), None, "tensor")
    odd = double(jnp.ones((3, 6, 5)))  # neither 3 nor 5 divides: stays whole, still runs
    assert odd.sharding.is_fully_replicated


def test_unknown_logical_axis_is_named():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    with use_mesh(mesh), pytest.raises(ValueError, match=r"unknown logical axis names \['tokens'\]"):
        constrain(jnp.ones((4, 4)), "batch", "tokens")


def test_use_mesh_retraces_a_function_jitted_without_a_mesh():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)

    @jax.jit
    def inner(x):
        return constrain(x * 2, "batch", "heads")

    x = jnp.ones((8, 8))
    inner(x)  # cached trace with no mesh: no constraint

    def outer(x):
        with use_mesh(mesh):
            return inner(x) + 1

    assert jax.jit(outer).lower(x).as_text().count("sharding_constraint") == 1
    with use_mesh(mesh):
        assert jax.jit(lambda x: inner(x) + 1).lower(x).as_text().count("sharding_constraint") == 1
    assert jax.jit(lambda x: inner(x) + 1).lower(x).as_text().count("sharding_constraint") == 0


def test_activation_sharding_agrees_with_constrain_and_fits_uneven_dims():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    assert activation_sharding(mesh, (8, 5, 64), "batch", "seq", "vocab").spec == P(("data", "fsdp"), None, "tensor")
    assert activation_sharding(mesh, (2, 5, 63), "batch", "seq", "vocab").spec == P(("data",), None, None)
    with pytest.raises(ValueError, match=r"got 2 axis names"):
        activation_sharding(mesh, (8, 5, 64), "batch", "seq")


def test_optimizer_state_is_split_like_its_parameters():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    params = model_shaped_params()
    state = optax.adamw(1e-3).init(params)
    shardings = shardings_like_params(state, params, mesh)
    adam = shardings[0]
    assert adam.count == NamedSharding(mesh, P())
    for moments in (adam.mu, adam.nu):
        assert jax.tree_util.tree_map(lambda s: s.spec, moments) == EXPECTED_SPECS
    placed = jax.device_put(state, shardings)
    assert placed[0].mu["lm_head"]["kernel"].addressable_shards[0].data.shape == (E // 2, V // 2)


def test_abstract_placed_gives_shapes_dtypes_and_the_given_placement():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    params = model_shaped_params()
    shardings = param_shardings(params, mesh)
    abstract = abstract_placed(jax.eval_shape(lambda p: p, params), shardings)
    for leaf, array, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(params), jax.tree.leaves(shardings)):
        assert isinstance(leaf, jax.ShapeDtypeStruct)
        assert (leaf.shape, leaf.dtype, leaf.sharding) == (array.shape, array.dtype, sharding)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert all(leaf.sharding == device for leaf in jax.tree.leaves(abstract_placed(params, device)))
