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

