"""Shared fixtures: a tiny random Qwen2 and a tiny random Qwen3-MoE saved in Hugging Face format.

`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`). Tests that must not
overlap with each other carry an xdist group, and a group runs on one worker, test after test:
- "ray": every test that starts Ray or vLLM (they watch for leftover Ray processes, and each takes
  the machine's CPUs);
- "sandbox": every test that starts sandboxes (some count the live sandbox processes);
- "fsdp2_worker": tests/unit/test_fsdp2_worker.py, test_tensor_parallel.py, test_reshard.py and
  test_expert_parallel.py, whose module fixtures spawn worlds of gloo ranks (one file's after another's, never
  two worlds at once);
- "ulysses": tests/unit/test_ulysses.py, its world of two ranks once;
- "gym": every test that starts NeMo Gym processes (from .gym-venv, `make gym-venv`), so that each
  module's servers start once and share the cores with one other worker only.
Each worker keeps torch to one thread, and so do the processes it starts (OMP_NUM_THREADS), so that
the two workers share the cores instead of fighting over them.

`reinforge.cli.main([...])` of a training command starts its run in a supervised child process (a new interpreter,
seconds) unless `cluster.max_restarts=0` is among its overrides: a test of the command's own line or run passes it,
and leaves the supervisor's relay of that line to the tests that run the real CLI (tests/e2e/test_cli.py).
"""

import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM


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


def build_tiny_moe(path, **overrides):
    """A 2-layer random Qwen3-MoE (vocab 64, 4 experts, top-2, head_dim 32: a size vLLM's CPU attention takes)
    saved in `path`; `overrides` change its config."""
    torch.manual_seed(0)
    settings = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**(settings | overrides)))
    with torch.no_grad():  # transformers starts routers at zero (every expert tied); give them a choice to make
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory):
    """A 2-layer random Qwen3-MoE (`build_tiny_moe`) on disk, loadable with from_pretrained."""
    return build_tiny_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"))


# A chat template for image prompts: a message's content is a string or a list of text and image parts
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}{{- '<image>' }}"
    "{%- else %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """A random Idefics3 (a 2-layer Llama text model and a 2-layer vision tower on 32x32 images, 4 image tokens
    each) with its processor, built on the demo tokenizer; weights drawn wide enough that outputs vary."""
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    path = tmp_path_factory.mktemp("tiny_vlm")
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(__file__), "..", "models", "demo"))
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]}
    )
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": 32}, max_image_size={"longest_edge": 32}, do_image_splitting=False
    )
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4)
    processor.chat_template = VLM_CHAT_TEMPLATE
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    text = dict(
        model_type="llama",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
    )
    config = Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
    )
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.2)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
