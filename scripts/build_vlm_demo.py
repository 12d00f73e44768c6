"""Build the vision-language demo model (models/vlm_demo) and its task data (data/vlm_demo).

The task: a 32x32 picture shows two 2-digit numbers, one above the other, drawn as digits (a 5x7 pixel font, each
digit in its own 16x16 quarter, with a random ink and paper colour and a shift of a pixel or two; no pixel noise, so
each PNG is ~200 bytes and the shipped data stay small); the prompt asks for their sum, answered as
"23 + 48 = 71. The answer is \\boxed{71}." and scored on the last \\boxed{}.

The model is an Idefics3 (the SmolVLM family, which runs in transformers and vLLM on this machine): its text model
is models/demo's (the 0.9M Qwen2 of the arithmetic demo, carried over as a Llama with q/k/v biases, the same
function), its vision tower a 2-layer ViT on 8x8 patches, and the projector turns each 2x2 block of patches (a
digit's quarter) into one image token: 4 tokens per picture. Supervised from random vision weights on a noisy
teacher that, as the text demo's, drops the carry of the units 60% of the time: greedy decoding is wrong on most
carry sums while samples are often right, room for RL (configs/grpo_vlm_demo.yaml).

Everything is seeded; `python scripts/build_vlm_demo.py` rebuilds the committed files (a few minutes on 2 CPU
cores). `--quick` makes a seconds-long smoke build.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import random
import re
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3Processor,
)
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

ROOT = Path(__file__).resolve().parents[1]
SEED = 0
DROP_PROB = 0.6  # chance that the teacher drops a needed carry
NUM_VAL, NUM_TRAIN, NUM_SFT, NUM_BENCH, NUM_PAIRS = 200, 2000, 8000, 100, 600
SIDE, CELL = 32, 16  # the picture and each digit's quarter, in pixels
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
PROMPTS = [
    "Add the two numbers in the image.",
    "What is the sum of the numbers in the picture?",
    "The image shows two numbers. Add them.",
    "Find the total of the two numbers shown.",
]
# Image prompts' chat template: a message's content is a string or a list of text and image parts
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}{{- '<image>' }}"
    "{%- else %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
FONT = {  # 5 wide, 7 high
    "0": ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],
    "1": ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    "2": ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
    "3": ["11110", "00001", "00001", "01110", "00001", "00001", "11110"],
    "4": ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],
    "5": ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],
    "6": ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],
    "7": ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],
    "8": ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],
    "9": ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],
}


# --- The task --------------------------------------------------------------------------------


def render(a: int, b: int, rng: random.Random) -> Image.Image:
    """a above b, each digit (5x7, drawn 2x) in its quarter, shifted by up to a pixel or two, random colours."""
    paper = np.array([rng.randint(170, 255) for _ in range(3)], dtype=np.float32)
    ink = np.array([rng.randint(0, 90) for _ in range(3)], dtype=np.float32)
    pixels = np.tile(paper, (SIDE, SIDE, 1))
    for index, digit in enumerate(f"{a:02d}{b:02d}"):
        top = (index // 2) * CELL + 1 + rng.randint(0, 1)
        left = (index % 2) * CELL + 3 + rng.randint(-1, 1)
        for y, line in enumerate(FONT[digit]):
            for x, bit in enumerate(line):
                if bit == "1":
                    pixels[top + 2 * y : top + 2 * y + 2, left + 2 * x : left + 2 * x + 2] = ink
    return Image.fromarray(pixels.astype(np.uint8))


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def teacher_sum(a: int, b: int, drop: bool) -> int:
    """a + b, or the teacher's bug: the carry of the units lost."""
    if drop and a % 10 + b % 10 >= 10:
        return (a // 10 + b // 10) * 10 + (a % 10 + b % 10) % 10
    return a + b


def solution(a: int, b: int, result: int) -> str:
    return f"{a} + {b} = {result}. The answer is \\boxed{{{result}}}."


def sample_problem(rng: random.Random) -> dict:
    a, b = rng.randint(10, 49), rng.randint(10, 49)
    return {"a": a, "b": b, "image": render(a, b, rng), "prompt": rng.choice(PROMPTS)}


# --- The model -------------------------------------------------------------------------------


def build_processor(tokenizer) -> Idefics3Processor:
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": SIDE}, max_image_size={"longest_edge": SIDE}, do_image_splitting=False
    )
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4)
    processor.chat_template = CHAT_TEMPLATE
    return processor


def build_model(text_model, tokenizer) -> Idefics3ForConditionalGeneration:
    """An Idefics3 whose text model is `text_model` (a Qwen2, as a Llama with q/k/v biases) and a random ViT."""
    qwen = text_model.config
    text = dict(
        model_type="llama",
        vocab_size=len(tokenizer),
        hidden_size=qwen.hidden_size,
        intermediate_size=qwen.intermediate_size,
        num_hidden_layers=qwen.num_hidden_layers,
        num_attention_heads=qwen.num_attention_heads,
        num_key_value_heads=qwen.num_key_value_heads,
        head_dim=qwen.hidden_size // qwen.num_attention_heads,
        max_position_embeddings=qwen.max_position_embeddings,
        rms_norm_eps=qwen.rms_norm_eps,
        rope_parameters=dict(qwen.rope_parameters),
        attention_bias=True,  # Qwen2's q/k/v biases; o_proj's starts at zero
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=SIDE, patch_size=8
    )
    config = Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
    )
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    model = Idefics3ForConditionalGeneration(config)
    weights = text_model.model.state_dict()
    embed = weights.pop("embed_tokens.weight")
    target = model.model.text_model
    with torch.no_grad():
        target.embed_tokens.weight[: len(embed)] = embed
        target.embed_tokens.weight[len(embed) :] = embed.mean(dim=0)
        missing, unexpected = target.load_state_dict(weights, strict=False)
        assert not unexpected and all(name.endswith("o_proj.bias") for name in missing if "embed" not in name)
        for layer in target.layers:
            layer.self_attn.o_proj.bias.zero_()
    return model


# --- Training and evaluation -------------------------------------------------------------------


def example(processor, problem: dict, answer: str) -> dict[str, torch.Tensor]:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": problem["prompt"]}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=[prompt + answer + "<|im_end|>"], images=[[problem["image"]]], return_tensors="pt")
    prompt_len = len(processor(text=[prompt], images=[[problem["image"]]])["input_ids"][0])
    labels = out["input_ids"].clone()
    labels[:, :prompt_len] = -100
    return {**out, "labels": labels}


def collate(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(e["input_ids"].shape[1] for e in examples)

    def pad(name: str, value: int) -> torch.Tensor:
        return torch.cat(
            [torch.nn.functional.pad(e[name], (0, width - e[name].shape[1]), value=value) for e in examples]
        )

    return {
        "input_ids": pad("input_ids", pad_id),
        "attention_mask": pad("attention_mask", 0),
        "labels": pad("labels", -100),
        "pixel_values": torch.cat([e["pixel_values"] for e in examples]),
        "pixel_attention_mask": torch.cat([e["pixel_attention_mask"] for e in examples]),
    }


def learning_rate(step: int, num_steps: int, peak_lr: float) -> float:
    warmup = max(1, num_steps // 20)
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    return peak_lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, num_steps - warmup))))


def sft(model, examples: list[dict], pad_id: int, num_steps: int, batch_size: int) -> None:
    """The vision tower and projector at 2e-3 (they start random), the text model at 3e-4 (it knows the format)."""
    vision = [p for n, p in model.named_parameters() if "text_model" not in n]
    text = [p for n, p in model.named_parameters() if "text_model" in n]
    peaks = [2e-3, 3e-4]
    optimizer = torch.optim.AdamW(
        [{"params": vision, "lr": peaks[0]}, {"params": text, "lr": peaks[1]}], betas=(0.9, 0.95), weight_decay=0.01
    )
    rng, order, start = random.Random(SEED), [], time.time()
    model.train()
    for step in range(num_steps):
        if len(order) < batch_size:
            order += rng.sample(range(len(examples)), len(examples))
        batch, order = [examples[i] for i in order[:batch_size]], order[batch_size:]
        for group, peak in zip(optimizer.param_groups, peaks):
            group["lr"] = learning_rate(step, num_steps, peak)
        loss = model(**collate(batch, pad_id)).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == num_steps - 1:
            print(f"sft step {step:4d}/{num_steps}  loss {loss.item():.4f}  {time.time() - start:4.0f}s", flush=True)
    model.eval()


def boxed(text: str) -> str | None:
    found = re.findall(r"\\boxed\{([^}]*)\}", text)
    return found[-1].strip() if found else None


@torch.no_grad()
def accuracy(model, processor, problems: list[dict], samples: int, temperature: float | None) -> float:
    """Share of right answers: greedy (temperature None), or `samples` samples per problem."""
    tokenizer, correct, total = processor.tokenizer, 0, 0
    for start in range(0, len(problems), 50):
        chunk = problems[start : start + 50]
        messages = [
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": p["prompt"]}]}] for p in chunk
        ]
        texts = [processor.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
        tokenizer.padding_side = "left"
        batch = processor(text=texts, images=[[p["image"]] for p in chunk], return_tensors="pt", padding=True)
        sampling = {"do_sample": False} if temperature is None else {"do_sample": True, "temperature": temperature}
        out = model.generate(**batch, max_new_tokens=32, num_return_sequences=samples, **sampling)
        replies = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        for index, reply in enumerate(replies):
            problem = chunk[index // samples]
            correct += boxed(reply) == str(problem["a"] + problem["b"])
            total += 1
    tokenizer.padding_side = "right"
    return correct / total


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def rl_records(problems: list[dict], image_dir: Path | None) -> list[dict]:
    """RL prompts with the true answer; images as PNG files in `image_dir` (paths relative to the data file) or,
    without one, inline as data URLs."""
    records = []
    for index, p in enumerate(problems):
        if image_dir is None:
            ref = data_url(p["image"])
        else:
            image_dir.mkdir(parents=True, exist_ok=True)
            p["image"].save(image_dir / f"{index:04d}.png", optimize=True)
            ref = f"{image_dir.name}/{index:04d}.png"
        records.append({"prompt": p["prompt"], "images": [ref], "answer": str(p["a"] + p["b"]), "task": "math"})
    return records


def write_benchmark(path: Path) -> None:
    """data/benchmarks/vlm_sums: 100 fresh pictures (their own seeded stream, so the model and its data do not
    depend on it) as an image + question + answer file for `reinforge eval --benchmark vlm_sums`."""
    rng = random.Random(SEED + 1)
    problems = [sample_problem(rng) for _ in range(NUM_BENCH)]
    records = [
        {"id": f"vlm_sums/{i}", "question": r["prompt"], "images": r["images"], "answer": r["answer"]}
        for i, r in enumerate(rl_records(problems, path / "images"))
    ]
    write_jsonl(path / "test.jsonl", records)


def write_preferences(data_dir: Path) -> None:
    """data/vlm_demo/preference_{train,val}.jsonl: carry sums (their own seeded stream), the right sum chosen over
    the teacher's carry-dropped one, the picture inline, for DPO on image pairs (configs/dpo_vlm_demo.yaml)."""
    rng = random.Random(SEED + 2)
    pairs = []
    while len(pairs) < NUM_PAIRS:
        p = sample_problem(rng)
        if p["a"] % 10 + p["b"] % 10 < 10:
            continue
        chosen, rejected = p["a"] + p["b"], teacher_sum(p["a"], p["b"], drop=True)
        pairs.append(
            {
                "prompt": p["prompt"],
                "images": [data_url(p["image"])],
                "chosen": solution(p["a"], p["b"], chosen),
                "rejected": solution(p["a"], p["b"], rejected),
            }
        )
    write_jsonl(data_dir / "preference_train.jsonl", pairs[100:])
    write_jsonl(data_dir / "preference_val.jsonl", pairs[:100])


def write_model_card(path: Path, stats: dict) -> None:
    (path / "README.md").write_text(
        f"""# reinforge vision-language demo model

An Idefics3 (the SmolVLM family) of {stats["parameters"] / 1e6:.2f}M parameters, float32, built by
`scripts/build_vlm_demo.py` so that reinforge's VLM GRPO demo runs on a laptop CPU. All data are synthetic.

- Text model: models/demo's 0.9M Qwen2 (hidden 128, 4 layers), carried over as a Llama with q/k/v biases, with the
  image special tokens added (`<fake_token_around_image>`, `<image>`, `<global-img>`, `<end_of_utterance>`).
- Vision tower: a 2-layer ViT (hidden 64) on 32x32 pictures cut into 8x8 patches; the projector joins each 2x2
  block of patches (one digit's quarter of the picture) into one image token: 4 image tokens per picture.
- Processor: Idefics3's (PIL image processor, longest edge 32, no image splitting, `image_seq_len` 4) and a chat
  template whose content may be a list of text and image parts.

**Task.** A picture of two 2-digit numbers (10-49), one above the other, and a question asking for their sum,
answered as `23 + 48 = 71. The answer is \\boxed{{71}}.`; scored on the last `\\boxed{{}}` (data/vlm_demo/).

**How it was built.** Supervised fine-tuning for {stats["sft_steps"]} steps (batch 64) on {NUM_SFT} pictures
answered by a noisy teacher that drops the carry of the units {DROP_PROB:.0%} of the time; vision tower and
projector from random weights, the text model from models/demo's.

**Accuracy on data/vlm_demo/val.jsonl** (true answers): greedy {stats["greedy"]:.3f} on {stats["num_eval"]}
prompts; temperature 1 {stats["sampled"]:.3f} ({stats["num_eval"]} prompts x 4 samples). Build time:
{stats["minutes"]:.1f} min on 2 CPU threads.

**Rebuild:** `python scripts/build_vlm_demo.py` (seeded; writes models/vlm_demo and data/vlm_demo).
"""
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--quick", action="store_true", help="tiny data and 5 steps: a smoke build")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "models" / "vlm_demo")
    parser.add_argument("--data-dir", type=Path, default=ROOT / "data" / "vlm_demo")
    parser.add_argument("--benchmark-dir", type=Path, default=ROOT / "data" / "benchmarks" / "vlm_sums")
    args = parser.parse_args()
    started = time.time()
    random.seed(SEED)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    num_val, num_train, num_sft = (20, 20, 64) if args.quick else (NUM_VAL, NUM_TRAIN, NUM_SFT)
    val = [sample_problem(rng) for _ in range(num_val)]
    train = [sample_problem(rng) for _ in range(num_train)]
    sft_problems = [sample_problem(rng) for _ in range(num_sft)]

    text_model = AutoModelForCausalLM.from_pretrained(ROOT / "models" / "demo", dtype=torch.float32)
    processor = build_processor(AutoTokenizer.from_pretrained(ROOT / "models" / "demo"))
    model = build_model(text_model, processor.tokenizer)
    sft_answers = [
        solution(p["a"], p["b"], teacher_sum(p["a"], p["b"], rng.random() < DROP_PROB)) for p in sft_problems
    ]
    examples = [example(processor, p, answer) for p, answer in zip(sft_problems, sft_answers)]
    num_steps = 5 if args.quick else args.sft_steps
    sft(model, examples, processor.tokenizer.pad_token_id, num_steps, batch_size=64)

    num_eval = min(100, len(val))
    stats = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft_steps": num_steps,
        "num_eval": num_eval,
        "greedy": accuracy(model, processor, val[:num_eval], 1, None),
        "sampled": accuracy(model, processor, val[:num_eval], 4, 1.0),
    }
    print(json.dumps(stats), flush=True)

    args.model_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=processor.tokenizer.eos_token_id, pad_token_id=processor.tokenizer.pad_token_id
    )
    model.save_pretrained(args.model_dir)
    processor.save_pretrained(args.model_dir)
    write_jsonl(args.data_dir / "train.jsonl", rl_records(train, None))
    write_jsonl(args.data_dir / "val.jsonl", rl_records(val, args.data_dir / "val_images"))
    sft_chats = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(p["image"])}},
                        {"type": "text", "text": p["prompt"]},
                    ],
                },
                {"role": "assistant", "content": answer},
            ]
        }
        for p, answer in list(zip(sft_problems, sft_answers))[:1000]
    ]
    write_jsonl(args.data_dir / "sft.jsonl", sft_chats)
    write_benchmark(args.benchmark_dir)
    write_preferences(args.data_dir)
    stats["minutes"] = (time.time() - started) / 60
    write_model_card(args.model_dir, stats)
    print(f"wrote {args.model_dir} and {args.data_dir} in {stats['minutes']:.1f} min", flush=True)


if __name__ == "__main__":
    main()
