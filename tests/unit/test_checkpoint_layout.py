"""The refit to vLLM sends the trainer's weights as the checkpoint on disk holds them: for every family of the
conformance matrix, exactly the tensors `save_pretrained` writes (tied weights also under their tied name unless
dropped); and the refit check's stacking of the sent experts gives back transformers' fused expert tensors."""

import sys

import pytest
import torch
from safetensors.torch import load_file

from reinforge.generation.checkpoint_layout import checkpoint_layout, engine_tensors, tied_names
from reinforge.paths import PROJECT_ROOT

sys.path.insert(0, str(PROJECT_ROOT / "tests"))
from model_families import FAMILIES, build  # noqa: E402


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_refit_sends_what_save_pretrained_writes(family, tmp_path):
    import transformers

    path = build(family, tmp_path / family)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    on_disk = load_file(str(path / "model.safetensors"))
    tied = tied_names(str(path)) if model.config.tie_word_embeddings else {}
    sent = checkpoint_layout(str(path), model.state_dict().items(), drop=tied)
    assert sorted(sent) == sorted(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(sent[name], tensor), name
    if tied:  # kept, the tied name carries its source's tensor
        kept = checkpoint_layout(str(path), model.state_dict().items())
        assert all(torch.equal(kept[target], kept[source]) for target, source in tied.items())


def test_the_sent_experts_stacked_are_transformers_fused_experts(tmp_path):
    import transformers

    path = build("mixtral", tmp_path / "mixtral")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sent = checkpoint_layout(str(path), model.state_dict().items())
    layer = "model.layers.1.block_sparse_moe.experts"
    experts = {  # as a vLLM worker names them (checkpoint_layout.engine_names)
        f"{layer}.routed_experts.w13_weight": {
            "w1": [f"{layer}.{e}.w1.weight" for e in range(4)],
            "w3": [f"{layer}.{e}.w3.weight" for e in range(4)],
        },
        f"{layer}.routed_experts.w2_weight": {"w2": [f"{layer}.{e}.w2.weight" for e in range(4)]},
    }
    named = engine_tensors(sent, {}, experts)
    fused = model.model.layers[1].mlp.experts
    assert torch.equal(named[f"{layer}.gate_up_proj"], fused.gate_up_proj)
    assert torch.equal(named[f"{layer}.down_proj"], fused.down_proj)
