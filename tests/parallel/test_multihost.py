"""The multi-process helpers (`rstar_jax.parallel.multihost`, issue 23 item 1) in two real local JAX processes of 2 CPU
devices each: a host copy of an array split over both gathers every shard (cast to bfloat16 on the devices first
when asked), the driver's values and arrays reach the other process, and `place` builds a global array from a host
copy. In one process each helper is the plain local operation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import portpicker
import pytest

from rstar_jax.parallel.multihost import host_copy, is_driver, multi_process, share, share_arrays

REPO_ROOT = Path(__file__).resolve().parents[2]

PROCESS = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from rstar_jax.parallel.multihost import host_copy, is_driver, multi_process, place, share, share_arrays

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    whole = np.arange(32, dtype=np.float32).reshape(8, 4) / 3
    tree = {"w": place(whole, rows), "steps": place(np.arange(8, dtype=np.int32), rows)}
    gathered = host_copy(tree)
    narrow = host_copy(tree, "bfloat16")
    value = share({"drawn": 3, "ids": ["a", "b"]} if is_driver() else None)
    arrays = share_arrays([np.array([[1, 2]], np.int64), np.array([0.5], np.float32)] if is_driver() else None)
    print(json.dumps({
        "process": jax.process_index(), "multi": multi_process(), "local_devices": len(jax.local_devices()),
        "addressable": tree["w"].is_fully_addressable,
        "w": gathered["w"].tolist(), "steps": gathered["steps"].tolist(),
        "narrow_dtype": str(narrow["w"].dtype), "narrow": narrow["w"].astype(np.float32).tolist(),
        "narrow_steps_dtype": str(narrow["steps"].dtype),
        "value": value, "arrays": [[a.tolist(), a.dtype.str] for a in arrays]}))
""")


@pytest.mark.slow
def test_two_processes_gather_cast_and_share(tmp_path: Path) -> None:
    address = f"127.0.0.1:{portpicker.pick_unused_port()}"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(REPO_ROOT)}
    script = tmp_path / "process.py"
    script.write_text(PROCESS)
    started = [subprocess.Popen([sys.executable, str(script), address, str(index)], env=env, cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for index in range(2)]
    try:
        outputs = [process.communicate(timeout=300) for process in started]
    finally:
        for process in started:
            process.kill()
    assert [process.returncode for process in started] == [0, 0], [err[-3000:] for _, err in outputs]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]

    whole = np.arange(32, dtype=np.float32).reshape(8, 4) / 3
    for index, report in enumerate(reports):
        assert report["process"] == index and report["multi"] and report["local_devices"] == 2
        assert not report["addressable"], "each process holds only its own half of the rows"
        np.testing.assert_array_equal(np.asarray(report["w"], np.float32), whole)
        assert report["steps"] == list(range(8))
        assert report["narrow_dtype"] == "bfloat16" and report["narrow_steps_dtype"] == "int32"
        np.testing.assert_array_equal(np.asarray(report["narrow"], np.float32),
                                      whole.astype(ml_dtypes.bfloat16).astype(np.float32))
        assert report["value"] == {"drawn": 3, "ids": ["a", "b"]}
        assert report["arrays"] == [[[[1, 2]], "<i8"], [[0.5], "<f4"]]


def test_one_process_helpers_are_the_local_operations() -> None:
    tree = {"w": jax.numpy.full((2, 3), 1 / 3, jax.numpy.float32), "n": np.int32(4)}
    assert is_driver() and not multi_process()
    copied = host_copy(tree)
    assert isinstance(copied["w"], np.ndarray) and copied["w"].dtype == np.float32
    narrow = host_copy(tree, "bfloat16")
    assert narrow["w"].dtype == ml_dtypes.bfloat16 and narrow["w"][0, 0] == ml_dtypes.bfloat16(1 / 3)
    assert share({"a": 1}) == {"a": 1}
    arrays = [np.arange(3)]
    assert share_arrays(arrays)[0] is arrays[0] and share_arrays(None) == []
