"""Build the tool-using demo model (models/tool_demo) and its data (data/tool_demo).

The task is the demo's (scripts/build_demo_model.py: one- or two-step word problems with + and - on
2-digit numbers), now with a `calculator` tool offered in every conversation. The teacher calls it on
TOOL_SHARE of the problems, chosen at random and so unpredictable from the prompt: one call with the
problem's expression (`57 + 34 - 49`), then, after the tool's exact result, `The answer is \\boxed{42}.`.
On the other problems it answers directly with the demo's noisy worked solution (each needed carry or
borrow dropped with probability DROP_PROB). The student learns that mixture: its first token is
`<tool_call>` with probability about TOOL_SHARE, so greedy decoding answers directly (about half right,
as the demo model) while samples at temperature 1 call the tool about TOOL_SHARE of the time and are then
almost always right. RL through the tool loop can raise both the call rate and the accuracy.

Everything is rendered by reinforge's own renderer (`reinforge.data.templates.render_messages`) with the
calculator tool, as the serving layer renders requests; SFT trains on the assistant turns only, found by
the prefix diff of `reinforge.data.chat.chat_segments`. The problems are the demo's seeded stream, so
val.jsonl holds the same 200 problems as data/demo/val.jsonl.

Seeded; `python scripts/build_tool_demo_model.py` rebuilds the committed files (SFT runs at about 0.37 s
a step on 2 free CPU cores, so about 8 minutes in all; the committed build took 16 on 2 cores shared with
a test suite). `--quick` makes a seconds-long smoke build for tests.
"""

import argparse
import itertools
import json
import math
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tokenizers import AddedToken
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_demo_model as base  # noqa: E402
from build_preference_data import demo_problem_stream  # noqa: E402

from reinforge.data.chat import chat_segments  # noqa: E402
from reinforge.data.templates import render_ids, render_messages  # noqa: E402
from reinforge.data.tool_calls import ToolCall, parse_tool_calls  # noqa: E402
from reinforge.envs.tool_use import calculate  # noqa: E402
from reinforge.rollout.rollout import observation_token_ids  # noqa: E402

TOOL_SHARE = 0.3  # chance that the teacher calls the calculator; the student's sampled call rate
SFT_STEPS = 1000
TEACHER_SEED = base.SEED + 1  # the teacher's choices, apart from the problem stream's seed
VOCAB_SIZE = 640  # a cap, as in the demo; the tool-call JSON adds words to merge
MAX_NEW_TOKENS = 48  # per turn
NUM_SAMPLE_PROMPTS, NUM_SAMPLES = 100, 4  # the temperature-1 evaluation
EVAL_METRICS = ["accuracy", "tool_call_rate", "tool_result_correct_rate", "tool_accuracy", "direct_accuracy"]
TOOL_CALL_TOKENS = ["<tool_call>", "</tool_call>"]
CALCULATOR_TOOL = {
    "type": "function",
    "name": "calculator",
    "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    "strict": True,
}
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for tool in tools %}{{- ' ' + tool.function.name }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role == 'assistant' and message.tool_calls %}\n"
    "{{- '<|im_start|>assistant\\n' + message.content }}\n"
    '{%- for call in message.tool_calls %}{{- \'<tool_call>{"name": "\' + call.function.name + \'", "arguments": \' + '
    "(call.function.arguments if call.function.arguments is string else call.function.arguments | tojson) "
    "+ '}</tool_call>' }}"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# --- Data ------------------------------------------------------------------------------------


def expression(problem: dict) -> str:
    """The problem's numbers and operators left to right, e.g. '57 + 34 - 49'."""
    pieces = [str(problem["numbers"][0])]
    for op, number in zip(problem["ops"], problem["numbers"][1:]):
        pieces += [op, str(number)]
    return " ".join(pieces)


def final_answer(answer: str) -> str:
    return f"The answer is \\boxed{{{answer}}}."


def teacher_chat(problem: dict, rng: random.Random) -> dict:
    """The teacher's conversation in OpenAI chat form: a calculator call on TOOL_SHARE of the problems, else
    the demo's noisy worked solution."""
    user = {"role": "user", "content": problem["prompt"]}
    if rng.random() < TOOL_SHARE:
        answer = base.rl_record(problem)["answer"]
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression(problem)})},
        }
        messages = [
            user,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": answer},
            {"role": "assistant", "content": final_answer(answer)},
        ]
    else:
        drops = [rng.random() < base.DROP_PROB for _ in problem["ops"]]
        messages = [user, {"role": "assistant", "content": base.solution(problem, drops)}]
    return {"tools": [CALCULATOR_TOOL], "messages": messages}


def gym_row(problem: dict) -> dict:
    """A NeMo Gym row (`responses_create_params`) with reinforge's `answer` and `task`."""
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": problem["prompt"]}],
            "tools": [CALCULATOR_TOOL],
        },
        "answer": base.rl_record(problem)["answer"],
        "task": "tool_use",
    }


def make_data(num_val: int, num_train: int, num_sft: int) -> tuple[list, list, list]:
    """The demo's problem stream split val, train, sft (disjoint by their arithmetic, as in the demo)."""
    problems = list(itertools.islice(demo_problem_stream(random.Random(base.SEED)), num_val + num_train + num_sft))
    teacher = random.Random(TEACHER_SEED)
    sft_chats = [teacher_chat(problem, teacher) for problem in problems[num_val + num_train :]]
    return (
        [gym_row(p) for p in problems[num_val : num_val + num_train]],
        [gym_row(p) for p in problems[:num_val]],
        sft_chats,
    )


# --- Tokenizer and SFT examples --------------------------------------------------------------


def message_texts(chat: dict) -> list[str]:
    """What a chat says, as the template shows it: contents and each tool call's JSON."""
    texts = [message["content"] for message in chat["messages"] if message["content"]]
    for message in chat["messages"]:
        for call in message.get("tool_calls", []):
            arguments = json.loads(call["function"]["arguments"])
            texts.append(json.dumps({"name": call["function"]["name"], "arguments": arguments}))
    return texts


def build_tokenizer(texts: list[str]):
    """The demo's byte-level BPE (trained on these texts), with this chat template and the tool-call tags as
    added tokens: one id each, never split, and not special, so decoding with skip_special_tokens keeps them."""
    tokenizer = base.build_tokenizer(texts + ["user", "assistant", "system", "tool", "Tools: calculator"], VOCAB_SIZE)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_CALL_TOKENS])
    return tokenizer


def tokenize_chat(tokenizer, chat: dict) -> tuple[list[int], list[int]]:
    """Token ids of the conversation and labels that are -100 except on each assistant turn and its <|im_end|>.

    The pieces come from reinforge's prefix diff (`chat_segments`) over `render_messages` with the chat's
    tools, and are tokenized apart and concatenated, as generation sees them.
    """
    renderer = SimpleNamespace(
        apply_chat_template=lambda messages, tokenize, add_generation_prompt: render_messages(
            tokenizer, messages, chat["tools"], add_generation_prompt
        )
    )  # chat_segments renders through this
    ids, labels = [], []
    for text, trained in chat_segments(chat["messages"], renderer):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained else [-100] * len(piece)
    return ids, labels


# --- Evaluation through the tool loop --------------------------------------------------------


@torch.no_grad()
def generate(
    model, tokenizer, prompts: list[list[int]], num_samples: int, temperature: float | None
) -> list[list[int]]:
    """One turn: num_samples completions per prompt (prompt-major), each up to and including its <|im_end|>."""
    length = max(map(len, prompts))
    batch = {
        "input_ids": torch.tensor([[tokenizer.pad_token_id] * (length - len(ids)) + ids for ids in prompts]),
        "attention_mask": torch.tensor([[0] * (length - len(ids)) + [1] * len(ids) for ids in prompts]),
    }
    sampling = (
        {"do_sample": False}
        if temperature is None
        else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    outputs = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, num_return_sequences=num_samples, **sampling)
    completions = []
    for ids in outputs[:, length:].tolist():
        end = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids else len(ids)
        completions.append(ids[:end])
    return completions


def run_call(call: ToolCall | str) -> str:
    """The calculator's answer to one parsed call, or the error a tool would report."""
    if isinstance(call, str):
        return call
    if call.name != "calculator" or not isinstance(call.arguments.get("expression"), str):
        return 'error: the tool is calculator, called with {"expression": "..."}'
    try:
        return calculate(call.arguments["expression"])
    except ValueError as exc:
        return f"error: {exc}"


def evaluate(model, tokenizer, rows: list[dict], num_samples: int, temperature: float | None) -> dict[str, float]:
    """Episodes of up to two turns: turn 1 from the rendered prompt; when it calls tools, their results are
    appended as the rollout appends them and turn 2 answers. Scored on the final turn's last \\boxed{}."""
    prompts = [
        render_ids(tokenizer, row["responses_create_params"]["input"], row["responses_create_params"]["tools"])
        for row in rows
    ]
    contexts = [ids for ids in prompts for _ in range(num_samples)]
    answers = [row["answer"] for row in rows for _ in range(num_samples)]
    turns = generate(model, tokenizer, prompts, num_samples, temperature)
    finals = [tokenizer.decode(ids, skip_special_tokens=True) for ids in turns]
    calls = {i: episode_calls for i, episode_calls in enumerate(map(parse_tool_calls, finals)) if episode_calls}
    results = {i: [run_call(call) for call in episode_calls] for i, episode_calls in calls.items()}
    continued = [
        contexts[i]
        + turns[i]
        + observation_token_ids(
            tokenizer,
            [{"role": "tool", "content": result} for result in results[i]],
            ended_with_eos=turns[i][-1:] == [tokenizer.eos_token_id],
            max_tokens=256,
        )
        for i in calls
    ]
    if continued:
        for i, ids in zip(calls, generate(model, tokenizer, continued, 1, temperature)):
            finals[i] = tokenizer.decode(ids, skip_special_tokens=True)
    correct = [base.boxed_answer(text) == answer for text, answer in zip(finals, answers)]
    num_episodes, num_tool = len(correct), len(calls)
    return {
        "accuracy": sum(correct) / num_episodes,
        "tool_call_rate": num_tool / num_episodes,
        "tool_result_correct_rate": sum(answers[i] in results[i] for i in calls) / num_episodes,
        "tool_accuracy": sum(correct[i] for i in calls) / num_tool if num_tool else float("nan"),
        "direct_accuracy": (sum(correct) - sum(correct[i] for i in calls)) / (num_episodes - num_tool)
        if num_episodes > num_tool
        else float("nan"),
    }


# --- Main ------------------------------------------------------------------------------------


def write_data_readme(out_data: Path, sizes: dict[str, int]) -> None:
    (out_data / "README.md").write_text(f"""# Tool-use demo data

Synthetic arithmetic word problems with a calculator tool, written by `scripts/build_tool_demo_model.py`
(seeded; rebuilt bit-identically). Part of this project, under its license. The problems are the demo's
(data/demo/README.md), from the same seeded stream: `val.jsonl` holds the 200 problems of data/demo/val.jsonl.

- `train.jsonl` ({sizes["train"]:,}) and `val.jsonl` ({sizes["val"]}): GRPO prompts as NeMo Gym rows plus
  reinforge's fields, the answer always the true result:

      {{"responses_create_params": {{"input": [{{"role": "user", "content": "Ann has 57 stickers. ..."}}],
                                   "tools": [{{"type": "function", "name": "calculator", ...}}]}},
       "answer": "42", "task": "tool_use"}}

- `sft.jsonl` ({sizes["sft"]:,}): the conversations models/tool_demo was supervised on, in OpenAI chat form
  with their `tools`. On {TOOL_SHARE:.0%} of the problems (a seeded coin) the teacher calls the calculator
  (assistant `content` null, one `tool_calls` entry `call_0` whose `arguments` is the JSON string
  `{{"expression": "57 + 34 - 49"}}`), gets the exact result as a `tool` message and answers
  `The answer is \\boxed{{42}}.`; on the others it answers directly with the demo's noisy worked
  solution (each carry/borrow it needs dropped with probability {base.DROP_PROB}).

The three files share no problem.
""")


def table_cell(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"  # nan: no episodes of that kind


def write_model(out_model: Path, model, tokenizer, stats: dict) -> None:
    """The model and tokenizer in Hugging Face format, and the model card."""
    model.save_pretrained(out_model)
    tokenizer.save_pretrained(out_model, save_jinja_files=False)  # keep chat_template in tokenizer_config.json
    table = "\n".join(
        f"| {label} | {size} | " + " | ".join(table_cell(stats[name][key]) for key in EVAL_METRICS) + " |"
        for name, label, size in (
            ("greedy", "greedy", f"{stats['num_greedy']} x 1"),
            ("sampled", "temperature 1", f"{stats['num_sample_prompts']} x {NUM_SAMPLES}"),
        )
    )
    (out_model / "README.md").write_text(f"""# reinforge tool-use demo model

A {stats["num_params"] / 1e6:.2f}M-parameter Qwen2 (hidden 128, 4 layers, 2 heads of dim 64, float32,
tied embeddings) with a {stats["vocab_size"]}-token byte-level BPE tokenizer that splits every digit and
has `<tool_call>` and `</tool_call>` as added, non-special tokens, built from scratch by
`scripts/build_tool_demo_model.py` for reinforge's agent/tool-use GRPO demo on a CPU. All data are synthetic.

**Task.** The demo's one- or two-step word problems with + and - on 2-digit numbers (`data/tool_demo/`),
with a `calculator` tool offered in every conversation; scored on the final turn's last `\\boxed{{}}`.

**How it was built.** Supervised fine-tuning from random weights for {stats["sft_steps"]} steps on
`data/tool_demo/sft.jsonl`, on the assistant turns only. On {TOOL_SHARE:.0%} of the problems, at random,
the teacher calls the calculator with the problem's expression and then states the tool's result; on the
others it answers directly with the demo's noisy teacher, which drops a needed carry (+) or borrow (-)
{base.DROP_PROB:.0%} of the time. So the model's first token is `<tool_call>` about {TOOL_SHARE:.0%} of the
time whatever the problem: greedy decoding answers directly, samples sometimes call the tool and are then
nearly always right. Room for RL to learn to call the tool.

**Measured on data/tool_demo/val.jsonl** through the tool loop (turn 1; if it calls the tool, the
calculator's result as a `tool` message and turn 2; {MAX_NEW_TOKENS} new tokens a turn):

| decoding | prompts x samples | accuracy | tool-call rate | tool result = answer | \
accuracy when calling | accuracy when not |
| --- | --- | --- | --- | --- | --- | --- |
{table}

Mean length in tokens of an SFT conversation: {stats["chat_tokens"]:.0f}, \
of which {stats["trained_tokens"]:.0f} trained.
Build time: {stats["build_seconds"] / 60:.1f} min on {torch.get_num_threads()} CPU threads.

**Rebuild:** `python scripts/build_tool_demo_model.py` (seeded; writes models/tool_demo and data/tool_demo).

**Chat format.** Qwen style; with tools, a system block names them. The chat template is in
tokenizer_config.json; render with `reinforge.data.templates.render_messages`. A tool-using episode:

    <|im_start|>system\\nTools: calculator<|im_end|>\\n<|im_start|>user\\nAnn has 57 stickers. ...<|im_end|>\\n
    <|im_start|>assistant\\n<tool_call>{{"name": "calculator", \
"arguments": {{"expression": "57 + 34 - 49"}}}}</tool_call><|im_end|>\\n
    <|im_start|>tool\\n42<|im_end|>\\n<|im_start|>assistant\\nThe answer is \\boxed{{42}}.<|im_end|>\\n

(one string, broken here for reading). Each turn ends with `<|im_end|>`, the eos token; `<|endoftext|>` pads.
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-model", type=Path, default=Path("models/tool_demo"))
    parser.add_argument("--out-data", type=Path, default=Path("data/tool_demo"))
    parser.add_argument("--sft-steps", type=int, default=SFT_STEPS)
    parser.add_argument("--quick", action="store_true", help="tiny data and 5 steps: a smoke build for tests")
    args = parser.parse_args()
    start = time.time()
    torch.manual_seed(base.SEED)
    torch.set_num_threads(2)  # the same thread count everywhere keeps the float arithmetic reproducible
    num_val, num_train, num_sft = (20, 50, 200) if args.quick else (base.NUM_VAL, base.NUM_TRAIN, base.NUM_SFT)
    num_steps = 5 if args.quick else args.sft_steps

    train, val, sft_chats = make_data(num_val, num_train, num_sft)
    for name, records in (("train", train), ("val", val), ("sft", sft_chats)):
        base.write_jsonl(args.out_data / f"{name}.jsonl", records)
    write_data_readme(args.out_data, {"train": len(train), "val": len(val), "sft": len(sft_chats)})
    texts = [text for chat in sft_chats for text in message_texts(chat)]
    texts += [row["responses_create_params"]["input"][0]["content"] for row in train + val]
    tokenizer = build_tokenizer(texts)
    rendered = [
        render_messages(tokenizer, chat["messages"], chat["tools"], add_generation_prompt=False) for chat in sft_chats
    ]
    assert all(tokenizer.decode(tokenizer.encode(text)) == text for text in texts + rendered), (
        "tokenizer does not round-trip"
    )
    assert all(len(tokenizer.encode(token)) == 1 for token in TOOL_CALL_TOKENS), "a tool-call tag is split"

    model = base.build_model(tokenizer)
    examples = [tokenize_chat(tokenizer, chat) for chat in sft_chats]
    stats = {
        "num_params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "sft_steps": num_steps,
        "chat_tokens": sum(len(ids) for ids, _ in examples) / len(examples),
        "trained_tokens": sum(label != -100 for _, labels in examples for label in labels) / len(examples),
    }
    num_tool_chats = sum(len(chat["messages"]) > 2 for chat in sft_chats)
    print(
        f"{len(train)} train / {len(val)} val / {len(sft_chats)} sft problems ({num_tool_chats} with the tool); "
        f"vocab {len(tokenizer)}; {stats['num_params']:,} parameters"
    )
    base.sft(model, examples, tokenizer.pad_token_id, num_steps, batch_size=64, peak_lr=2e-3)

    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    stats["greedy"] = evaluate(model, tokenizer, val, num_samples=1, temperature=None)
    stats["sampled"] = evaluate(model, tokenizer, val[:NUM_SAMPLE_PROMPTS], NUM_SAMPLES, temperature=1.0)
    stats["num_greedy"], stats["num_sample_prompts"] = len(val), len(val[:NUM_SAMPLE_PROMPTS])
    for name in ("greedy", "sampled"):
        print(f"val {name}: " + ", ".join(f"{key} {value:.3f}" for key, value in stats[name].items()))

    stats["build_seconds"] = time.time() - start  # all but the writing of the model, which takes a moment
    write_model(args.out_model, model, tokenizer, stats)
    print(f"wrote {args.out_model} and {args.out_data}; built in {stats['build_seconds']:.0f}s")


if __name__ == "__main__":
    main()
