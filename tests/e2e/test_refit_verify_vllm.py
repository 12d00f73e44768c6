"""Refit verification with the real engines: vLLM's LoRA adapter sync (in a fresh process: vLLM sets up
process-wide state; full weights: test_refit_stream_vllm.py, and over the wire test_weight_wire.py), a Ray
GenerationGroup that names its stale engine, and a GRPO demo run that stops at the step whose refit silently
skipped a parameter."""

import json

import pytest
import torch
import torch.multiprocessing as mp

from reinforge import loops
from reinforge.algorithms.grpo_config import load_config
from reinforge.generation.hf import HFGenerationBackend
from reinforge.generation.weight_digest import RefitMismatch
from reinforge.paths import PROJECT_ROOT

DEMO = PROJECT_ROOT / "configs" / "grpo_demo.yaml"
SMALL = ["loss.kl_coef=0", "training.micro_batch_size=8", "training.global_batch_size=8", "optimizer.lr=1e-2"]
VLLM = ["generation.backend=vllm", "generation.vllm.block_size=32", "generation.vllm.max_model_len=256"]


def one_step(trainer, seed: int) -> None:
    """A real optimizer step that changes every trained weight."""
    from reinforge.data.batch import Trajectory, collate

    gen = torch.Generator().manual_seed(seed)
    trajectories = [
        Trajectory(*torch.randint(2, 64, (2, 5), generator=gen).tolist(), [0.0] * 5, False, 0.0, row, "math")
        for row in range(8)
    ]

    def loss_fn(logprobs_BT, micro, norm):
        return -(logprobs_BT * micro.loss_mask).sum() / norm.num_tokens, {}

    trainer.train_step(collate(trajectories, [1.0] * 8, pad_token_id=0), loss_fn)


def attempt(refit_call) -> str:
    """ "ok", or the one line a RefitMismatch stopped the refit with."""
    try:
        refit_call()
        return "ok"
    except RefitMismatch as error:
        return str(error)


def adapter_refits(run_dir, out_path) -> None:
    """In a fresh process: LoRA adapter syncs of a vLLM engine, correct and with planted faults, outcomes to JSON."""
    from contextlib import ExitStack

    from reinforge.generation.vllm_backend import VLLMGenerationBackend
    from reinforge.loops.builders import build_trainer, vllm_engine_kwargs
    from reinforge.loops.refit import refit

    config = load_config(DEMO, [*SMALL, *VLLM, "model.lora.rank=16"])
    outcomes = {}
    with ExitStack() as cleanup:
        trainer = build_trainer(config, cleanup)
        engine = VLLMGenerationBackend(**vllm_engine_kwargs(config))
        load = engine.load_adapter
        engine.load_adapter = lambda path: None  # fault: the adapter is never loaded
        outcomes["never loaded"] = attempt(lambda: refit(engine, trainer, config, run_dir, step=1))
        engine.load_adapter = load
        one_step(trainer, seed=1)
        outcomes["correct"] = attempt(lambda: refit(engine, trainer, config, run_dir, step=1))
        engine.load_adapter = lambda path: None  # fault: the engine keeps the previous adapter
        one_step(trainer, seed=2)
        outcomes["planted"] = attempt(lambda: refit(engine, trainer, config, run_dir, step=2))
        engine.shutdown()
    out_path.write_text(json.dumps(outcomes))


def run_in_fresh_process(tmp_path) -> dict[str, str]:
    out = tmp_path / "outcomes.json"
    process = mp.get_context("spawn").Process(target=adapter_refits, args=(tmp_path, out))
    process.start()
    process.join(timeout=300)
    assert process.exitcode == 0
    return json.loads(out.read_text())


@pytest.mark.xdist_group("ray")
def test_vllm_serves_the_adapter_written_and_one_not_loaded_is_caught(tmp_path):
    outcomes = run_in_fresh_process(tmp_path)
    assert outcomes["never loaded"] == "refit check: vllm engine serves no LoRA adapter: it was never loaded"
    assert outcomes["correct"] == "ok"
    assert outcomes["planted"].startswith("refit check: vllm engine does not serve the LoRA adapter just sent: ")


@pytest.mark.xdist_group("ray")
def test_a_generation_group_names_the_engine_that_did_not_take_the_weights():
    import ray

    from reinforge.loops.builders import engine_group
    from reinforge.modeling import load_model

    config = load_config(DEMO, ["generation.num_workers=2"])
    model = load_model(config.model)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        group = engine_group(config)
        # fault: generation[1]'s refit silently loads nothing
        ray.get(
            group.group.workers[1].__ray_call__.remote(
                lambda w: setattr(w.model, "load_state_dict", lambda *a, **k: None)
            )
        )
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01)
        weights = list(model.state_dict().items())
        group.update_weights(weights)
        from reinforge.generation.weight_digest import verify

        with pytest.raises(
            RefitMismatch, match=r"^refit check: generation\[1\] does not serve the weights just sent: "
        ):
            verify(group.weight_digests(), dict(weights))
        group.shutdown()
    finally:
        ray.shutdown()


def test_a_grpo_demo_run_stops_at_the_step_whose_refit_skipped_a_parameter(tmp_path, monkeypatch):
    skipped, calls = "model.layers.2.mlp.down_proj.weight", []
    load = HFGenerationBackend.update_weights

    def stale_from_the_second_refit(self, named):
        calls.append(1)
        load(
            self, [(n, self.model.state_dict()[n].clone() if n == skipped and len(calls) >= 2 else t) for n, t in named]
        )

    monkeypatch.setattr(HFGenerationBackend, "update_weights", stale_from_the_second_refit)  # fault injection
    run_dir = tmp_path / "run"
    config = load_config(
        DEMO,
        [
            "loop.max_steps=4",
            "loop.val_every=0",
            "rollout.num_prompts_per_step=4",
            "rollout.num_generations_per_prompt=4",
            "generation.max_new_tokens=16",
            "generation.num_probe_prompts=2",
            "training.micro_batch_size=16",
            "training.global_batch_size=16",
            "checkpoint.save_final=false",
            f"logging.run_dir={run_dir}",
        ],
    )
    with pytest.raises(RefitMismatch) as error:
        loops.train(config)
    assert str(error.value).startswith(f"refit check: hf engine does not serve the weights just sent: {skipped} ")
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]  # step 2's refit was the stale one: the run stopped there
