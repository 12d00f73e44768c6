"""LoRA (`model.lora`) in sft, dpo and rm on the demo model: each trains a few steps with its loss moving the
right way and only its adapters changing (and rm's new scalar head), `final/` a PEFT adapter on the untouched
base; DPO's reference is the base model; `reinforge eval` and `serve` take the base model plus the adapter;
bad LoRA input is a one-line error before any run directory is made."""

import json
import math
import subprocess
import sys

import openai
import peft
import pytest
import torch
from _servers import cli_server
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from reinforge.algorithms import dpo, rm, sft
from reinforge.algorithms.pairs import pair_batch
from reinforge.cli import main
from reinforge.config.loader import load_recipe_config
from reinforge.data.preference import load_pairs, tokenize_for_policy
from reinforge.envs.reward_model_server import RewardModelScorer
from reinforge.errors import ReinforgeError
from reinforge.evaluation.evaluate import evaluate, resolve_model
from reinforge.loops.supervised import train
from reinforge.model_config import ModelConfig
from reinforge.paths import PROJECT_ROOT
from reinforge.training.convert import convert
from reinforge.training.lora import adapter_disabled
from reinforge.training.micro_batching import token_logprobs

DEMO = PROJECT_ROOT / "models" / "demo"
CONFIGS = {
    "sft": PROJECT_ROOT / "configs" / "sft_lora_demo.yaml",
    "dpo": PROJECT_ROOT / "configs" / "dpo_demo.yaml",
    "rm": PROJECT_ROOT / "configs" / "rm_demo.yaml",
}
LORA = ["model.lora.rank=8", "model.lora.alpha=16"]  # dpo_demo and rm_demo are full fine-tuning configs


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_only_the_adapter_was_trained(final, model_class=AutoModelForCausalLM, head=None):
    """final/ holds adapter tensors only (and `head`, trained whole); loaded onto the base the PEFT way, every base
    weight equals the base model's and the adapters are not at their start (B = 0)."""
    saved = load_file(final / "adapter_model.safetensors")
    assert all("lora_" in name or (head and name.endswith(f"{head}.weight")) for name in saved), sorted(saved)[:5]
    assert any("lora_B" in name and tensor.abs().max() > 0 for name, tensor in saved.items())
    kwargs = {"num_labels": 1} if head else {}
    base = model_class.from_pretrained(DEMO, **kwargs).state_dict()
    trained = (
        peft.PeftModel.from_pretrained(model_class.from_pretrained(DEMO, **kwargs), final).get_base_model().state_dict()
    )
    body = {
        name.replace(".base_layer", ""): tensor
        for name, tensor in trained.items()
        if "lora_" not in name and (head is None or f"{head}." not in name)
    }
    assert body.keys() == {name for name in base if head is None or not name.startswith(f"{head}.")}
    assert all(torch.equal(tensor, base[name]) for name, tensor in body.items())


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A short LoRA SFT run of configs/sft_lora_demo.yaml (its adapter is served and evaluated below)."""
    run_dir = tmp_path_factory.mktemp("sft_lora") / "run"
    config = load_recipe_config(
        sft.SFTRunConfig,
        CONFIGS["sft"],
        ["sft.max_steps=12", "sft.val_every=0", "cluster.num_threads=1", f"logging.run_dir={run_dir}"],
    )
    return train(config, sft.SFT)


def test_sft_with_lora_lowers_the_validation_loss_training_the_adapter_only(sft_run):
    first, last = sft_run.first_val["val/loss"], sft_run.last_val["val/loss"]
    assert last < first - 1.0, (first, last)
    final = sft_run.run_dir / "final"
    assert (final / "tokenizer_config.json").is_file() and not (final / "model.safetensors").exists()
    assert_only_the_adapter_was_trained(final)


def test_dpo_with_lora_raises_the_margin_against_the_base_model_as_reference(tmp_path):
    config = load_recipe_config(
        dpo.DPORunConfig,
        CONFIGS["dpo"],
        [
            *LORA,
            "optimizer.lr=1e-3",
            "dpo.max_steps=6",
            "dpo.val_every=0",
            "data.max_val_pairs=64",
            f"logging.run_dir={tmp_path / 'run'}",
        ],
    )
    result = train(config, dpo.DPO)
    # before any update the policy is its reference: every implicit reward is 0 and the loss is log 2
    assert abs(rows(result.run_dir)[1]["train/loss"] - math.log(2)) < 1e-5
    first, last = result.first_val, result.last_val
    assert last["val/reward_margin"] > first["val/reward_margin"] + 0.3, (first, last)
    assert last["val/preference_accuracy"] >= first["val/preference_accuracy"] + 0.3, (first, last)
    final = result.run_dir / "final"
    assert_only_the_adapter_was_trained(final)

    # the reference, the trained policy with its adapters off, gives the base model's logprobs
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    pairs = load_pairs(config.data.val_path, tokenizer, tokenize_for_policy, config.data)[:16]
    trained = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DEMO), final)
    base_N2 = reply_logprobs(AutoModelForCausalLM.from_pretrained(DEMO), pairs, tokenizer.pad_token_id)
    with adapter_disabled(trained):
        reference_N2 = reply_logprobs(trained, pairs, tokenizer.pad_token_id)
    assert (reference_N2 - base_N2).abs().max() <= 1e-5
    assert (reply_logprobs(trained, pairs, tokenizer.pad_token_id) - base_N2).abs().max() > 0.1


@torch.no_grad()
def reply_logprobs(model, pairs, pad_token_id: int) -> torch.Tensor:
    """Each pair's (chosen, rejected) reply logprob [N, 2] from one padded forward of a plain model."""
    batch = pair_batch(pairs, pad_token_id)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return (token_logprobs(logits, batch.input_ids, 1.0) * batch.loss_mask).sum(dim=1).view(-1, 2)


def test_with_lora_a_per_batch_reference_gives_the_run_of_a_precomputed_one(tmp_path):
    """per_batch computes each step's reference with the adapters off, after the updates; precompute computes
    all of them before the first: the same base model, so the same losses."""
    pairs = (PROJECT_ROOT / "data" / "demo" / "preference_train.jsonl").read_text().splitlines()[:24]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(pairs) + "\n")
    common = [
        *LORA,
        "optimizer.lr=1e-3",
        "dpo.max_steps=3",
        "dpo.val_every=0",
        "data.val_path=null",
        f"data.train_path={data}",
        "checkpoint.save_final=false",
        "training.global_batch_size=16",
        "training.micro_batch_size=8",
    ]
    losses = {}
    for mode in ("per_batch", "precompute"):
        config = load_recipe_config(
            dpo.DPORunConfig, CONFIGS["dpo"], [*common, f"dpo.reference={mode}", f"logging.run_dir={tmp_path / mode}"]
        )
        losses[mode] = [(row["train/loss"], row["train/reward_margin"]) for row in rows(train(config, dpo.DPO).run_dir)]
    assert len(losses["precompute"]) == 3 and losses["precompute"][-1][1] > 0
    for (loss_a, margin_a), (loss_b, margin_b) in zip(losses["per_batch"], losses["precompute"]):
        assert abs(loss_a - loss_b) < 1e-5 and abs(margin_a - margin_b) < 1e-5, losses


def test_rm_with_lora_trains_the_adapter_and_the_head_and_its_final_scores_through_the_scorer(tmp_path):
    config = load_recipe_config(
        rm.RMRunConfig,
        CONFIGS["rm"],
        [
            *LORA,
            "optimizer.lr=3e-3",
            "rm.max_steps=20",
            "rm.val_every=0",
            "data.max_val_pairs=64",
            f"logging.run_dir={tmp_path / 'run'}",
        ],
    )
    result = train(config, rm.RM)
    first, last = result.first_val, result.last_val
    assert last["val/loss"] < first["val/loss"] - 0.05, (first, last)
    assert last["val/preference_accuracy"] >= first["val/preference_accuracy"] + 0.2, (first, last)
    final = result.run_dir / "final"
    assert_only_the_adapter_was_trained(final, AutoModelForSequenceClassification, head="score")

    # the judge's scorer merges the adapter and head onto the base and ranks the held-out pairs as training measured
    records = [json.loads(line) for line in (PROJECT_ROOT / config.data.val_path).read_text().splitlines()[:64]]
    scorer = RewardModelScorer(str(final), device="cpu", dtype="float32", max_length=2048, batch_size=16)

    def scores(reply):
        return scorer.score(
            [[{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r[reply]}] for r in records]
        )

    accuracy = sum(c > r for c, r in zip(scores("chosen"), scores("rejected"))) / len(records)
    assert abs(accuracy - last["val/preference_accuracy"]) <= 0.02, (accuracy, last)


@pytest.fixture(scope="module")
def other_base_adapter(tmp_path_factory):
    """A real PEFT adapter, trained on nothing, of another base model (models/tool_demo)."""
    path = tmp_path_factory.mktemp("other_base") / "adapter"
    model = AutoModelForCausalLM.from_pretrained(PROJECT_ROOT / "models" / "tool_demo")
    peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(path)
    return path


@pytest.mark.parametrize("command", ["sft", "dpo", "rm"])
def test_bad_lora_input_is_a_one_line_error_before_any_run_directory(command, tmp_path, capsys, other_base_adapter):
    lora = [] if command == "sft" else LORA
    for overrides, message in [
        (
            [*lora, "model.lora.target_modules=[q_proj,qkv_proj]"],
            "model.lora.target_modules: 'qkv_proj' is not a linear module of models/demo",
        ),
        (["model.lora.rank=0"], "config key model.lora.rank: Input should be greater than 0 (got 0)"),
        ([*lora, f"model.adapter={other_base_adapter}"], "was trained on"),
        ([*lora, "model.lora.quantize_base=nf4"], "model.lora.quantize_base (QLoRA) is not supported by"),
    ] + ([(["sft.random_init=true"], "sft.random_init does not go with model.lora")] if command == "sft" else []):
        here = "cluster.max_restarts=0"  # in this process, not a supervised child per case (as tests/e2e/test_cli.py)
        status = main(
            [command, "--config", str(CONFIGS[command]), f"logging.run_dir={tmp_path / 'run'}", here, *overrides]
        )
        stderr = capsys.readouterr().err
        assert status == 2, (overrides, stderr)
        assert (
            stderr.startswith("reinforge: error: ") and message in stderr and len(stderr.strip().splitlines()) == 1
        ), stderr
    assert not (tmp_path / "run").exists()


def reinforge(*args):
    return subprocess.run(
        [sys.executable, "-m", "reinforge.cli", *map(str, args)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_eval_takes_the_base_model_plus_an_adapter_as_the_merged_model(sft_run, tmp_path, capsys, other_base_adapter):
    final = sft_run.run_dir / "final"
    eval_args = ["--benchmark", "gsm8k", "--k", 1, "--limit", 8, "--backend", "hf", "--max-new-tokens", 24]
    result = reinforge(
        "eval", "--model", "models/demo", "--adapter", final, *eval_args, "--output", tmp_path / "adapter"
    )
    assert result.returncode == 0, result.stderr
    samples = [json.loads(line) for line in (tmp_path / "adapter" / "samples.jsonl").read_text().splitlines()]
    assert json.loads((tmp_path / "adapter" / "summary.json").read_text())["adapter"] == str(final)
    merged = evaluate(
        ModelConfig(name_or_path=str(convert(final, tmp_path / "merged", merge=True))),
        "gsm8k",
        k=1,
        limit=8,
        backend="hf",
        max_new_tokens=24,
    )
    assert len(samples) == 8 and [s["response"] for s in samples] == [s.response for s in merged.samples]

    with pytest.raises(
        ReinforgeError,
        match=f"is a LoRA adapter, not a whole model; give its base model and the adapter: "
        f"--model .* --adapter {final}",
    ):
        resolve_model(ModelConfig(name_or_path=str(sft_run.run_dir)))  # the run directory, whose final/ is an adapter
    capsys.readouterr()
    status = main(
        [
            "eval",
            "--model",
            "models/demo",
            "--adapter",
            str(other_base_adapter),
            *map(str, eval_args),
            "--output",
            str(tmp_path / "wrong"),
        ]
    )
    stderr = capsys.readouterr().err
    assert status == 2 and len(stderr.strip().splitlines()) == 1 and "was trained on" in stderr
    assert not (tmp_path / "wrong").exists()


@pytest.mark.xdist_group("ray")  # vLLM takes the machine's cores (tests/conftest.py)
def test_serve_with_vllm_answers_as_the_base_model_plus_the_adapter(sft_run, tmp_path, other_base_adapter):
    """vLLM serves the adapter merged into a temporary model directory: its logprobs are the adapter model's."""
    final = sft_run.run_dir / "final"
    question = [
        {"role": "user", "content": "Ann has 57 stickers. She finds 34 more. How many stickers does she have now?"}
    ]
    with cli_server(
        ["serve", "--model", "models/demo", "--adapter", str(final), "--backend", "vllm", "--max-model-len", "160"],
        tmp_path / "vllm.log",
        timeout_s=300,
    ) as (url, _, log):
        message = (
            openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            .chat.completions.create(model="policy", messages=question, temperature=0, max_tokens=32)
            .choices[0]
            .message
        )
    ids = torch.tensor([message.prompt_token_ids + message.generation_token_ids])
    num_prompt = len(message.prompt_token_ids)

    def logprobs(model):
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=ids).logits[0, num_prompt - 1 : -1], -1).gather(
                -1, ids[0, num_prompt:, None]
            )[:, 0]

    served = torch.tensor(message.generation_log_probs)
    adapter_model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DEMO), final)
    assert (served - logprobs(adapter_model)).abs().max() < 1e-3
    assert (served - logprobs(AutoModelForCausalLM.from_pretrained(DEMO))).abs().max() > 1e-2  # not the base model's

    wrong = reinforge("serve", "--model", "models/demo", "--adapter", other_base_adapter)
    assert wrong.returncode == 2 and len(wrong.stderr.strip().splitlines()) == 1 and "was trained on" in wrong.stderr
