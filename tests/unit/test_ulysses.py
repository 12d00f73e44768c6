"""Ulysses sequence parallelism (training/parallel/context.py) on 2 real gloo ranks equals one process, to 1e-5.

Every case runs a 4-head Qwen2 decoder on one layout: in one process with `forward_layout`, and on two
ranks with `ulysses_forward`, each rank holding half of every row's columns. From the rank's output the
same loss, sum over real tokens of <hidden, weight>, is computed in both ways the module offers:
`gather_sequence` (each rank gathers the whole rows) and `sum_over_group` (each rank its own tokens'
terms, summed). The gathered hidden states must equal one process's, and the parameter gradients,
summed over the ranks, one process's. The two ranks run every case once (module fixture).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from model_families import FAMILIES
from test_fsdp2_worker import launch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from reinforge.data.packing import padded_layout, row_layout
from reinforge.errors import ConfigError
from reinforge.modeling import enable_activation_checkpointing, exact_attention_setting
from reinforge.training.parallel.context import (
    check_heads,
    gather_sequence,
    sequence_chunk,
    sum_over_group,
    ulysses_forward,
)
from reinforge.training.segment_attention import forward_layout

pytestmark = pytest.mark.xdist_group("ulysses")

# name: (attention implementation, key/value heads, activation checkpointing, layout)
CASES = {
    "padded_sdpa": ("sdpa", 2, False, "padded"),
    "padded_eager_odd_width": ("eager", 2, False, "padded_odd"),
    "full_rows_sdpa_causal_flag_one_kv_head": ("sdpa", 1, False, "full"),
    "packed": ("sdpa", 2, False, "packed"),
    "packed_odd_width_eager_one_kv_head": ("eager", 1, False, "packed_odd"),
    "shared_prompt_odd_width": ("sdpa", 2, False, "shared"),
    "shared_prompt_activation_checkpointing": ("sdpa", 2, True, "shared"),
    # families of the matrix (tests/model_families.py), their attention as they load it (load_model): windows of 8
    # tokens on 10-15 token rows, Gemma 2's soft-caps, gpt-oss' sinks (one head per rank: each rank its head's sink)
    "mistral_window_padded": ("mistral", 1, False, "padded"),
    "mistral_window_packed": ("mistral", 1, False, "packed_odd"),
    "gemma2_padded": ("gemma2", 1, False, "padded_odd"),
    "gemma2_shared_prompt_activation_checkpointing": ("gemma2", 1, True, "shared"),
    "gpt_oss_sinks_packed": ("gpt_oss", 1, False, "packed"),
}


def make_model(attention: str, kv_heads: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if attention in FAMILIES:  # a family's tiny model, with the attention implementation load_model gives it
        config = FAMILIES[attention].config()
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **exact_attention_setting(config))
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        attn_implementation=attention,
    )
    return Qwen2ForCausalLM(config)


def make_layout(kind: str):
    """(layout, real [R, W] bool: the positions holding a sequence's token)."""
    ids = torch.randint(2, 64, (4, 10), generator=torch.Generator().manual_seed(1))
    if kind in ("padded", "padded_odd", "full"):
        lengths = {"padded": [10, 7, 4], "padded_odd": [9, 6, 3], "full": [8, 8]}[kind]
        width = max(lengths)
        mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        layout = padded_layout(ids[: len(lengths), :width] * mask, mask)
        return layout, mask.bool()
    if kind == "shared":  # one prompt of 4 tokens, answers of 3, 6, 2 and 4: rows 4+3+6 = 13 and 4+2+4 = 10 wide
        answers = [3, 6, 2, 4]
        ids = torch.cat([ids[:1, :4].expand(4, 4), ids[:, 4:]], dim=1)
        lengths, rows, prompts = [4 + a for a in answers], [[0, 1], [2, 3]], [4] * 4
        layout = row_layout(ids, lengths, rows, pad_token_id=0, prompt_lengths_B=prompts)
    else:  # packed 10+4 = 14 and 7+5 = 12 wide, or 10+5 = 15 and 7+4 = 11
        lengths = [10, 7, 5, 4]
        rows = [[0, 3], [1, 2]] if kind == "packed" else [[0, 2], [1, 3]]
        layout = row_layout(ids, lengths, rows, pad_token_id=0)
    real = torch.zeros(layout.num_slots, dtype=torch.bool)
    for b, length in enumerate(lengths):
        real[layout.token_index[b, :length]] = True
    return layout, real.view(layout.input_ids.shape)


def loss_weight(hidden_RWH: torch.Tensor) -> torch.Tensor:
    """Random, scaled so that gradients are of order 1 (float32 then holds them to about 1e-7)."""
    return torch.randn(hidden_RWH.shape, generator=torch.Generator().manual_seed(2)) / 64


def one_process(case: str):
    """(hidden states [R, W, H], {parameter: gradient}) of the one-process forward and loss."""
    attention, kv_heads, checkpointing, kind = CASES[case]
    model, (layout, real) = make_model(attention, kv_heads), make_layout(kind)
    if checkpointing:
        enable_activation_checkpointing(model)
    hidden = forward_layout(model.model, layout.to(torch.device("cpu"))).last_hidden_state
    (hidden * loss_weight(hidden) * real[..., None]).sum().backward()
    return hidden.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def two_ranks(case: str, group, way: str):
    """What `one_process` returns, from this rank's chunk: gathered, or summed over the ranks."""
    attention, kv_heads, checkpointing, kind = CASES[case]
    model, (layout, real) = make_model(attention, kv_heads), make_layout(kind)
    if checkpointing:
        enable_activation_checkpointing(model)
    width = layout.input_ids.shape[1]
    hidden_local = ulysses_forward(model.model, layout.to(torch.device("cpu")), group).last_hidden_state
    if way == "gather":
        hidden = gather_sequence(hidden_local, group, width)
        loss = (hidden * loss_weight(hidden) * real[..., None]).sum()
    else:  # each rank its own columns' terms, the others zero
        chunk = sequence_chunk(width, group)
        hidden_size = model.config.hidden_size
        weight = F.pad(loss_weight(torch.empty(*real.shape, hidden_size)), (0, 0, 0, chunk.padded_width - width))
        terms = (hidden_local * weight[:, chunk.start : chunk.end]).sum(-1)
        terms_RW = sum_over_group(F.pad(terms, (chunk.start, chunk.padded_width - chunk.end)), group)[:, :width]
        loss, hidden = (terms_RW * real).sum(), None
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            grads[name] = p.grad
    return (None if hidden is None else hidden.detach()), grads


def run_rank(rank, world_size, port, model_dir, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)))
    result = {(case, way): two_ranks(case, group, way) for case in CASES for way in ("gather", "sum")}
    torch.save(result, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch(2, None, tmp_path_factory.mktemp("ulysses"), target=run_rank)


@pytest.mark.parametrize("way", ["gather", "sum"])
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_one_process_hidden_states_and_gradients(ranks, case, way):
    hidden, grads = one_process(case)
    assert len(grads) == len(dict(make_model(CASES[case][0], CASES[case][1]).model.named_parameters()))
    for rank in range(2):
        rank_hidden, rank_grads = ranks[rank][(case, way)]
        if way == "gather":  # at the real tokens (a padded row's padding is in no segment under cp)
            real = make_layout(CASES[case][3])[1]
            torch.testing.assert_close(rank_hidden[real], hidden[real], atol=1e-5, rtol=0)
        assert rank_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(rank_grads[name], grad, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def test_the_layouts_cover_odd_widths_and_row_padding():
    widths = {kind: make_layout(kind)[0].input_ids.shape[1] for kind in ("padded", "padded_odd", "packed_odd")}
    assert widths == {"padded": 10, "padded_odd": 9, "packed_odd": 15}
    layout, real = make_layout("shared")
    assert layout.input_ids.shape == (2, 13) and int(real.sum()) == 13 + 10  # the prompt once per row
    assert not bool(make_layout("packed")[1].all())  # row 1 has padding at its end


def test_heads_that_do_not_split_over_the_ranks_are_a_config_error():
    check_heads(make_model("sdpa", 1).config, 4)
    with pytest.raises(ConfigError, match="cp=3 must divide the model's 4 attention heads"):
        check_heads(make_model("sdpa", 2).config, 3)
