"""Attention as each model family defines it, in every layout of the trainer (issue 42, items 1 and 5).

For every family of the conformance matrix (tests/model_families.py: windows of 8 tokens, soft-caps, sinks, query
scaling, MLA, multipliers, partial rotary, RoPE scalings, Mamba layers), the trainer's logprobs
(`Backend.logprobs`, the chunked LM head) in the padded, packed and shared-prompt layouts equal a plain transformers
forward of the same checkpoint (eager attention, float32, full logits) to 1e-5, on sequences of 10-33 tokens. And
each variant binds: the same weights with the variant taken away give logprobs more than 1e-3 away, so a layout that
ignored it would fail. The HF engine's own logprobs agree with the trainer's through the start-up probe, whose
prompts reach past the window.
"""

import pytest
import torch
from model_families import FAMILIES, build
from transformers import AutoModelForCausalLM

from reinforge.algorithms import consistency
from reinforge.data.batch import Trajectory, collate
from reinforge.data.prompts import Prompt
from reinforge.errors import ConfigError, ReinforgeError
from reinforge.generation.base import SamplingParams
from reinforge.generation.hf import HFGenerationBackend
from reinforge.model_config import ModelConfig
from reinforge.modeling import check_rope_scaling, load_model, load_tokenizer, shortest_window
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.heads import LogprobHead
from reinforge.training.logit_transform import logit_transform
from reinforge.training.micro_batching import token_logprobs
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig

TEMPERATURE = 0.7
LAYOUTS = {  # on the CPU, as the references are, also on a machine with a GPU
    "padded": dict(sequence_packing=False, share_prompts=False, device="cpu"),
    "packed": dict(sequence_packing=True, share_prompts=False, device="cpu"),
    "shared_prompt": dict(sequence_packing=True, share_prompts=True, device="cpu"),
}


def full_attention(config):
    if getattr(config, "layer_types", None):  # the window stays set, no layer uses it
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    else:
        config.sliding_window = None


def setting(**values):
    def edit(config):
        for name, value in values.items():
            setattr(config, name, value)

    return edit


# family: {variant: config edit that takes it away (same weights)}
VARIANTS = {
    "llama": {"llama3 RoPE": setting(rope_parameters=dict(rope_type="default", rope_theta=10000.0))},
    "mistral": {"window": full_attention},
    "qwen2": {"window": full_attention},
    "gemma2": {
        "window": full_attention,
        "attention soft-cap": setting(attn_logit_softcapping=None),
        "final soft-cap": setting(final_logit_softcapping=None),
        "query_pre_attn_scalar": setting(query_pre_attn_scalar=32),
    },
    "gemma3": {"window": full_attention, "final soft-cap": setting(final_logit_softcapping=None)},
    "phi3": {
        "partial rotary": setting(
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0)
        )
    },
    "granite": {
        "logits_scaling": setting(logits_scaling=1.0),
        "attention_multiplier": setting(attention_multiplier=32**-0.5),
    },
    "gpt_oss": {"window": full_attention, "sinks": None},  # None: the sinks' logits set to -inf
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return lambda name, edit=None, tag="": build(name, root / f"{name}{tag}", edit=edit)


def ragged_batch():
    """3 prompts of 6-13 tokens, 3 answers of 4-19 each: sequences of 10-33 tokens, past the windows of 8."""
    gen = torch.Generator().manual_seed(0)
    trajectories = []
    for group in range(3):
        prompt = torch.randint(3, 449, (int(torch.randint(6, 14, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(3):
            answer = torch.randint(3, 449, (int(torch.randint(4, 20, (1,), generator=gen)),), generator=gen).tolist()
            trajectories.append(Trajectory(prompt, answer, [0.0] * len(answer), False, 0.0, group, "math"))
    return collate(trajectories, [0.0] * len(trajectories), pad_token_id=0)


def plain_logprobs(path, batch, no_sinks=False):
    """The reference: the checkpoint through transformers alone, eager attention, full [B, T, V] logits."""
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    if no_sinks:
        for layer in model.model.layers:
            layer.self_attn.sinks.data.fill_(-torch.inf)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    return token_logprobs(logits, batch.input_ids, TEMPERATURE) * batch.loss_mask


def trainer_logprobs(path, batch, layout):
    config = TrainingConfig(global_batch_size=9, micro_batch_size=9, logprob_chunk_tokens=16, **LAYOUTS[layout])
    backend = Backend(
        ModelConfig(name_or_path=str(path)),
        config,
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=1,
        head=LogprobHead(TEMPERATURE),
    )
    return backend.logprobs(batch)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_layout_gives_the_models_own_logprobs_and_every_variant_binds(models, family):
    path, batch = models(family), ragged_batch()
    reference = plain_logprobs(path, batch)
    for layout in LAYOUTS:
        logprobs = trainer_logprobs(path, batch, layout)
        diff = (logprobs - reference).abs().max().item()
        assert diff < 1e-5, f"{family} {layout}: max |logprob diff| {diff:.2e}"
    for variant, edit in VARIANTS.get(family, {}).items():
        without = (
            plain_logprobs(path, batch, no_sinks=True)
            if edit is None
            else plain_logprobs(models(family, edit, tag=variant.replace(" ", "_")), batch)
        )
        assert (without - reference).abs().max() > 1e-3, f"{family}: {variant} does not bind at these lengths"


def test_the_padded_rows_of_a_recurrent_model_are_not_packed_and_its_context_parallelism_is_refused(models):
    from reinforge.training.micro_batching import model_layouts
    from reinforge.training.parallel.layout import ParallelConfig

    model = AutoModelForCausalLM.from_pretrained(models("nemotron_h"))
    config = model_layouts(model, TrainingConfig(global_batch_size=1, micro_batch_size=1))
    assert not config.sequence_packing and not config.share_prompts
    split = config.model_copy(update={"parallel": ParallelConfig(cp=2)})  # as an FSDP2 strategy resolves it
    with pytest.raises(ConfigError, match="recurrent .* set training.parallel.cp=1"):
        model_layouts(model, split)


def test_a_logit_transform_the_head_does_not_know_is_one_line(models):
    config = AutoModelForCausalLM.from_pretrained(models("llama")).config
    config.lm_head_multiplier = 2.0
    with pytest.raises(ConfigError, match=r"llama transforms its logits after the LM head \(lm_head_multiplier\)"):
        logit_transform(config)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_the_probe_reaches_past_the_window_and_the_hf_engine_agrees_in_every_layout(models, family):
    """The start-up probe's prompts are window + 1 tokens long (here from 3-token prompts), so every sampled
    token attends past the window: against the HF engine the mismatch is <= 1.001 in every layout, and a trainer
    that ignored the window (the same weights with full attention) fails the probe's gate."""
    path = models(family)
    model_config = ModelConfig(name_or_path=str(path))
    tokenizer = load_tokenizer(model_config)
    min_tokens = consistency.probe_tokens(model_config, max_prompt_tokens=64)
    assert min_tokens == shortest_window(model_config) + 1 == 9
    prompts = [Prompt({}, [], [5 + i, 17, 40 + i]) for i in range(4)]
    assert all(len(p.token_ids) == 9 for p in consistency.lengthened(prompts, min_tokens))
    engine = HFGenerationBackend(load_model(model_config), tokenizer, 8, torch.device("cpu"))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, num_samples=2, seed=3)
    errors = {}
    for layout, settings in LAYOUTS.items():
        config = TrainingConfig(global_batch_size=8, micro_batch_size=8, **settings)
        trainer = Backend(model_config, config, OptimizerConfig(lr=1e-3), SchedulerConfig(), num_optimizer_steps=1)
        errors[layout] = consistency.probe(prompts, engine, trainer, tokenizer, params, min_tokens)
    assert max(errors.values()) <= 1.001, errors
    windowless = ModelConfig(name_or_path=str(models(family, full_attention, tag="windowless")))
    trainer = Backend(
        windowless,
        TrainingConfig(global_batch_size=8, micro_batch_size=8, device="cpu"),
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=1,
    )
    assert consistency.probe(prompts, engine, trainer, tokenizer, params, min_tokens) > 1.01


def vocab_parallel_rank(rank, world_size, port, model_dir, out_dir):
    """This rank's logprobs and entropies from its half of an uneven vocabulary (449 rows), soft-capped and scaled."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from reinforge.training.micro_batching import head_chunk

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    weight, hidden, targets, transform = vocab_parallel_inputs()
    head = torch.nn.Linear(64, 449, bias=False)
    head.weight = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    logprobs, entropy = head_chunk(head, hidden, targets, TEMPERATURE, transform)
    torch.save((logprobs, entropy), out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


def vocab_parallel_inputs():
    from reinforge.training.logit_transform import LogitTransform

    gen = torch.Generator().manual_seed(4)
    weight, hidden = torch.randn(449, 64, generator=gen), torch.randn(10, 64, generator=gen)
    return weight, hidden, torch.randint(0, 449, (10, 3), generator=gen), LogitTransform(divisor=0.5, softcap=3.0)


def test_the_vocabulary_parallel_head_applies_the_models_logit_transform(tmp_path):
    """Two tensor-parallel ranks, each with its rows of the vocabulary, give the one-process head's logprobs and
    entropies under a soft-cap (Gemma) and a divisor (Granite), and those differ from the untransformed ones."""
    from test_fsdp2_worker import launch

    from reinforge.training.micro_batching import head_chunk

    weight, hidden, targets, transform = vocab_parallel_inputs()
    head = torch.nn.Linear(64, 449, bias=False)
    head.weight = torch.nn.Parameter(weight)
    expected = head_chunk(head, hidden, targets, TEMPERATURE, transform)
    assert (head_chunk(head, hidden, targets, TEMPERATURE)[0] - expected[0]).abs().max() > 1e-1
    for logprobs, entropy in launch(2, None, tmp_path, target=vocab_parallel_rank):
        torch.testing.assert_close(logprobs, expected[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, expected[1], atol=1e-5, rtol=0)


def test_longrope_past_its_original_length_is_one_line_and_dynamic_ntk_within_the_context_passes(models):
    """longrope's factors follow the batch's longest sequence (transformers), so a run that can pass
    original_max_position_embeddings is refused; dynamic NTK is plain RoPE up to max_position_embeddings."""
    longrope = dict(rope_type="longrope", rope_theta=1e4, partial_rotary_factor=0.5)
    longrope |= dict(short_factor=[1.0] * 8, long_factor=[2.0] * 8)  # rotary dims 32 x 0.5: 8 frequencies
    path = models("phi3", setting(rope_parameters=longrope, original_max_position_embeddings=64), tag="longrope")
    check_rope_scaling(ModelConfig(name_or_path=str(path)), 64, "data.max_seq_len=64")
    with pytest.raises(ReinforgeError, match="data.max_seq_len=65: sequences past the model's longrope original_max"):
        check_rope_scaling(ModelConfig(name_or_path=str(path)), 65, "data.max_seq_len=65")
    dynamic = dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)
    path = models("llama", setting(rope_parameters=dynamic), tag="dynamic")
    check_rope_scaling(ModelConfig(name_or_path=str(path)), 512, "data.max_seq_len=512")


def test_an_attention_variant_the_packed_layouts_do_not_do_is_one_line():
    from reinforge.data.packing import row_layout
    from reinforge.training.segment_attention import segment_attention

    layout = row_layout(torch.arange(6).view(1, 6), [6], [[0]], 0).to(torch.device("cpu"))
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ConfigError, match="Linear asks its attention for is_causal=False, which the packed layouts"):
        segment_attention(torch.nn.Linear(1, 1), q, q, q, None, attention_segments=layout.segments, is_causal=False)
    with pytest.raises(ConfigError, match="asks its attention for position_bias"):
        segment_attention(torch.nn.Linear(1, 1), q, q, q, None, attention_segments=layout.segments, position_bias=q)
    output, _ = segment_attention(torch.nn.Linear(1, 1), q, q, q, None, attention_segments=layout.segments)
    assert output.shape == (1, 6, 2, 4)
