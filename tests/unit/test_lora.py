"""LoRA (training/lora.py) against PEFT's own model on the same weights: the training backend's packed,
prompt-sharing, chunked-head passes with adapters give PEFT's logprobs and gradients; a fresh adapter
is the base model; the merged refit weights are PEFT's `merge_and_unload`; the reference is the base."""

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from reinforge.data.batch import Trajectory, collate
from reinforge.model_config import LoraConfig, ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.heads import LogprobHead
from reinforge.training.lora import adapter_state_dict, merge_lora_weights, scaling
from reinforge.training.micro_batching import token_logprobs
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.state import model_state_dict

LORA = LoraConfig(rank=4, alpha=8.0, target_modules="all-linear")
TEMPERATURE = 0.7


def make_batch(num_rows=8, group_size=4, seed=0):
    """Groups of `group_size` samples sharing a prompt (the backend shares them in its rows), varied lengths."""
    gen = torch.Generator().manual_seed(seed)
    trajectories = []
    for row in range(num_rows):
        if row % group_size == 0:
            prompt = torch.randint(2, 64, (3 + row % 5,), generator=gen).tolist()
        response = torch.randint(2, 64, (2 + (row * 5) % 7,), generator=gen).tolist()
        trajectories.append(Trajectory(prompt, response, [0.0] * len(response), False, 0.0, row // group_size, "math"))
    return collate(trajectories, torch.randn(num_rows, generator=gen).tolist(), pad_token_id=0)


def lora_backend(model_dir, lora=LORA, load_reference=False) -> Backend:
    torch.manual_seed(0)
    return Backend(
        ModelConfig(name_or_path=str(model_dir), lora=lora),
        TrainingConfig(micro_batch_size=4, global_batch_size=8, micro_batch_tokens=40),
        OptimizerConfig(lr=1e-2),
        SchedulerConfig(),
        num_optimizer_steps=10,
        head=LogprobHead(TEMPERATURE),
        load_reference=load_reference,
    )


def randomise_adapters(backend: Backend) -> dict[str, torch.Tensor]:
    """Non-zero B (PEFT starts it at 0), so that the adapters change the outputs; returns the adapter state."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in backend.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator))
    return adapter_state_dict(backend.model)


def peft_reference(model_dir, adapters: dict[str, torch.Tensor]):
    """PEFT's own LoRA model on the same base weights and adapters, called the ordinary way."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules="all-linear", lora_dropout=0.0)
    )
    missing, unexpected = model.get_base_model().load_state_dict(adapters, strict=False)
    assert not unexpected and not [name for name in missing if "lora_" in name]
    return model


def plain_logprobs(model, batch) -> torch.Tensor:
    """One padded forward of the whole batch, no packing: logprobs on the loss mask."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return token_logprobs(logits, batch.input_ids, TEMPERATURE) * batch.loss_mask


def test_a_fresh_adapter_leaves_the_policy_equal_to_the_base_model(tiny_model_dir):
    backend, batch = lora_backend(tiny_model_dir), make_batch()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = plain_logprobs(base, batch)
    assert (backend.logprobs(batch) - expected).abs().max() <= 1e-5
    assert all(("lora_" in name) == parameter.requires_grad for name, parameter in backend.model.named_parameters())
    assert {id(p) for group in backend.optimizer.param_groups for p in group["params"]} == {
        id(p) for p in backend.trainable
    }


def test_logprobs_and_gradients_equal_pefts_own_on_the_same_weights(tiny_model_dir):
    """The backend's passes (micro-batches of <= 40 positions, shared prompts, chunked head) against PEFT's model
    called once on the padded batch; the loss is -sum(A_bt * logp_bt) / |M| (A_bt: the
    sequence's advantage on its trained tokens)."""
    backend, batch = lora_backend(tiny_model_dir), make_batch()
    adapters = randomise_adapters(backend)
    reference = peft_reference(tiny_model_dir, adapters)
    expected = plain_logprobs(reference, batch)
    mask = batch.loss_mask
    (-(expected * batch.advantages).sum() / mask.sum()).backward()
    ours = backend.logprobs(batch)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        assert (ours - plain_logprobs(base, batch)).abs().max() > 1e-2  # the adapters do change the policy
    assert (ours - expected.detach()).abs().max() <= 1e-5

    def loss_fn(logprobs_BT, micro, norm):
        return -(logprobs_BT * micro.advantages).sum() / norm.num_tokens, {}

    backend.optimizer.zero_grad()
    backend.accumulate_gradients(batch, loss_fn)
    theirs = dict(reference.get_base_model().named_parameters())
    for name, parameter in backend.model.named_parameters():
        if parameter.requires_grad:
            assert theirs[name].grad is not None and parameter.grad.abs().max() > 0
            assert (parameter.grad - theirs[name].grad).abs().max() <= 1e-5, name


def test_the_merged_refit_weights_are_pefts_merge_and_unload(tiny_model_dir):
    backend = lora_backend(tiny_model_dir)
    adapters = randomise_adapters(backend)
    ours = dict(backend.named_weights())
    theirs = peft_reference(tiny_model_dir, adapters).merge_and_unload().state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert (ours[name] - tensor).abs().max() <= 1e-6, name
    # computed afresh from the base: the backend's own base weights are untouched
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    state = backend.model.state_dict()
    assert torch.equal(
        state["model.layers.0.self_attn.q_proj.base_layer.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )


def test_merge_lora_weights_by_hand():
    """W = [[1, 0], [0, 1]], A = [[1, 2]] (r = 1), B = [[1], [0]], scale 0.5: W + 0.5 B A = [[1.5, 1], [0, 1]]."""
    state = {
        "m.base_layer.weight": torch.eye(2),
        "m.base_layer.bias": torch.ones(2),
        "m.lora_A.default.weight": torch.tensor([[1.0, 2.0]]),
        "m.lora_B.default.weight": torch.tensor([[1.0], [0.0]]),
        "norm.weight": torch.ones(2),
    }
    merged = merge_lora_weights(state, 0.5)
    assert set(merged) == {"m.weight", "m.bias", "norm.weight"}
    assert torch.equal(merged["m.weight"], torch.tensor([[1.5, 1.0], [0.0, 1.0]]))
    assert scaling(LoraConfig(rank=8, alpha=16)) == 2.0


def test_the_reference_policy_is_the_base_model_with_the_adapters_off(tiny_model_dir):
    backend, batch = lora_backend(tiny_model_dir, load_reference=True), make_batch()
    randomise_adapters(backend)
    assert backend.reference is None  # no second copy
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = plain_logprobs(base, batch)
    assert (backend.logprobs(batch, reference=True) - expected).abs().max() <= 1e-5
    assert (backend.logprobs(batch) - expected).abs().max() > 1e-2  # and the adapters are back on


def test_a_checkpoint_holds_the_adapter_and_its_optimizer_state_and_restores_them_exactly(tiny_model_dir, tmp_path):
    batch = make_batch()
    trained = lora_backend(tiny_model_dir)

    def loss_fn(logprobs_BT, micro, norm):
        return -(logprobs_BT * micro.advantages).sum() / norm.num_tokens, {}

    trained.train_step(batch, loss_fn)
    trained.save_state(tmp_path / "trainer")
    saved = model_state_dict(tmp_path / "trainer")
    assert saved and all("lora_" in name for name in saved)
    resumed = lora_backend(tiny_model_dir)
    resumed.load_state(tmp_path / "trainer")
    for backend in (trained, resumed):
        backend.train_step(batch, loss_fn)
    for (name, a), (_, b) in zip(trained.named_weights(), resumed.named_weights()):
        assert torch.equal(a, b), name


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="greater than 0"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError):
        LoraConfig(dropout=1.0)


def test_a_mamba_hybrid_adapts_every_linear_layer_but_its_mixers_output_projection(tmp_path):
    """PEFT refuses LoRA on a Mamba mixer's out_proj (and conv1d): all-linear leaves them out of Nemotron-H and adapts
    the rest (the mixer's in_proj, attention, the dense MLP: its up/down_proj are no MoE experts, for no block is
    "moe"); naming out_proj is one line before anything runs."""
    from model_families import build

    from reinforge.errors import ConfigError
    from reinforge.modeling import is_moe
    from reinforge.training.lora import check_lora, load_policy

    model_config = ModelConfig(name_or_path=str(build("nemotron_h", tmp_path)), lora=LoraConfig(rank=4))
    check_lora(model_config)
    model, _ = load_policy(model_config)
    adapted = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters() if ".lora_A" in name}
    assert adapted == {"in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"}
    assert not is_moe(model.config)
    with pytest.raises(ConfigError, match="'out_proj' is a Mamba mixer's"):
        check_lora(model_config.model_copy(update={"lora": LoraConfig(rank=4, target_modules=["out_proj", "q_proj"])}))
