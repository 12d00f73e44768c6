"""What scripts/run_tinker_cookbook.py sets up for tinker-cookbook's sl_loop and rl_loop, checked through the
recipes' own calls: their `load_dataset` names load the demo's data offline, the recipes' grader scores it, and the
renderer the cookbook picks for the served name writes the demo's chat template token for token."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from tinker_cookbook_data import MODEL_NAME, rl_loop_prompt, write_datasets  # noqa: E402

LOAD = """
import datasets
from tinker_cookbook.recipes.math_rl.math_env import extract_gsm8k_final_answer
chats = datasets.load_dataset("HuggingFaceH4/no_robots")["train"]
gsm8k = datasets.load_dataset("openai/gsm8k", "main")
print(len(chats), chats[0]["messages"][1]["role"], len(gsm8k["train"]), len(gsm8k["test"]))
print(gsm8k["train"][0]["question"], "|", extract_gsm8k_final_answer(gsm8k["train"][0]["answer"]))
"""


def test_the_recipes_load_dataset_calls_find_the_demo_data_offline(tmp_path):
    """The exact calls of sl_loop and rl_loop, in the directory the runner runs them in, with the hub off."""
    write_datasets(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "c")}
    done = subprocess.run([sys.executable, "-c", LOAD], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    counts, first = done.stdout.splitlines()[-2:]
    assert counts == "4000 assistant 5000 200"
    assert first == "A jar holds 86 pencils. Dev removes 38. How many pencils are in the jar now? | 48"


def test_the_cookbooks_renderer_for_the_served_name_writes_the_demo_template():
    """rl_loop's prompt and a demo chat as the cookbook renders them == the demo tokenizer's chat template; the stop
    sequence is its <|im_end|>; the recipe's grader gives a demo answer its reward."""
    from tinker_cookbook import model_info, renderers
    from tinker_cookbook.recipes.rl_loop import get_reward
    from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer, unregister_tokenizer
    from transformers import AutoTokenizer

    demo = AutoTokenizer.from_pretrained(ROOT / "models" / "tinker_demo")
    register_tokenizer(MODEL_NAME, lambda: demo)
    try:
        tokenizer = get_tokenizer(MODEL_NAME)
    finally:
        unregister_tokenizer(MODEL_NAME)
    renderer = renderers.get_renderer(model_info.get_recommended_renderer_name(MODEL_NAME), tokenizer)
    for convo in (rl_loop_prompt("Ann has 12 coins. She finds 9 more."), [{"role": "user", "content": "Hi"}]):
        expected = demo.apply_chat_template(convo, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert renderer.build_generation_prompt(convo).to_ints() == expected
    # models/tinker_demo's phrase tokens: rl_loop's prompt is the plain one and 14 tokens (few-shot turn 13, suffix 1)
    assert len(renderer.build_generation_prompt(rl_loop_prompt("Hi")).to_ints()) == len(expected) + 14
    assert renderer.get_stop_sequences() == [demo.eos_token_id]
    answer = demo.encode("12 + 9 = 21. The answer is \\boxed{21}.") + [demo.eos_token_id]
    message, _ = renderer.parse_response(answer)
    assert get_reward(renderers.get_text_content(message), "#### 21") == 1.0
    assert get_reward(renderers.get_text_content(message), "#### 22") == 0.0
