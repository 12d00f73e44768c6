"""Build models/tinker_demo: the demo model fine-tuned to answer tinker-cookbook rl_loop's prompt.

rl_loop asks every question after a fixed few-shot turn (how many r's in strawberry) and with a suffix asking for a
`\\boxed{}` answer. The demo tokenizer (449 tokens, its words those of the demo's problems) spells that English out
letter by letter: 270 tokens, the question's numbers 100-130 tokens before the answer that copies them, where the
demo model (models/demo) only ever copied from at most ~70 back; it answers that prompt with garbage, and 300 steps
of fine-tuning on it still left it at 0.05 (its units digits wrong). So, as a real tokenizer has whole words for
them, the tokenizer gets three tokens of its own: the few-shot question, the few-shot answer and the suffix
(embeddings initialised at the mean of the others); rl_loop's prompt is then the demo prompt and 14 tokens.

The model is then supervised on the noisy teacher's answers (data/demo/sft.jsonl, mistakes kept: room for RL), with
RL_SHARE of the chats put in exactly the prompt rl_loop builds (rendered by the cookbook's own renderer for the name
the demo is served under, from the recipe's own strings: scripts/tinker_cookbook_data.py) and the rest left as plain
demo chats, so sl_loop's chats still fit. The training is reinforge's: the torch `Backend` and SFT's loss.

Seeded; `python scripts/build_tinker_demo_model.py` rebuilds models/tinker_demo in a few minutes on 2 CPU cores and
writes its README with the accuracy it measures. `--steps 2 --out DIR` makes a smoke build.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tinker_cookbook_data import DEMO_DATA, MODEL_NAME, ROOT, _read_jsonl, rl_loop_prompt, rl_loop_strings  # noqa: E402

from reinforge.algorithms.sft import nll_loss  # noqa: E402
from reinforge.data.batch import sequences_batch  # noqa: E402
from reinforge.model_config import ModelConfig  # noqa: E402
from reinforge.training.backend import Backend  # noqa: E402
from reinforge.training.base import TrainingConfig  # noqa: E402
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig  # noqa: E402

SEED = 0
BATCH_SIZE, PEAK_LR = 32, 1e-3
RL_SHARE = 0.5  # of the chats put in rl_loop's prompt; the plain ones keep the demo's own format
NUM_EVAL_PROMPTS, NUM_EVAL_SAMPLES, MAX_NEW_TOKENS = 100, 4, 48


def demo_tokenizer_with_phrases():
    """The demo tokenizer with rl_loop's few-shot question, few-shot answer and suffix as tokens of their own."""
    from tokenizers import AddedToken

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models" / "demo")
    prefix, suffix = rl_loop_strings()
    phrases = [prefix[0]["content"].removesuffix(suffix), prefix[1]["content"], suffix]
    tokenizer.add_tokens([AddedToken(phrase, normalized=False) for phrase in phrases])
    return tokenizer


def start_model(tokenizer, out: Path) -> None:
    """models/demo with embeddings for the new tokens (the mean of the others), saved at `out` with `tokenizer`."""
    model = AutoModelForCausalLM.from_pretrained(ROOT / "models" / "demo")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # keep chat_template in tokenizer_config.json


def renderer_for(tokenizer):
    """The renderer rl_loop and sl_loop pick for MODEL_NAME, over the demo tokenizer."""
    from tinker_cookbook import model_info, renderers

    return renderers.get_renderer(model_info.get_recommended_renderer_name(MODEL_NAME), tokenizer)


def prompt_ids(renderer, question: str, rl_format: bool) -> list[int]:
    """Token ids of the prompt rl_loop builds for `question` (rl_format), or of the plain demo chat's prompt."""
    convo = rl_loop_prompt(question) if rl_format else [{"role": "user", "content": question}]
    return renderer.build_generation_prompt(convo).to_ints()


def examples(tokenizer, renderer, chats: list[dict], rng: random.Random) -> list[tuple[list[int], list[float]]]:
    """Each chat as (ids, loss weights), the reply and its end-of-turn weighed; in rl_loop's prompt RL_SHARE of the
    time."""
    out = []
    for chat in chats:
        question, answer = chat["messages"][0]["content"], chat["messages"][1]["content"]
        prompt = prompt_ids(renderer, question, rl_format=rng.random() < RL_SHARE)
        reply = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        out.append((prompt + reply, [0.0] * len(prompt) + [1.0] * len(reply)))
    return out


def train(start: Path, chats: list[dict], tokenizer, renderer, num_steps: int) -> Backend:
    """Full fine-tuning of the model at `start` with AdamW, warm-up then cosine decay, on BATCH_SIZE chats a step."""
    backend = Backend(
        ModelConfig(name_or_path=str(start)),
        TrainingConfig(micro_batch_size=BATCH_SIZE, share_prompts=False),
        OptimizerConfig(lr=PEAK_LR, adam_beta2=0.95, weight_decay=0.01, max_grad_norm=1.0),
        SchedulerConfig(warmup_steps=max(1, num_steps // 20), lr_schedule="cosine"),
        num_steps,
    )
    rng, start = random.Random(SEED), time.time()
    data = examples(tokenizer, renderer, chats, rng)
    order: list[int] = []
    for step in range(num_steps):
        if len(order) < BATCH_SIZE:
            order += rng.sample(range(len(data)), len(data))
        batch, order = [data[i] for i in order[:BATCH_SIZE]], order[BATCH_SIZE:]
        metrics = backend.train_step(sequences_batch(batch, tokenizer.pad_token_id), nll_loss, step)
        if step % 20 == 0 or step == num_steps - 1:
            print(f"step {step:4d}/{num_steps}  loss {metrics['loss']:.4f}  {time.time() - start:4.0f}s", flush=True)
    return backend


@torch.no_grad()
def accuracy(model, tokenizer, renderer, records: list[dict], rl_format: bool, temperature: float | None) -> float:
    """Mean of rl_loop's own reward (its `get_reward`: the last \\boxed{} graded against `#### answer`) over the
    records' samples (NUM_EVAL_SAMPLES each at `temperature`; one greedy answer when it is None)."""
    from tinker_cookbook.recipes.rl_loop import get_reward

    model.eval()
    prompts = [prompt_ids(renderer, r["prompt"], rl_format) for r in records]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling = (
        {"do_sample": False, "num_return_sequences": 1}
        if temperature is None
        else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    samples = 1 if temperature is None else NUM_EVAL_SAMPLES
    outputs = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=MAX_NEW_TOKENS,
        **({"num_return_sequences": samples} | sampling),
    )
    texts = tokenizer.batch_decode(outputs[:, width:], skip_special_tokens=True)
    answers = [f"#### {r['answer']}" for r in records for _ in range(samples)]
    return sum(get_reward(text, answer) for text, answer in zip(texts, answers)) / len(texts)


def write_model_card(out: Path, stats: dict) -> None:
    rows = "\n".join(
        f"| {fmt} | {stats[f'{fmt}_greedy']:.3f} | {stats[f'{fmt}_sampled']:.3f} |" for fmt in ("rl_loop", "plain")
    )
    (out / "README.md").write_text(f"""# reinforge tinker demo model

The demo model (models/demo: a 0.91M-parameter Qwen2) fine-tuned to answer the prompt tinker-cookbook's `rl_loop`
builds: its few-shot turn (how many r's in strawberry), then the question and " Provide a numerical answer without
units, written inside \\boxed{{}}.". The demo tokenizer spells that English letter by letter (270 tokens), which
put the question's numbers further back than the demo model ever copied from: it answered with garbage, and 300
steps of fine-tuning on it left it at 0.05. So its tokenizer has three more tokens, the few-shot question, the
few-shot answer and the suffix (452 in all; their embeddings started at the others' mean), and rl_loop's prompt is
{stats["rl_prompt_tokens"]:.0f} tokens on average.

Built by `scripts/build_tinker_demo_model.py` with reinforge's torch training backend and SFT loss: {stats["steps"]}
steps of {BATCH_SIZE} of the noisy teacher's chats (data/demo/sft.jsonl, its dropped carries kept: room for RL),
{RL_SHARE:.0%} of them in rl_loop's prompt as the cookbook's `qwen3_instruct` renderer writes it, the others as plain
demo chats (sl_loop's format). The Tinker server serves it under the name `{MODEL_NAME}`
(configs/tinker_cookbook.yaml), for which the cookbook picks that renderer; scripts/run_tinker_cookbook.py registers
this tokenizer under that name in the cookbook's tokenizer registry.

**Accuracy** (rl_loop's own reward, `get_reward`: the last `\\boxed{{}}` against the true answer) on the first
{NUM_EVAL_PROMPTS} problems of data/demo/val.jsonl, at most {MAX_NEW_TOKENS} new tokens:

| prompt | greedy | temperature 1 ({NUM_EVAL_SAMPLES} samples each) |
|---|---|---|
{rows}

Build time: {stats["build_seconds"] / 60:.1f} min on {torch.get_num_threads()} CPU threads (cores shared with
other jobs).
**Rebuild:** `python scripts/build_tinker_demo_model.py` (seeded). Chat format and eos as models/demo.
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "models" / "tinker_demo")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    start = time.time()
    torch.manual_seed(SEED)
    torch.set_num_threads(2)  # the same thread count everywhere keeps the float arithmetic reproducible
    tokenizer = demo_tokenizer_with_phrases()
    renderer = renderer_for(tokenizer)
    chats = _read_jsonl(DEMO_DATA / "sft.jsonl")
    with tempfile.TemporaryDirectory() as start_dir:
        start_model(tokenizer, Path(start_dir))
        backend = train(Path(start_dir), chats, tokenizer, renderer, args.steps)
    model, val = backend.model, _read_jsonl(DEMO_DATA / "val.jsonl")[:NUM_EVAL_PROMPTS]
    lengths = [len(prompt_ids(renderer, r["prompt"], True)) for r in val]
    stats = {"steps": args.steps, "rl_prompt_tokens": sum(lengths) / len(lengths)}
    for fmt in ("rl_loop", "plain"):
        stats[f"{fmt}_greedy"] = accuracy(model, tokenizer, renderer, val, fmt == "rl_loop", None)
        stats[f"{fmt}_sampled"] = accuracy(model, tokenizer, renderer, val, fmt == "rl_loop", 1.0)
        print(f"{fmt} prompt: greedy {stats[f'{fmt}_greedy']:.3f}, temperature 1 {stats[f'{fmt}_sampled']:.3f}")
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    backend.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out, save_jinja_files=False)  # keep chat_template in tokenizer_config.json
    stats["build_seconds"] = time.time() - start
    write_model_card(args.out, stats)
    (args.out / "build_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(f"wrote {args.out} in {stats['build_seconds']:.0f}s")


if __name__ == "__main__":
    main()
