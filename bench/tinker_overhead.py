"""The same RL step through the Tinker API (the `tinker` SDK against `reinforge serve-tinker`) and as `reinforge grpo`,
on the demo model, in one script.

    python bench/tinker_overhead.py --steps 6 --json bench/results/tinker_overhead.json

The same work on both sides, each step:
    prompts      P (default 8) prompts of data/demo/train.jsonl in file order, rendered with the chat template
    sampling     8 samples per prompt, temperature 1, at most 48 new tokens, HF generation, from the weights of
                 the step before (the Tinker loop asks `save_weights_and_get_sampling_client` each step: the
                 server refits its engine from the live weights, as `reinforge grpo` does after each step)
    reward       reinforge's math environment, group-centred advantages divided by the group's std
    loss         the clipped ratio (Tinker `ppo` with clip thresholds 0.8 and 1.28; reinforge's clip_eps 0.2 / 0.28),
                 no KL; the Tinker loop divides each advantage by the batch's sampled tokens so that its summed loss
                 is reinforge's token mean
    optimizer    LoRA rank 16, alpha 32, on every linear layer; AdamW lr 1e-3, betas (0.9, 0.99), clip 1.0
    threads      one torch thread in the trainer's process on each side (the server's, reinforge grpo's)
The Tinker loop's client (this process) and the server (a subprocess) talk HTTP on 127.0.0.1. Reported: the median
step over steps 2..N on each side, `ratio` = Tinker's / reinforge's (the issue asks <= 1.5), and where the Tinker
loop's step goes as the client sees it (save_weights_and_get_sampling_client, sampling, scoring, forward_backward +
optim_step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, run_cli, write_result  # noqa: E402

GROUP, MAX_TOKENS, LR, RANK = 8, 48, 1e-3, 16


def grpo_side(steps: int, prompts: int) -> list[float]:
    """`reinforge grpo` on the LoRA demo with the bench's work: its timing/step_s per step."""
    rows, _ = run_cli(
        [
            "grpo",
            "--config",
            "configs/grpo_lora_demo.yaml",
            f"rollout.num_prompts_per_step={prompts}",
            f"rollout.num_generations_per_prompt={GROUP}",
            f"training.global_batch_size={prompts * GROUP}",
            f"training.micro_batch_size={prompts * GROUP}",
            f"generation.max_new_tokens={MAX_TOKENS}",
            "data.shuffle=false",
            "loss.kl_coef=0",
            "cluster.num_threads=1",
        ],
        steps,
        val_every=0,
    )
    return [row["timing/step_s"] for row in rows if "timing/step_s" in row]


def start_server(run_dir: Path) -> tuple[subprocess.Popen, str]:
    """`reinforge serve-tinker` on the demo in a subprocess (one torch thread); its URL from the line it prints."""
    command = [
        *(sys.executable, "-m", "reinforge.cli", "serve-tinker", "configs/tinker_demo.yaml"),
        *("tinker.port=0", f"tinker.run_dir={run_dir}", "cluster.num_threads=1"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    assert server.stdout is not None
    for line in server.stdout:
        if match := re.search(r"serving the Tinker API at (\S+)", line):
            return server, match.group(1)
        if time.monotonic() > deadline:
            break
    server.kill()
    raise SystemExit(f"serve-tinker did not start: {line}")


def tinker_side(steps: int, prompts: int, url: str) -> list[dict[str, float]]:
    """The RL loop through the SDK: per step the seconds of each part, as the client sees them."""
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    from reinforge.envs.base import EnvRequest
    from reinforge.envs.math_env import MathEnv

    os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-bench", TINKER_TELEMETRY="0")
    tok = AutoTokenizer.from_pretrained(ROOT / "models/demo")
    records = [json.loads(line) for line in (ROOT / "data/demo/train.jsonl").read_text().splitlines()]
    client = tinker.ServiceClient().create_lora_training_client(base_model="models/demo", rank=RANK, seed=0).result()
    env, params = MathEnv(), types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, stop=[tok.eos_token])
    adam = types.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.99, eps=1e-8, grad_clip_norm=1.0)
    clip = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}
    times = []
    for step in range(steps):
        start = time.perf_counter()
        sampler = client.save_weights_and_get_sampling_client().result()
        refit = time.perf_counter()
        batch = records[step * prompts : (step + 1) * prompts]
        prompt_ids = [chat_ids(tok, record["prompt"]) for record in batch]
        futures = [sampler.sample(types.ModelInput.from_ints(p), GROUP, params) for p in prompt_ids]
        groups = [future.result().sequences for future in futures]
        sampled = time.perf_counter()
        datums = score(env, tok, batch, prompt_ids, groups, EnvRequest)
        scored = time.perf_counter()
        if datums:
            client.forward_backward(datums, "ppo", loss_fn_config=clip).result()
            client.optim_step(adam).result()
        end = time.perf_counter()
        times.append(
            {
                "step_s": end - start,
                "save_weights_s": refit - start,
                "sample_s": sampled - refit,
                "reward_s": scored - sampled,
                "train_s": end - scored,
            }
        )
    return times


def chat_ids(tok, prompt: str) -> list[int]:
    """A user turn rendered with the chat template, as reinforge grpo renders its prompts."""
    messages = [{"role": "user", "content": prompt}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def score(env, tok, batch, prompt_ids, groups, request) -> list:
    """The datums of the sequences with a nonzero advantage, each advantage divided by the batch's sampled tokens."""
    from tinker import types

    total_tokens = sum(len(s.tokens) for group in groups for s in group)
    datums = []
    for record, prompt, group in zip(batch, prompt_ids, groups):
        texts = [tok.decode(s.tokens, skip_special_tokens=True) for s in group]
        rewards = np.asarray(
            [r.reward for r in env.step([request([{"role": "assistant", "content": t}], record) for t in texts])]
        )
        advantages = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6) / total_tokens
        for sequence, advantage in zip(group, advantages):
            if advantage == 0:
                continue
            tokens = prompt + sequence.tokens
            n = len(tokens) - 1
            prompt_part = len(prompt) - 1
            inputs = {
                "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
                "logprobs": np.asarray([0.0] * prompt_part + list(sequence.logprobs), dtype=np.float32),
                "advantages": np.asarray([0.0] * prompt_part + [advantage] * (n - prompt_part), dtype=np.float32),
            }
            datums.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={k: types.TensorData.from_numpy(v) for k, v in inputs.items()},
                )
            )
    return datums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (8 samples each)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/tinker_overhead.json")
    args = parser.parse_args()
    grpo = grpo_side(args.steps, args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        server, url = start_server(Path(tmp) / "server")
        try:
            tinker = tinker_side(args.steps, args.prompts, url)
        finally:
            server.terminate()
            server.wait(timeout=60)
    tinker_median = statistics.median(t["step_s"] for t in tinker[1:])
    grpo_median = statistics.median(grpo[1:])
    parts = {name: statistics.median(t[name] for t in tinker[1:]) for name in tinker[0] if name != "step_s"}
    result = {
        "command": f"python bench/tinker_overhead.py --steps {args.steps} --prompts {args.prompts}",
        "work": f"{args.prompts} prompts x {GROUP} samples, <= {MAX_TOKENS} new tokens, LoRA rank {RANK}, HF engine",
        "reinforge_grpo_step_s": grpo_median,
        "tinker_step_s": tinker_median,
        "ratio": tinker_median / grpo_median,
        "tinker_parts_s": parts,
        "grpo_steps_s": grpo,
        "tinker_steps": tinker,
        "date": time.strftime("%Y-%m-%d"),
    }
    write_result(args.json, result)
    print(f"reinforge grpo {grpo_median:.2f} s/step, Tinker loop {tinker_median:.2f} s/step: {result['ratio']:.2f}x")
    print("Tinker loop's parts (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))


if __name__ == "__main__":
    main()
