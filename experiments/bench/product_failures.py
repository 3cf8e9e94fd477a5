"""Where a demo SFT model's products go wrong at T=1 (issue 24: products of a 3- and a 2-digit number stay near 0%
at T=1 while the other kinds of the demo's tasks are solved).

    python -m experiments.bench.product_failures --model runs/demo/sft/model [--samples 4] [--json PATH]

Two measurements of one model:
1. Sampled: products of the held-out split (which no SFT transcript or RL stage draws from) solved `--samples` times
   each at T=1 through the agent loop, with a real sandbox server and the demo evaluation's turn and token limits.
   Each trajectory is sorted by the first thing in it that went wrong (`first_failure`). A product needs both
   factors copied from the question into the program, then the program's output copied into the answer.
2. Teacher-forced: for each question, a right first turn after the prompt, once with each of the reasons the SFT
   transcripts open it with (`INTROS`), and the probability the model gives each factor's tokens in the program:
   the chance that a sample at T=1 which wrote that opening copies the factor. It separates a copy the model makes
   from one it misses, and shows whether the copy depends on the opening before it.

The prompt and the transcripts' wording come from gin/sft/tiny_format.gin, as in the demo (`--gin_param` adds
bindings, for a model trained with other ones).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from collections import Counter
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments.make_tiny_model import TINY_MODEL_GIN
from experiments.sft import DEFAULT_GIN as SFT_GIN
from rstar_jax.agent.prompt import prompt_token_ids
from rstar_jax.agent.tool_call import ToolCall, tool_call_text
from rstar_jax.data.synthetic import SyntheticTask, synthetic_tasks
from rstar_jax.data.synthetic_sft import INTROS
from rstar_jax.eval.agentic import evaluate
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import forward, load_hf, positions_from_mask
from rstar_jax.processes import running_sandbox
from rstar_jax.reward.pool import VerifierPool
from rstar_jax.rollout.jax_engine import JaxEngine
from rstar_jax.rollout.verified import response_texts
from rstar_jax.tokenizers import load_tokenizer
from sandbox_server.client import SandboxClient

QUESTION = re.compile(r"Compute (\d+) \* (\d+)\.")
PROGRAM = re.compile(r"result = (\d+) \* (\d+)")
BOXED = re.compile(r"\\boxed\{")
EXAMPLES = 3  # model texts kept per kind of failure
FAILURES = ("right", "no program", "first factor miscopied", "second factor miscopied", "both factors miscopied",
            "right program, no output", "output, no answer", "output miscopied into the answer")


def factors(question: str) -> tuple[str, str]:
    """The two factors of a synthetic product question, as written."""
    found = QUESTION.search(question)
    if found is None:
        raise ValueError(f"not a product question: {question!r}")
    return found.group(1), found.group(2)


def first_failure(question: str, model_text: str, tool_text: str, correct: bool) -> str:
    """The first thing that went wrong in a product trajectory (one of FAILURES): its first program's factors
    against the question's, then whether any tool response printed the product, then the answer. `model_text` is
    what the model wrote (its turns), `tool_text` what the tool answered; `correct` is the verifier's verdict."""
    if correct:
        return "right"
    first, second = factors(question)
    program = PROGRAM.search(model_text)
    if program is None:
        return "no program"
    wrong = (program.group(1) != first, program.group(2) != second)
    if all(wrong):
        return "both factors miscopied"
    if any(wrong):
        return "first factor miscopied" if wrong[0] else "second factor miscopied"
    if str(int(first) * int(second)) not in tool_text:
        return "right program, no output"
    return "output miscopied into the answer" if BOXED.search(model_text) else "output, no answer"


def factor_probabilities(model: Any, tokenizer: Any, task: SyntheticTask, intro: str) -> tuple[float, float]:
    """Teacher-forced probability of each factor's tokens (their product over the factor's chunks) in a right first
    turn opening with the reason `intro` after the question's prompt."""
    prompt = prompt_token_ids(tokenizer, task.problem.question)
    turn = f"<reason>{intro}</reason>\n{tool_call_text(ToolCall(task.solution_code))}"
    encoded = tokenizer(turn, add_special_tokens=False, return_offsets_mapping=True)
    ids = prompt + list(encoded["input_ids"])
    tokens = jnp.asarray([ids])
    mask = jnp.ones_like(tokens)
    log_probs = np.asarray(jax.nn.log_softmax(forward(model.params, model.config, tokens,
                                                      positions_from_mask(mask), mask)[0], -1))
    program = PROGRAM.search(turn)
    probabilities = []
    for group in (1, 2):
        start, end = program.span(group)
        positions = [len(prompt) + index for index, (left, right) in enumerate(encoded["offset_mapping"])
                     if left < end and right > start]
        probabilities.append(float(np.exp(sum(log_probs[position - 1, ids[position]] for position in positions))))
    return probabilities[0], probabilities[1]


def measure(model_dir: str, problems: int, samples: int, seed: int = 7, max_turns: int = 4,
            max_response_tokens: int = 512) -> dict[str, Any]:
    """Both measurements of the model in `model_dir` on `problems` held-out products (gin must be parsed)."""
    tasks = synthetic_tasks(problems, seed=seed, kinds=("multiply",), split="heldout")
    tokenizer, model = load_tokenizer(model_dir), load_hf(model_dir)
    engine = JaxEngine(model.config, model.params, slots=16, max_len=1024)

    async def sampled(url: str, verifier: VerifierPool) -> Any:
        async with SandboxClient([url]) as client:
            return await evaluate(engine, client, tokenizer, [task.problem for task in tasks], verifier,
                                  samples=samples, temperature=1.0, max_turns=max_turns,
                                  max_response_tokens=max_response_tokens, seed=12345)

    try:
        with running_sandbox(("--workers", "2")) as server, VerifierPool(2) as verifier:
            result = asyncio.run(sampled(server.url, verifier))
    finally:
        engine.close()
    sorted_failures, examples = [], {}
    model_texts = response_texts(result.samples, tokenizer)
    for index, (sample, model_text, correct) in enumerate(zip(result.samples, model_texts, result.correct)):
        trajectory = sample.trajectory
        start = trajectory.loss_mask.index(1)  # the prompt ends where the model's first turn begins
        tool_ids = [t for t, m in zip(trajectory.token_ids[start:], trajectory.loss_mask[start:]) if not m]
        question = tasks[index // samples].problem.question
        sorted_failures.append(first_failure(question, model_text, tokenizer.decode(tool_ids), correct))
        examples.setdefault(sorted_failures[-1], []).append(f"{question}\n{model_text}")
    counts = Counter(sorted_failures)
    return {"model": model_dir, "problems": problems, "samples": samples, "accuracy": result.summary["accuracy"],
            "first_failures": {name: counts.get(name, 0) for name in FAILURES},
            "examples": {name: texts[:EXAMPLES] for name, texts in examples.items()},
            "teacher_forced": [teacher_forced(model, tokenizer, tasks, intro) for intro in INTROS]}


def teacher_forced(model: Any, tokenizer: Any, tasks: Sequence[SyntheticTask], intro: str) -> dict[str, Any]:
    """`factor_probabilities` of every task after `intro`: their means (first, second, both factors) and each
    question's."""
    pairs = [factor_probabilities(model, tokenizer, task, intro) for task in tasks]
    first, second = (np.array(values) for values in zip(*pairs))
    return {"intro": intro, "first_factor": float(first.mean()), "second_factor": float(second.mean()),
            "both": float((first * second).mean()),
            "per_question": [{"question": task.problem.question, "first": round(a, 3), "second": round(b, 3)}
                             for task, (a, b) in zip(tasks, pairs)]}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command-line entry point: prints the sorted trajectories and the teacher-forced factor probabilities."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an SFT model folder (a demo's OUT/sft/model)")
    parser.add_argument("--problems", type=int, default=24)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--gin_param", action="append", default=[])
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    parse_gin([TINY_MODEL_GIN, SFT_GIN], args.gin_param)
    figures = measure(args.model, args.problems, args.samples)
    total = args.problems * args.samples
    print(f"{args.model}: {args.problems} held-out products x {args.samples} at T=1, "
          f"{100 * figures['accuracy']:.1f}% right")
    for name, count in figures["first_failures"].items():
        print(f"  {name}: {count} of {total}")
    print("teacher-forced probability of the right factor after each opening of the first turn:")
    for forced in figures["teacher_forced"]:
        print(f"  first {forced['first_factor']:.2f}, second {forced['second_factor']:.2f}, both "
              f"{forced['both']:.2f}: {forced['intro']!r}")
    if args.json_path:
        with open(args.json_path, "w") as handle:
            json.dump(figures, handle, indent=1)
    return figures


if __name__ == "__main__":
    main()
