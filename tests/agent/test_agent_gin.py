"""The shipped agent gin file parses and binds the knobs it lists."""

from __future__ import annotations

from pathlib import Path

import gin

import rstar_jax.agent  # noqa: F401  (registers the agent's configurables)
import rstar_jax.data.synthetic_sft  # noqa: F401  (registers the synthetic task and SFT configurables)

GIN_FILE = Path(__file__).resolve().parents[2] / "gin" / "agent" / "format.gin"


def test_shipped_agent_gin_file_parses_and_binds() -> None:
    gin.clear_config()
    try:
        gin.parse_config_file(str(GIN_FILE))
        assert gin.query_parameter("format_tool_response.max_chars") == 256
        assert gin.query_parameter("synthetic_tasks.difficulty") == 1
        assert gin.query_parameter("sft_transcripts.faulty_fraction") == 0.25
    finally:
        gin.clear_config()
