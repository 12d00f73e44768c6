"""Shared fixtures: a tiny random Qwen2 saved in Hugging Face format.

`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`). Tests that must not
overlap with each other carry an xdist group, and a group runs on one worker, test after test:
- "ray": every test that starts Ray or vLLM (they watch for leftover Ray processes, and each takes
  the machine's CPUs);
- "sandbox": every test that starts sandboxes (some count the live sandbox processes);
- "fsdp2_worker": tests/unit/test_fsdp2_worker.py, test_tensor_parallel.py and test_reshard.py, whose module fixtures
  spawn worlds of gloo ranks (one file's after another's, never two worlds at once);
- "ulysses": tests/unit/test_ulysses.py, its world of two ranks once;
- "gym": every test that starts NeMo Gym processes (from .gym-venv, `make gym-venv`), so that each
  module's servers start once and share the cores with one other worker only.
Each worker keeps torch to one thread, and so do the processes it starts (OMP_NUM_THREADS), so that
the two workers share the cores instead of fighting over them.
"""

import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random Qwen2 (vocab 64) on disk, loadable with from_pretrained."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=1,
        pad_token_id=0,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path
