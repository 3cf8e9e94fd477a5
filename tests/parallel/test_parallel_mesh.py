"""make_mesh: axis sizes, the -1 rest axis, Auto axis types, gin configuration, clear errors (issue 2 item 5)."""

from pathlib import Path

import gin
import jax
import pytest
from jax.sharding import AxisType

from rstar_jax.parallel import MESH_AXES, make_mesh, resolve_axis_sizes


def test_default_mesh_puts_every_device_on_fsdp():
    mesh = make_mesh()
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert mesh.axis_types == (AxisType.Auto,) * 3
    assert set(mesh.devices.flat) == set(jax.devices())


@pytest.mark.parametrize(
    "sizes, expected",
    [
        ({"data": 2, "fsdp": 2, "tensor": 2}, (2, 2, 2)),
        ({"data": 2, "fsdp": -1, "tensor": 4}, (2, 1, 4)),
        ({"data": -1, "fsdp": 1, "tensor": 2}, (4, 1, 2)),
        ({"data": 1, "fsdp": 1, "tensor": -1}, (1, 1, 8)),
    ],
)
def test_rest_axis_takes_the_remaining_devices(sizes, expected):
    mesh = make_mesh(**sizes)
    assert tuple(mesh.shape[name] for name in MESH_AXES) == expected


def test_mesh_over_a_subset_of_devices():
    mesh = make_mesh(data=1, fsdp=2, tensor=2, devices=jax.devices()[:4])
    assert mesh.devices.size == 4 and set(mesh.devices.flat) == set(jax.devices()[:4])


@pytest.mark.parametrize(
    "sizes, message",
    [
        ({"data": 3, "fsdp": 1, "tensor": 1}, r"need 3 devices, but 8 are available"),
        ({"data": 3, "fsdp": -1, "tensor": 1}, r"8 devices are not divisible by 3"),
        ({"data": -1, "fsdp": -1, "tensor": 1}, r"only one mesh axis may be -1"),
        ({"data": 0, "fsdp": -1, "tensor": 1}, r"mesh axis 'data' has size 0"),
        ({"data": 1, "fsdp": 2.0, "tensor": 1}, r"mesh axis 'fsdp' has size 2.0"),
    ],
)
def test_bad_axis_sizes_name_the_problem(sizes, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(**sizes)


def test_resolve_axis_sizes_is_pure_arithmetic():
    assert resolve_axis_sizes({"data": 2, "fsdp": -1, "tensor": 2}, 64) == {"data": 2, "fsdp": 16, "tensor": 2}


GIN_MESH_DIR = Path(__file__).resolve().parents[2] / "gin" / "mesh"


@pytest.mark.parametrize(
    "gin_file, device_count, expected",
    [
        ("cpu8_3d.gin", 8, {"data": 2, "fsdp": 2, "tensor": 2}),
        ("fsdp.gin", 8, {"data": 1, "fsdp": 8, "tensor": 1}),
        ("single.gin", 1, {"data": 1, "fsdp": 1, "tensor": 1}),
        ("tensor_node.gin", 8, {"data": 1, "fsdp": 1, "tensor": 8}),
    ],
)
def test_mesh_is_set_by_gin(gin_file, device_count, expected):
    with gin.unlock_config():
        gin.parse_config_files_and_bindings([str(GIN_MESH_DIR / gin_file)], [])
    try:
        assert dict(make_mesh(devices=jax.devices()[:device_count]).shape) == expected
    finally:
        gin.clear_config()
