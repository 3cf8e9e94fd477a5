"""vLLM (the CPU build) serves a save_hf folder and scores tokens as this model does (issue 2 item 3).

vLLM runs in a subprocess (its engine spawns processes and must not share this test process's JAX state). Its
prompt log-probs of every prompt token must equal token_logprobs within 1e-4. vLLM's CPU attention kernels
support head_dim 32 and up, hence the shape; vLLM's Qwen3 has no o_proj bias, hence attention_bias false.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.model import ModelConfig, init_params, positions_from_mask, save_hf, token_logprobs

PROMPTS = [[3, 17, 42, 5, 9, 100, 7], [60, 2, 2, 119]]

VLLM_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def main():
        prompts = json.loads(sys.argv[2])
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=64, enforce_eager=True,
                  max_num_seqs=2, seed=0)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        scored = [[entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])]
                  for out, prompt in zip(outputs, prompts)]
        print("RESULT " + json.dumps(scored), flush=True)
        llm.llm_engine.engine_core.shutdown()

    if __name__ == "__main__":
        main()
        # Skip interpreter finalisation: vLLM's CPU build once aborted there on CI ("terminate called without an
        # active exception", exit -6) after the scores were out and its engine was shut down.
        os._exit(0)
""")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_scores_prompts_like_the_jax_model(tmp_path):
    config = ModelConfig(family="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True,
                         max_position_embeddings=128)
    # Scaled-up weights so the distribution is far from uniform and a wrong weight layout would show.
    params = jax.tree_util.tree_map(lambda x: x * 20 if x.ndim > 1 else x, init_params(config, jax.random.key(0)))
    save_hf((config, params), tmp_path / "model")
    script = tmp_path / "score_with_vllm.py"
    script.write_text(VLLM_SCRIPT)

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "model"), json.dumps(PROMPTS)], env=env,
                          capture_output=True, text=True, timeout=840)
    result_lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and result_lines, done.stderr[-4000:]
    vllm_scores = json.loads(result_lines[0].removeprefix("RESULT "))

    for prompt, scores in zip(PROMPTS, vllm_scores):
        ids = jnp.asarray([prompt])
        mask = jnp.ones_like(ids)
        ours = token_logprobs(params, config, ids, positions_from_mask(mask), mask, jnp.roll(ids, -1, axis=1))
        np.testing.assert_allclose(scores, np.asarray(ours)[0, :-1], atol=1e-4)
