"""Pure logic of the sandbox: request validation, results, snippet semantics, status classification, config."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import gin
import pytest

from sandbox_server.api import RequestError, RunRequest, Status, ToolResult, parse_batch_body, parse_run_request
from sandbox_server.client import SandboxClient
from sandbox_server.config import SandboxConfig, load_config
from sandbox_server.outcome import Observation, classify, exit_code_of
from sandbox_server.snippet import MEMORY_ERROR_EXIT_CODE, run_snippet

LIMITS = SandboxConfig(workers=2).request_limits()


def test_valid_request_keeps_fields_and_defaults():
    assert parse_run_request({"code": "1"}, LIMITS) == RunRequest(code="1")
    request = parse_run_request({"code": "x", "stdin": "5\n", "timeout_s": 2, "memory_mb": 64}, LIMITS)
    assert request == RunRequest(code="x", stdin="5\n", timeout_s=2.0, memory_mb=64)
    assert request.to_json() == {"code": "x", "stdin": "5\n", "timeout_s": 2.0, "memory_mb": 64}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1], "must be a JSON object"),
        ({"code": 3}, "'code' must be a string"),
        ({"code": "1", "input": ""}, "unknown field(s) ['input']"),
        ({"code": "1", "stdin": 5}, "'stdin' must be a string"),
        ({"code": "1", "timeout_s": 0}, "'timeout_s' must be in"),
        ({"code": "1", "timeout_s": "2"}, "'timeout_s' must be a finite number"),
        ({"code": "1", "timeout_s": float("nan")}, "'timeout_s' must be a finite number"),
        ({"code": "1", "memory_mb": 1.5}, "'memory_mb' must be an integer"),
        ({"code": "1", "memory_mb": 10**9}, "'memory_mb' must be in"),
        ({"code": "x" * (LIMITS.max_code_bytes + 1)}, "'code' is longer than the limit"),
    ],
)
def test_invalid_request_names_the_field(body, message):
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_run_request(body, LIMITS)


def test_batch_body_must_hold_a_request_list():
    assert parse_batch_body({"requests": [{"code": "1"}]}) == [{"code": "1"}]
    for bad in ({"requests": {}}, {"reqs": []}, []):
        with pytest.raises(RequestError):
            parse_batch_body(bad)


def test_tool_result_round_trip_and_ok():
    result = ToolResult(status="ok", stdout="2\n", stderr="", exit_code=0, duration_ms=1.5)
    assert ToolResult.from_json(result.to_json()) == result and result.ok
    assert not ToolResult.failure(Status.UNAVAILABLE, "down").ok
    with pytest.raises(ValueError, match="unknown status"):
        ToolResult.from_json({**result.to_json(), "status": "weird"})
    with pytest.raises(ValueError, match="lacks field"):
        ToolResult.from_json({"status": "ok"})


def test_snippet_prints_final_expression_like_ipython(capsys):
    assert run_snippet("x = 6\nx * 7") == 0
    assert run_snippet("None") == 0
    assert run_snippet("print('a')\n'b'") == 0
    assert run_snippet("y = 1") == 0
    assert capsys.readouterr().out == "42\na\n'b'\n"


def test_snippet_errors_and_exit_codes(capsys):
    assert run_snippet("1/0") == 1
    err = capsys.readouterr().err
    assert 'File "<code>", line 1' in err and "ZeroDivisionError" in err and "snippet.py" not in err
    assert run_snippet("import sys; sys.exit(4)") == 4
    assert run_snippet("import sys; sys.exit('bye')") == 1
    assert capsys.readouterr().err == "bye\n"
    assert run_snippet("def f(:\n  pass") == 1
    assert "SyntaxError" in capsys.readouterr().err
    assert run_snippet("raise MemoryError") == MEMORY_ERROR_EXIT_CODE


def _observe(wait_status=0, **changes):
    base = dict(wall_timed_out=False, output_truncated=False, oom_killed=False, cpu_seconds_used=0.1, cpu_limit_s=3)
    return Observation(wait_status=wait_status, **{**base, **changes})


def _exited(code):
    return code << 8


def test_classify_each_status():
    assert classify(_observe(_exited(0))) == (Status.OK, "")
    assert classify(_observe(_exited(1)))[0] == Status.ERROR
    assert classify(_observe(signal.SIGKILL, wall_timed_out=True))[0] == Status.TIMEOUT
    assert classify(_observe(signal.SIGKILL, output_truncated=True))[0] == Status.OUTPUT_TRUNCATED
    assert classify(_observe(signal.SIGKILL, oom_killed=True))[0] == Status.MEMORY_EXCEEDED
    assert classify(_observe(_exited(MEMORY_ERROR_EXIT_CODE)))[0] == Status.MEMORY_EXCEEDED
    assert classify(_observe(signal.SIGXCPU))[0] == Status.TIMEOUT
    assert classify(_observe(signal.SIGKILL, cpu_seconds_used=3.2))[0] == Status.TIMEOUT
    status, note = classify(_observe(signal.SIGSEGV))
    assert status == Status.KILLED and "SIGSEGV" in note
    assert exit_code_of(signal.SIGSEGV) == -signal.SIGSEGV and exit_code_of(_exited(3)) == 3
    assert os.WIFSIGNALED(signal.SIGSEGV)


@pytest.fixture
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def test_config_validation_and_gin(tmp_path, clean_gin):
    with pytest.raises(ValueError, match="workers must be a positive number"):
        SandboxConfig(workers=0)
    with pytest.raises(ValueError, match="default_timeout_s"):
        SandboxConfig(default_timeout_s=50, max_timeout_s=10)
    gin_file = tmp_path / "sandbox.gin"
    gin_file.write_text("SandboxConfig.workers = 3\nSandboxConfig.preload_modules = ['math']\n")
    config = load_config([str(gin_file)], ["SandboxConfig.max_queue = 7"], {"default_timeout_s": 2.5, "workers": None})
    assert (config.workers, config.max_queue, config.default_timeout_s) == (3, 7, 2.5)
    assert config.preload_modules == ("math",)
    with pytest.raises(ValueError, match="invalid gin configuration"):
        load_config([], ["SandboxConfig.no_such_knob = 1"])
    with pytest.raises(ValueError, match="unknown SandboxConfig override"):
        load_config([], [], {"no_such_knob": 1})


def test_shipped_gin_files_parse(clean_gin):
    root = Path(__file__).resolve().parents[2] / "gin" / "sandbox"
    config = load_config([str(root / "server.gin")])
    assert config.workers == 4 and "sympy" in config.preload_modules
    gin.clear_config()
    gin.parse_config_file(str(root / "client.gin"))
    client = SandboxClient()
    assert client.urls == ["http://127.0.0.1:8080"] and client.batch_size == 64


def test_client_rejects_bad_settings():
    with pytest.raises(ValueError, match="non-empty sequence of server URLs"):
        SandboxClient("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="batch_size=0"):
        SandboxClient(batch_size=0)


def test_cli_reports_invalid_gin_binding_and_exits():
    completed = subprocess.run(
        [sys.executable, "-m", "sandbox_server", "--gin_param", "SandboxConfig.workerz = 3"],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert completed.returncode == 2
    assert "invalid gin configuration" in completed.stderr and "workerz" in completed.stderr
