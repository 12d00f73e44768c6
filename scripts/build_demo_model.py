"""Build the embedded demo model (models/demo) and its task data (data/demo).

The task: one- or two-step word problems with + and - on 2-digit numbers, answered as
"23 + 48 = 71. 71 - 15 = 56. The answer is \\boxed{56}.". The model is a 0.9M-parameter Qwen2 trained
from scratch on a *noisy teacher*: on each step that needs a carry (+) or a borrow (-) in the units
digit, the teacher drops it 60% of the time and goes on from its wrong result. The student learns the
teacher's mixture, so greedy decoding is wrong on most carry problems while sampling at temperature 1
is right about 40% of the time on each such step: partial accuracy (about 0.5 greedy) with a strong,
learnable reward signal for GRPO. The RL prompts (train.jsonl, val.jsonl) carry the true answer.

Everything is seeded; `python scripts/build_demo_model.py` rebuilds the committed files (about
5 minutes on 2 CPU cores). `--quick` makes a seconds-long smoke build for tests.
"""

import argparse
import json
import math
import random
import re
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen2Tokenizer

SEED = 0
DROP_PROB = 0.6  # chance that the teacher drops a needed carry/borrow
TWO_STEP_SHARE = 0.8  # two-step problems more often carry, which keeps greedy accuracy near 0.5
NUM_VAL, NUM_TRAIN, NUM_SFT = 200, 5000, 10000
VOCAB_SIZE = 512  # a cap: BPE runs out of merges on this small corpus at about 450
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# --- The task --------------------------------------------------------------------------------

PEOPLE = [
    ("Ann", "she"),
    ("Ben", "he"),
    ("Cara", "she"),
    ("Dev", "he"),
    ("Eva", "she"),
    ("Finn", "he"),
    ("Gina", "she"),
    ("Hugo", "he"),
    ("Ines", "she"),
    ("Jack", "he"),
]
ITEMS = ["coins", "apples", "stickers", "marbles", "books", "cards", "stamps", "shells", "pencils", "cookies"]
PLACES = ["box", "jar", "bag", "basket"]
# Verb phrases per framing and operation; "{n}" is the operand.
OWNER_VERBS = {
    "+": ["finds {n} more", "buys {n} more", "gets {n} more", "wins {n} more"],
    "-": ["gives away {n}", "loses {n}", "sells {n}", "trades away {n}"],
}
PLACE_VERBS = {"+": ["puts in {n} more", "adds {n} more"], "-": ["takes out {n}", "removes {n}"]}


def needs_carry(a: int, op: str, b: int) -> bool:
    """Whether the units digit carries (+) or borrows (-)."""
    return a % 10 + b % 10 >= 10 if op == "+" else a % 10 < b % 10


def apply_op(a: int, op: str, b: int, drop: bool) -> int:
    """a op b, or the teacher's bug: tens and units computed separately, the carry/borrow lost."""
    if not (drop and needs_carry(a, op, b)):
        return a + b if op == "+" else a - b
    if op == "+":
        return (a // 10 + b // 10) * 10 + (a % 10 + b % 10) % 10
    return (a // 10 - b // 10) * 10 + abs(a % 10 - b % 10)


def chain(numbers: list[int], ops: list[str], drops: list[bool]) -> list[int]:
    """Intermediate results of numbers[0] ops[0] numbers[1] ops[1] ..., left to right."""
    results = [numbers[0]]
    for op, b, drop in zip(ops, numbers[1:], drops):
        results.append(apply_op(results[-1], op, b, drop))
    return results[1:]


def sample_problem(rng: random.Random) -> dict:
    """One problem whose every teacher path (any carries dropped) stays within 2-digit numbers.

    Fixed-width numbers keep each digit of an equation at the same offset from its operands' digits,
    which a tiny model learns far sooner than a mix of 1-, 2- and 3-digit numbers.
    """
    num_ops = 2 if rng.random() < TWO_STEP_SHARE else 1
    while True:
        numbers = [rng.randint(10, 99) for _ in range(num_ops + 1)]
        ops = [rng.choice("+-") for _ in range(num_ops)]
        paths = [chain(numbers, ops, [bool(mask >> i & 1) for i in range(num_ops)]) for mask in range(2**num_ops)]
        if all(10 <= result <= 99 for path in paths for result in path):
            return {"numbers": numbers, "ops": ops, "prompt": render_prompt(rng, numbers, ops)}


def render_prompt(rng: random.Random, numbers: list[int], ops: list[str]) -> str:
    item = rng.choice(ITEMS)
    name, pronoun = rng.choice(PEOPLE)
    if rng.random() < 0.7:
        verbs = [rng.choice(OWNER_VERBS[op]).format(n=n) for op, n in zip(ops, numbers[1:])]
        opening = f"{name} has {numbers[0]} {item}. {pronoun.capitalize()} {verbs[0]}"
        question = f"How many {item} does {pronoun} have now?"
    else:
        place = rng.choice(PLACES)
        verbs = [rng.choice(PLACE_VERBS[op]).format(n=n) for op, n in zip(ops, numbers[1:])]
        opening = f"A {place} holds {numbers[0]} {item}. {name} {verbs[0]}"
        question = f"How many {item} are in the {place} now?"
    then = f", then {verbs[1]}" if len(verbs) > 1 else ""
    return f"{opening}{then}. {question}"


def solution(problem: dict, drops: list[bool]) -> str:
    """The worked answer, e.g. '23 + 48 = 71. 71 - 15 = 56. The answer is \\boxed{56}.'"""
    results = chain(problem["numbers"], problem["ops"], drops)
    lefts = [problem["numbers"][0]] + results[:-1]
    steps = [f"{a} {op} {b} = {r}." for a, op, b, r in zip(lefts, problem["ops"], problem["numbers"][1:], results)]
    return " ".join(steps) + f" The answer is \\boxed{{{results[-1]}}}."


def make_data(rng: random.Random, num_val: int, num_train: int, num_sft: int) -> tuple[list, list, list]:
    """Problems split three ways, disjoint by their arithmetic (numbers and operations).

    There are only about 6,500 one-step problems, so the later splits (train, then sft) hold
    somewhat fewer of them than TWO_STEP_SHARE asks.
    """
    seen, problems = set(), []
    while len(problems) < num_val + num_train + num_sft:
        problem = sample_problem(rng)
        key = (tuple(problem["numbers"]), tuple(problem["ops"]))
        if key not in seen:
            seen.add(key)
            problems.append(problem)
    val, train, sft = problems[:num_val], problems[num_val : num_val + num_train], problems[num_val + num_train :]
    sft_chats = []
    for p in sft:
        drops = [rng.random() < DROP_PROB for _ in p["ops"]]
        sft_chats.append(
            {
                "messages": [
                    {"role": "user", "content": p["prompt"]},
                    {"role": "assistant", "content": solution(p, drops)},
                ]
            }
        )
    return [rl_record(p) for p in train], [rl_record(p) for p in val], sft_chats


def rl_record(problem: dict) -> dict:
    answer = chain(problem["numbers"], problem["ops"], [False] * len(problem["ops"]))[-1]
    return {"prompt": problem["prompt"], "answer": str(answer), "task": "math"}


# --- Tokenizer and model ---------------------------------------------------------------------


def build_tokenizer(texts: list[str], vocab_size: int) -> Qwen2Tokenizer:
    """Byte-level BPE trained on the task text, returned as the Qwen2Tokenizer it will load as.

    transformers 5 rebuilds a qwen2 model's tokenizer from its vocab and merges with Qwen2's own
    normalizer and pre-tokenizer, whatever tokenizer.json says, so the BPE is trained with that same
    pipeline. Its split regex isolates every digit (`\\p{N}`): the model does arithmetic digit by digit.
    """
    pipeline = Qwen2Tokenizer().backend_tokenizer
    bpe = Tokenizer(models.BPE())
    bpe.normalizer, bpe.pre_tokenizer, bpe.decoder = pipeline.normalizer, pipeline.pre_tokenizer, pipeline.decoder
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    trained = json.loads(bpe.to_str())["model"]
    return Qwen2Tokenizer(
        vocab=trained["vocab"],
        merges=[tuple(merge) for merge in trained["merges"]],
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=None,
        extra_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def build_model(tokenizer: Qwen2Tokenizer) -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")  # beats sdpa at this size on CPU


# --- Supervised fine-tuning ------------------------------------------------------------------


def tokenize_chat(tokenizer, chat: dict) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and labels that are -100 except on the reply and its <|im_end|>.

    The prompt and the reply are tokenized apart and concatenated, as they are when the model generates.
    """
    prompt_ids = tokenizer.apply_chat_template(
        chat["messages"][:1], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    reply_ids = tokenizer.encode(chat["messages"][1]["content"]) + [tokenizer.eos_token_id]
    return prompt_ids + reply_ids, [-100] * len(prompt_ids) + reply_ids


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch of (ids, labels) to its longest sequence."""
    length = max(len(ids) for ids, _ in batch)
    return {
        "input_ids": torch.tensor([ids + [pad_id] * (length - len(ids)) for ids, _ in batch]),
        "labels": torch.tensor([labels + [-100] * (length - len(labels)) for _, labels in batch]),
        "attention_mask": torch.tensor([[1] * len(ids) + [0] * (length - len(ids)) for ids, _ in batch]),
    }


def learning_rate(step: int, num_steps: int, peak_lr: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10% of the peak."""
    num_warmup = max(1, num_steps // 20)
    if step < num_warmup:
        return peak_lr * (step + 1) / num_warmup
    progress = (step - num_warmup) / max(1, num_steps - num_warmup)
    return peak_lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def sft(
    model, examples: list[tuple[list[int], list[int]]], pad_id: int, num_steps: int, batch_size: int, peak_lr: float
) -> None:
    """Supervised fine-tuning with AdamW, epoch by epoch over shuffled examples; loss only on reply tokens.

    A peak learning rate of 2e-3 with warm-up trains this model well; a constant 3e-3 was seen to diverge.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.01)
    order, shuffler, start = [], random.Random(SEED), time.time()
    model.train()
    for step in range(num_steps):
        if len(order) < batch_size:
            order += shuffler.sample(range(len(examples)), len(examples))
        batch, order = [examples[i] for i in order[:batch_size]], order[batch_size:]
        lr = learning_rate(step, num_steps, peak_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(**collate(batch, pad_id)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == num_steps - 1:
            print(
                f"sft step {step:4d}/{num_steps}  loss {loss.item():.4f}  lr {lr:.2e}  {time.time() - start:4.0f}s",
                flush=True,
            )
    model.eval()


# --- Evaluation ------------------------------------------------------------------------------


def boxed_answer(text: str) -> str | None:
    matches = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return matches[-1].strip() if matches else None


@torch.no_grad()
def accuracy(model, tokenizer, records: list[dict], num_samples: int, temperature: float | None) -> float:
    """Fraction of completions whose last \\boxed{} is the true answer; greedy when temperature is None."""
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": record["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        for record in records
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    sampling = (
        {"do_sample": False}
        if temperature is None
        else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    outputs = model.generate(**batch, max_new_tokens=64, num_return_sequences=num_samples, **sampling)
    texts = tokenizer.batch_decode(outputs[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    answers = [record["answer"] for record in records for _ in range(num_samples)]
    return sum(boxed_answer(text) == answer for text, answer in zip(texts, answers)) / len(texts)


# --- Main ------------------------------------------------------------------------------------


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def write_model_card(out_model: Path, stats: dict) -> None:
    (out_model / "README.md").write_text(f"""# reinforge demo model

A {stats["num_params"] / 1e6:.2f}M-parameter Qwen2 (hidden 128, 4 layers, 2 heads of dim 64, float32,
tied embeddings) with a {stats["vocab_size"]}-token byte-level BPE tokenizer that splits every digit,
built from scratch by `scripts/build_demo_model.py` so that reinforge's GRPO demo runs on a laptop CPU.
All data are synthetic.

**Task.** One- or two-step word problems with + and - on 2-digit numbers (`data/demo/`), answered as
`23 + 48 = 71. 71 - 15 = 56. The answer is \\boxed{{56}}.` and scored on the last `\\boxed{{}}`.

**How it was built.** Supervised fine-tuning from random weights for {stats["sft_steps"]} steps on
`data/demo/sft.jsonl`, written by a noisy teacher that drops the carry (+) or borrow (-) in the units
digit {DROP_PROB:.0%} of the time on each step that needs one. The model learns that mixture, so greedy
decoding gets most carry problems wrong while samples at temperature 1 are often right: room for RL.

**Accuracy on data/demo/val.jsonl** (true answers): greedy {stats["greedy_accuracy"]:.3f} \
on {stats["num_greedy"]} prompts;
temperature 1 {stats["sampled_accuracy"]:.3f} on {stats["num_sample_prompts"]} prompts x 4 samples.

Mean length in tokens: prompt {stats["prompt_tokens"]:.0f} (chat template included), reply {stats["reply_tokens"]:.0f}
(`<|im_end|>` included). Build time: {stats["build_seconds"] / 60:.1f} min on {torch.get_num_threads()} CPU threads.

**Rebuild:** `python scripts/build_demo_model.py` (seeded; writes models/demo and data/demo).

Chat format (Qwen style, no system prompt): `<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`;
the reply ends with `<|im_end|>`, the eos token; `<|endoftext|>` pads.
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-model", type=Path, default=Path("models/demo"))
    parser.add_argument("--out-data", type=Path, default=Path("data/demo"))
    parser.add_argument("--sft-steps", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="tiny data and 5 steps: a smoke build for tests")
    args = parser.parse_args()
    start = time.time()
    torch.manual_seed(SEED)
    torch.set_num_threads(2)  # the same thread count everywhere keeps the float arithmetic reproducible
    num_val, num_train, num_sft = (20, 50, 200) if args.quick else (NUM_VAL, NUM_TRAIN, NUM_SFT)
    num_steps = 5 if args.quick else args.sft_steps

    train, val, sft_chats = make_data(random.Random(SEED), num_val, num_train, num_sft)
    for name, records in (("train", train), ("val", val), ("sft", sft_chats)):
        write_jsonl(args.out_data / f"{name}.jsonl", records)
    texts = [m["content"] for chat in sft_chats for m in chat["messages"]] + [r["prompt"] for r in train + val]
    tokenizer = build_tokenizer(texts + ["user", "assistant", "system"], VOCAB_SIZE)
    assert all(tokenizer.decode(tokenizer.encode(text)) == text for text in texts), "tokenizer does not round-trip"

    model = build_model(tokenizer)
    examples = [tokenize_chat(tokenizer, chat) for chat in sft_chats]
    num_reply_tokens = [sum(label != -100 for label in labels) for _, labels in examples]
    stats = {
        "num_params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "sft_steps": num_steps,
        "num_greedy": len(val),
        "num_sample_prompts": len(val[:100]),
        "prompt_tokens": sum(len(ids) for ids, _ in examples) / len(examples) - sum(num_reply_tokens) / len(examples),
        "reply_tokens": sum(num_reply_tokens) / len(examples),
    }
    print(
        f"{len(train)} train / {len(val)} val / {len(sft_chats)} sft problems; vocab {len(tokenizer)}; "
        f"{stats['num_params']:,} parameters"
    )
    sft(model, examples, tokenizer.pad_token_id, num_steps, batch_size=64, peak_lr=2e-3)

    stats["greedy_accuracy"] = accuracy(model, tokenizer, val, num_samples=1, temperature=None)
    stats["sampled_accuracy"] = accuracy(model, tokenizer, val[:100], num_samples=4, temperature=1.0)
    print(
        f"val greedy accuracy {stats['greedy_accuracy']:.3f}; "
        f"temperature-1 sampled accuracy {stats['sampled_accuracy']:.3f}"
    )

    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(args.out_model)
    tokenizer.save_pretrained(args.out_model, save_jinja_files=False)  # keep chat_template in tokenizer_config.json
    stats["build_seconds"] = time.time() - start
    write_model_card(args.out_model, stats)
    print(f"wrote {args.out_model} and {args.out_data} in {stats['build_seconds']:.0f}s")


if __name__ == "__main__":
    main()
