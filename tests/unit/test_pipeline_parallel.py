"""Pipeline parallelism (training/parallel/pipeline.py): the stage split, and pipelined training on real gloo ranks
equal to one process.

The split: a Qwen2 with tied embeddings cut into 2 and 3 stages, its stages chained (each decoder starting from
the previous stage's output) give the whole model's logits, each stage holding only its own parameters under one
process's names.
"""

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from reinforge.training.parallel.pipeline import split_stage, stage_layers

pytestmark = pytest.mark.xdist_group("fsdp2_worker")


def tiny_qwen2(num_layers=4):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).eval()


def test_stage_layers_are_contiguous_and_earlier_stages_take_the_extra_layer():
    assert [list(stage_layers(5, 2, s)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_layers(7, 3, s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(stage_layers(4, 4, s)) for s in range(4)] == [[0], [1], [2], [3]]


@pytest.mark.parametrize("pp", [2, 3])
def test_stages_chained_equal_the_whole_model(pp):
    whole = tiny_qwen2(num_layers=5)
    ids = torch.randint(2, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    expected = whole(input_ids=ids, logits_to_keep=0).logits
    names = dict(whole.named_parameters())
    stages = [copy.deepcopy(whole) for _ in range(pp)]
    hidden, kept = None, []
    for index, model in enumerate(stages):
        stage = split_stage(model, index, pp)
        stage.received = hidden
        logits = model(input_ids=ids, logits_to_keep=0).logits
        stage.received, hidden = None, stage.take()
        own = {name for name, _ in model.named_parameters()}
        layers = {int(name.split(".")[2]) for name in own if name.startswith("model.layers.")}
        assert layers == set(stage.layers) and own <= set(names) | {"lm_head.weight"}
        assert ("model.embed_tokens.weight" in own) == (index == 0)
        assert ("model.norm.weight" in own) == ("lm_head.weight" in own) == (index == pp - 1)
        kept.append(own)
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=0)
    assert set().union(*kept) == set(names) | {"lm_head.weight"}  # every parameter on some stage (the tie copied)
    assert sum(len(own) for own in kept) == len(names) + 1
