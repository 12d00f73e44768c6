"""Where a run computes (`training.device`, `generation.device`) and how the HF engine samples.

On this machine (no GPU) `auto` must mean the CPU and an asked-for GPU must be a one-line error before any run
directory exists; on a GPU machine bench/gpu_checks.sh runs configs/grpo_gsm8k.yaml and shows the GPU used. The
HF engine's reported logprobs must be those of the distribution it sampled from (temperature, top-k, top-p), and
never of the checkpoint's own generation_config.json defaults, which the trainer knows nothing of."""

import pytest
import torch

from reinforge.cli import main
from reinforge.config.loader import load_recipe_config
from reinforge.data.batch import collate
from reinforge.data.jsonl import read_jsonl
from reinforge.data.prompts import render_prompt
from reinforge.errors import ReinforgeError
from reinforge.generation.base import GenerationConfig, SamplingParams
from reinforge.generation.hf import HFGenerationBackend
from reinforge.loops.registry import RECIPES
from reinforge.loops.run_checks import check_devices
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_model, load_tokenizer, resolve_device
from reinforge.paths import PROJECT_ROOT
from reinforge.rollout.single_turn import generate_trajectories
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

MODEL = ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo"))
DEMO = str(PROJECT_ROOT / "configs" / "grpo_demo.yaml")
# the choices a machine without a GPU makes (CI's); on a GPU, tests/unit/test_fsdp2_cuda.py and bench/gpu_checks.sh
without_a_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU chooses")


@without_a_gpu
def test_auto_is_the_cpu_without_a_gpu_and_an_absent_gpu_is_one_line():
    assert resolve_device("auto", "training.device") == torch.device("cpu")
    assert resolve_device("cpu", "training.device") == torch.device("cpu")
    for setting in ("cuda", "cuda:1"):
        with pytest.raises(ReinforgeError, match=rf"^generation.device={setting}, but this process sees 0 CUDA"):
            resolve_device(setting, "generation.device")
    with pytest.raises(ValueError, match="device"):
        GenerationConfig(device="gpu")  # not a device name: the config's own error


@without_a_gpu
def test_the_torch_backend_trains_where_training_device_says():
    backend = Backend(MODEL, TrainingConfig(device="auto"), OptimizerConfig(), SchedulerConfig(), 1)
    assert backend.device == torch.device("cpu")
    assert {p.device for p in backend.model.parameters()} == {torch.device("cpu")}


@without_a_gpu
def test_the_run_says_where_it_computes_in_one_line():
    config = load_recipe_config(RECIPES["grpo"].config_class, DEMO, [])
    assert check_devices(config) == "devices: training on cpu; generation by the HF engine on cpu"
    fsdp2 = load_recipe_config(RECIPES["grpo"].config_class, DEMO, ["training.backend=fsdp2", "training.num_workers=2"])
    assert check_devices(fsdp2) == (
        "devices: training on 2 FSDP2 rank(s), the CPU (gloo); generation by 1 HF engine(s) in Ray, on the CPU"
    )
    vllm = load_recipe_config(RECIPES["grpo"].config_class, DEMO, ["generation.backend=vllm", "generation.device=cuda"])
    with pytest.raises(ReinforgeError, match="^generation.device=cuda, but this process sees 0 CUDA"):
        check_devices(vllm)


@without_a_gpu
@pytest.mark.parametrize(
    "command,setting",
    [("grpo", "training.device=cuda"), ("grpo", "generation.device=cuda:0"), ("sft", "training.device=cuda")],
)
def test_an_absent_device_stops_the_run_before_its_directory(command, setting, tmp_path, capsys):
    config = DEMO if command == "grpo" else str(PROJECT_ROOT / "configs" / "sft_demo.yaml")
    here = "cluster.max_restarts=0"  # in this process, not a supervised child (as tests/e2e/test_cli.py)
    status = main([command, "--config", config, setting, here, f"logging.run_dir={tmp_path}/run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith(f"reinforge: error: {setting}, but this process")
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def engine_and_prompts(tmp_path_factory):
    """The demo model saved with a generation_config.json of strong sampling defaults, as hub checkpoints ship."""
    path = tmp_path_factory.mktemp("demo_with_defaults")
    model = load_model(MODEL)
    model.generation_config.update(
        top_k=2, top_p=0.5, temperature=0.3, repetition_penalty=1.5, min_p=0.3, no_repeat_ngram_size=2, do_sample=True
    )
    model.save_pretrained(path)
    tokenizer = load_tokenizer(MODEL)
    tokenizer.save_pretrained(path)
    config = ModelConfig(name_or_path=str(path))
    prompts = [
        render_prompt(r, tokenizer, "prompt", None, True)
        for r in read_jsonl(PROJECT_ROOT / "data" / "demo" / "val.jsonl")[:3]
    ]
    return HFGenerationBackend(load_model(config), tokenizer, 8, torch.device("cpu")), tokenizer, prompts


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.9, 7, 0.9)])
def test_logprobs_are_of_the_warped_sampling_distribution_not_the_checkpoints_defaults(
    engine_and_prompts, temperature, top_k, top_p
):
    """Each sampled token's logprob, recomputed by hand from the model's logits: divide by the temperature, keep
    the top_k largest, keep the smallest set of largest probabilities whose mass reaches top_p (the token that
    crosses top_p kept), renormalise. The checkpoint's saved sampling defaults (top_k=2, top_p=0.5, temperature=0.3,
    repetition_penalty=1.5, min_p=0.3, no_repeat_ngram_size=2) must not apply: under them the recomputation below
    would differ."""
    engine, tokenizer, prompts = engine_and_prompts
    params = SamplingParams(max_new_tokens=24, temperature=temperature, top_k=top_k, top_p=top_p, num_samples=2)
    trajectories = generate_trajectories(prompts, engine, params, tokenizer)
    batch = collate(trajectories, [0.0] * len(trajectories), tokenizer.pad_token_id)
    with torch.no_grad():
        logits_BTV = engine.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    scores_BTV = logits_BTV[:, :-1] / temperature
    if top_k > 0:
        kth = scores_BTV.topk(top_k, dim=-1).values[..., -1:]
        scores_BTV = scores_BTV.masked_fill(scores_BTV < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = scores_BTV.softmax(-1).sort(dim=-1, descending=True)
        mass_before = probs.cumsum(-1) - probs  # a token is kept while the mass before it is below top_p
        drop = torch.zeros_like(scores_BTV, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)
        scores_BTV = scores_BTV.masked_fill(drop, float("-inf"))
    expected_BT = torch.log_softmax(scores_BTV, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    expected_BT = torch.nn.functional.pad(expected_BT, (1, 0)).where(batch.loss_mask.bool(), 0.0)
    torch.testing.assert_close(batch.gen_logprobs, expected_BT, atol=1e-4, rtol=0)
    assert torch.isfinite(batch.gen_logprobs).all()
