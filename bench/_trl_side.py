"""TRL's side of bench/grpo_vs_trl.py: GRPOTrainer on the benchmark's work, one step per turn.

Nothing of TRL is patched: a callback waits for the coordinator's turn at each step's start and times
the step; the phases come from TRL's own profiling contexts, which it reports to MLflow (a file store in
a temporary directory). See bench/grpo_vs_trl.py for the settings and how they match reinforge's.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROFILED = "profiling/Time taken: GRPOTrainer."
MICRO_BATCH = 32  # sequences per forward/backward (per_device_train_batch_size)


def trl_worker(
    conn,
    model_dir: Path,
    num_prompts: int,
    steps: int,
    threads: int,
    num_generations: int,
    max_new_tokens: int,
    lr: float,
) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(
            MLFLOW_TRACKING_URI=f"file://{tmp}/mlruns",
            MLFLOW_ALLOW_FILE_STORE="true",
            MLFLOW_EXPERIMENT_NAME="grpo_vs_trl",
        )
        turns = run_trainer(conn, model_dir, num_prompts, steps, num_generations, max_new_tokens, lr, Path(tmp))
        profile = profiled_seconds()
    for index, step in enumerate(turns):  # TRL tags a profile with global_step at its start: index
        seconds = profile.get(index, {})
        loss_forward = seconds.get("compute_loss", 0.0)
        phases = {
            "generate": seconds.get("transformers.generate", 0.0),
            "reward": seconds.get("_calculate_rewards", 0.0),
            "logprobs": max(seconds.get("_get_per_token_logps_and_entropies", 0.0) - loss_forward, 0.0),
            "train": step["step_s"] - seconds.get("_prepare_inputs", 0.0),
            "refit": 0.0,  # generation uses the trained model itself
        }
        step.update(phases=phases, overhead_s=step["step_s"] - sum(phases.values()))
    conn.send(("done", turns))


def run_trainer(
    conn, model_dir: Path, num_prompts: int, steps: int, num_generations: int, max_new_tokens: int, lr: float, tmp: Path
) -> list[dict]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reinforge.data.jsonl import read_jsonl
    from reinforge.envs.base import EnvRequest
    from reinforge.envs.math_env import MathEnv

    records = read_jsonl(ROOT / "data" / "demo" / "train.jsonl", required_keys=("prompt",))[: steps * num_prompts]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in records]
    )
    env = MathEnv()

    def math_reward(completions, answer, **_):
        """reinforge's math environment, as reinforge scores the same answers."""
        requests = [
            EnvRequest(messages=completion, record={"answer": gold}) for completion, gold in zip(completions, answer)
        ]
        return [response.reward for response in env.step(requests)]

    class TakeTurns(TrainerCallback):
        """Wait for the coordinator before each step; time it; keep its reward and token count."""

        def __init__(self):
            self.steps: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            conn.send(("ready", state.global_step + 1))
            conn.recv()
            self.tokens_before, self.start = state.num_input_tokens_seen, time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.start
            tokens = state.num_input_tokens_seen - self.tokens_before  # prompt + completion tokens of the step
            self.steps.append({"step_s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds})
            if state.global_step == args.max_steps:
                conn.send(("finished", state.global_step))  # the last step's turn ends here, before the teardown

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.steps[-1]["reward"] = logs["reward"]

    config = GRPOConfig(
        output_dir=str(tmp / "out"),
        use_cpu=True,
        bf16=False,
        seed=0,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=["mlflow"],
        disable_tqdm=True,
        shuffle_dataset=False,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=num_prompts * num_generations // MICRO_BATCH,
        num_generations=num_generations,
        max_completion_length=max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=lr,
        adam_beta2=0.99,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        scale_rewards="group",
        num_iterations=1,
        gradient_checkpointing=False,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    callback = TakeTurns()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=math_reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[callback],
    )
    trainer.train()
    env.close()
    return callback.steps


def profiled_seconds() -> dict[int, dict[str, float]]:
    """{global step: {profiled name: seconds summed over the step}} from the run MLflow just closed."""
    import mlflow
    from mlflow import MlflowClient

    run = mlflow.last_active_run()
    client = MlflowClient()
    seconds: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for key in client.get_run(run.info.run_id).data.metrics:
        if key.startswith(PROFILED):
            for metric in client.get_metric_history(run.info.run_id, key):
                seconds[metric.step][key[len(PROFILED) :]] += metric.value
    return seconds
