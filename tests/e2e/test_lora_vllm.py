"""LoRA with the vLLM engine, both refit ways: adapter sync (vLLM's LoRA: the engine loads each new adapter,
its base weights untouched) and merged sync (the merged weights in place). Both pass the consistency gate
at start-up and after the first refit, and agree with the trainer at every step."""

import json
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from reinforge.paths import PROJECT_ROOT

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")

DEMO = PROJECT_ROOT / "configs" / "grpo_demo.yaml"
LORA_VLLM = ["generation.backend=vllm", "model.lora.rank=16", "optimizer.lr=1e-3"]


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_grpo_with_lora_and_vllm_agrees_with_the_trainer_at_every_step(tmp_path, sync):
    run_dir = tmp_path / sync
    command = [
        sys.executable,
        "-m",
        "reinforge.cli",
        "grpo",
        "--config",
        str(DEMO),
        *LORA_VLLM,
        f"model.lora.sync={sync}",
        "loop.max_steps=2",  # the gate at start-up, and each step after a refit
        "loop.val_every=0",
        "data.max_val_prompts=8",
        "checkpoint.save_final=false",
        f"logging.run_dir={run_dir}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(steps) == 2
    for row in steps:
        assert 1.0 <= row["train/token_mult_prob_error"] <= 1.05 and row["timing/refit_s"] > 0
    # adapter sync leaves the last adapter the engine loaded in the run directory; merged sync writes none
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file() == (sync == "adapter")


def refit_and_probe(run_dir, out_path):
    """In a fresh process (vLLM sets up process-wide state): two GRPO-like optimizer steps of a LoRA policy,
    each followed by the adapter refit; then the engine's logprobs, with the adapter and with it turned off,
    against the trainer and the base model."""
    from reinforge.algorithms import consistency
    from reinforge.algorithms.grpo_config import load_config
    from reinforge.data.batch import collate
    from reinforge.data.jsonl import read_jsonl
    from reinforge.data.prompts import render_prompt
    from reinforge.generation.base import SamplingParams
    from reinforge.generation.vllm_backend import VLLMGenerationBackend
    from reinforge.loops.builders import vllm_engine_kwargs
    from reinforge.loops.refit import refit
    from reinforge.modeling import load_tokenizer
    from reinforge.rollout.single_turn import generate_trajectories
    from reinforge.training.backend import Backend
    from reinforge.training.base import TrainingConfig
    from reinforge.training.heads import LogprobHead
    from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

    torch.manual_seed(0)
    config = load_config(DEMO, [*LORA_VLLM, "generation.vllm.block_size=32"])
    tokenizer = load_tokenizer(config.model)
    prompts = [
        render_prompt(r, tokenizer, "prompt", None, True)
        for r in read_jsonl(PROJECT_ROOT / "data" / "demo" / "val.jsonl")[:8]
    ]

    def sampling(seed):
        return SamplingParams(max_new_tokens=40, temperature=1.0, num_samples=4, seed=seed)

    def backend(model):
        return Backend(
            model,
            TrainingConfig(micro_batch_size=32, global_batch_size=32),
            OptimizerConfig(lr=1e-2),
            SchedulerConfig(),
            num_optimizer_steps=10,
            head=LogprobHead(1.0),
            load_reference=False,
        )

    trainer, base = backend(config.model), backend(config.model.model_copy(update={"lora": None}))
    engine = VLLMGenerationBackend(**vllm_engine_kwargs(config))
    errors = {"start": consistency.probe(prompts, engine, trainer, tokenizer, sampling(0))}
    for step in (1, 2):
        trajectories = generate_trajectories(prompts, engine, sampling(step), tokenizer)
        batch = collate(
            trajectories, [1.0 if i % 2 else -1.0 for i in range(len(trajectories))], tokenizer.pad_token_id
        )
        batch.old_logprobs = trainer.logprobs(batch)
        trainer.train_step(
            batch,
            lambda lp, micro, norm: (-(lp * micro.loss_mask * micro.advantages).sum() / norm.num_tokens, {}),
        )
        refit(engine, trainer, config, run_dir)
        errors[f"refit {step}"] = consistency.probe(prompts, engine, trainer, tokenizer, sampling(10 + step))
    errors["base vs adapter"] = consistency.probe(prompts, engine, base, tokenizer, sampling(20))
    engine.adapter = None  # the same engine, generating without the adapter from here on
    errors["base vs adapter off"] = consistency.probe(prompts, engine, base, tokenizer, sampling(20))
    torch.save(errors, out_path)


def test_after_adapter_refits_the_engine_is_the_trainer_with_the_adapter_and_the_base_model_without(tmp_path):
    process = mp.get_context("spawn").Process(target=refit_and_probe, args=(tmp_path / "run", tmp_path / "errors.pt"))
    (tmp_path / "run").mkdir()
    process.start()
    process.join(300)
    if process.is_alive():
        process.kill()
    assert process.exitcode == 0, process.exitcode
    errors = torch.load(tmp_path / "errors.pt")
    for when in ("start", "refit 1", "refit 2"):  # with the adapter: the trainer's logprobs
        assert errors[when] <= 1.001, errors
    assert errors["base vs adapter"] > 1.05, errors  # the adapter moved the policy away from the base...
    assert errors["base vs adapter off"] <= 1.001, errors  # ...whose weights the engine still holds unchanged
