"""Shared fixtures: a tiny random Qwen2 saved in Hugging Face format."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random Qwen2 (vocab 64) on disk, loadable with from_pretrained."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


# `make test` runs the suite on two pytest-xdist workers (--dist loadgroup). Each test file stays on one
# worker (its module fixtures are built once), and files that would see each other's processes run on
# the same worker, one after the other: the Ray tests check that no Ray process is left behind, and the
# sandbox tests check that no sandbox-uid process is left behind.
SERIAL_GROUPS = {
    "ray": {"test_fsdp2_grpo.py", "test_remote_engine.py"},
    "sandbox": {"test_sandbox.py", "test_code_env.py", "test_tool_use.py", "test_eval.py", "test_grpo_mixed_tasks.py"},
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = next((name for name, files in SERIAL_GROUPS.items() if item.path.name in files), item.path.name)
        item.add_marker(pytest.mark.xdist_group(group))
