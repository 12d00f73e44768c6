"""The conformance matrix's cells (tests/e2e/test_model_matrix.py, scripts/model_matrix.py, docs/models.md): what
each cell runs on a family's tiny model (tests/model_families.py) and how its outcome is read.

The recipe cells are real runs of the command line, `reinforge.cli.main` in this process (cluster.max_restarts=0:
no supervisor child), with the demo's configs and a slice of the demo's data (data/demo: the first prompts and
chats, so that loading the data does not dominate a two-step run): SFT, GRPO on the HF engine in the three layouts
of the trainer's passes (shared prompts, the default; packed; padded), GRPO with LoRA, GRPO on vLLM. The gate
(`generation.max_logprob_error`) is opened, so that every run reaches its metrics: a cell's number is step 1's
`train/token_mult_prob_error`, the first batch's, sampled and recomputed with the starting weights (what the
start-up probe measures), and the cell passes when it is at most MISMATCH[engine]. The vLLM cells of all families
run in one child process (`python tests/e2e/_matrix.py vllm ...`): vLLM is imported once, one engine per family.

The layout cells (FSDP2 on 2 ranks, tp=2, cp=2) run in one world of two gloo ranks spawned once
(tests/unit/test_fsdp2_worker.py's `launch`): each rank builds the trainer (`Backend` on `FSDP2Strategy`) in the
layout, computes the logprobs of the demo's prompts with varied responses and takes one training step; the number is
the same token_mult_prob_error against transformers' own forward of each sequence alone (the HF engine's model).
The Ray plumbing of an FSDP2 run is the same for every family and is tested by tests/e2e/test_fsdp2_grpo.py.

A cell's outcome: "pass" (with its mismatch), "refused" (exit status 2, one `reinforge: error:` line, no traceback,
no run directory), "mismatch" (finished above the threshold), "error" (any other end: a traceback, a refusal after
the run directory, several lines).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# tests/model_families.py, and tests/unit/test_fsdp2_worker.py's `launch` for the layout cells
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "unit")]


RECIPE_CELLS = ("sft", "grpo_hf", "grpo_hf_packed", "grpo_hf_padded", "lora")
VLLM_CELL = "grpo_vllm"
WORLD_CELLS = ("fsdp2", "tp2", "cp2")
CELLS = (*RECIPE_CELLS, VLLM_CELL, *WORLD_CELLS)
MISMATCH = {"hf": 1.001, "vllm": 1.01}  # the start-up mismatch a cell may have against the engine
SFT_LOSS_TOLERANCE = 1e-4  # SFT's validation loss against transformers' (float32 sums over ~100 tokens)
REFIT_MISMATCH = 1.05  # every later step's, after a refit (generation.max_logprob_error's default)
WORLD_LAYOUTS = {"fsdp2": dict(dp_shard=2), "tp2": dict(tp=2), "cp2": dict(cp=2)}
# docs/models.md's table lies between these (scripts/model_matrix.py writes it)
DOC_BEGIN = "<!-- matrix: begin (scripts/model_matrix.py writes what follows, up to the end marker) -->"
DOC_END = "<!-- matrix: end -->"

RL = [
    "loop.max_steps=2",
    "loop.val_every=0",
    "data.max_val_prompts=1",
    "data.max_prompt_tokens=128",  # the families' max_position_embeddings is 512
    "rollout.num_prompts_per_step=4",
    "rollout.num_generations_per_prompt=4",
    "training.global_batch_size=16",
    "training.micro_batch_size=8",
    "generation.max_new_tokens=24",  # with the chat template: sequences of 40-70 tokens, windows of 8
    "generation.num_probe_prompts=4",
    "generation.max_logprob_error=1000",  # the cell reads the number instead of stopping at the gate
    "checkpoint.save_final=false",
    # a random model's rewards are all 0, so its advantages and gradients are too: AdamW's decoupled weight decay
    # (lr x decay = 0.1) then shrinks every weight by 10% a step, so that the refit has new weights to deliver
    "optimizer.lr=0.01",
    "optimizer.weight_decay=10",
]
COMMANDS = {  # cell: (recipe, config, overrides)
    "sft": (
        "sft",
        "sft_demo.yaml",
        [
            "sft.max_steps=2",
            "sft.val_every=2",
            "sft.random_init=false",
            "data.val_fraction=0",
            "training.global_batch_size=8",
        ],
    ),
    "grpo_hf": ("grpo", "grpo_demo.yaml", RL),
    "grpo_hf_packed": ("grpo", "grpo_demo.yaml", [*RL, "training.share_prompts=false"]),
    "grpo_hf_padded": ("grpo", "grpo_demo.yaml", [*RL, "training.sequence_packing=false"]),
    "lora": ("grpo", "grpo_lora_demo.yaml", RL),
    "grpo_vllm": ("grpo", "grpo_demo.yaml", [*RL, "generation.backend=vllm", "generation.vllm.block_size=32"]),
}


@dataclass
class Outcome:
    kind: str  # pass, refused, mismatch, error
    detail: str = ""  # the refusal's or the error's line; what a pass checked
    mismatch: float | None = None
    seconds: float = 0.0


def demo_data(directory: Path) -> Path:
    """The first prompts and chats of the demo's data, in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, source, rows in (
        ("train.jsonl", "train.jsonl", slice(32)),
        ("val.jsonl", "val.jsonl", slice(4)),
        ("sft.jsonl", "sft.jsonl", slice(64)),
        ("sft_val.jsonl", "sft.jsonl", slice(64, 68)),
    ):
        lines = (ROOT / "data" / "demo" / source).read_text().splitlines()[rows]
        (directory / name).write_text("\n".join(lines) + "\n")
    return directory


def command(cell: str, model_dir: Path, data_dir: Path, run_dir: Path) -> list[str]:
    recipe, config, overrides = COMMANDS[cell]
    data = (
        [f"data.train_path={data_dir / 'sft.jsonl'}", f"data.val_path={data_dir / 'sft_val.jsonl'}"]
        if recipe == "sft"
        else [f"data.train_path={data_dir / 'train.jsonl'}", f"data.val_path={data_dir / 'val.jsonl'}"]
    )
    return [
        recipe,
        "--config",
        str(ROOT / "configs" / config),
        f"model.name_or_path={model_dir}",
        f"logging.run_dir={run_dir}",
        "cluster.num_threads=1",
        "cluster.max_restarts=0",
        *data,
        *overrides,
    ]


def run_recipe_cell(cell: str, model_dir: Path, data_dir: Path, run_dir: Path) -> Outcome:
    """Run `cell` through the command line in this process and read its outcome."""
    from reinforge.cli import main

    stderr, began = io.StringIO(), time.perf_counter()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            status = main(command(cell, model_dir, data_dir, run_dir))
    except BaseException as exc:  # noqa: BLE001 -- any escape is the cell's outcome: a traceback
        if isinstance(exc, KeyboardInterrupt):
            raise
        outcome = Outcome("error", "traceback: " + exception_line(exc))
    else:
        outcome = read_outcome(cell, status, stderr.getvalue(), run_dir, model_dir, data_dir)
    outcome.seconds = round(time.perf_counter() - began, 1)
    return outcome


def exception_line(exc: BaseException) -> str:
    """The exception's type and the first lines of its message, on one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()][:2]
    return f"{type(exc).__name__}: {' '.join(lines)}"[:400]


def read_outcome(cell: str, status: int, stderr: str, run_dir: Path, model_dir: Path, data_dir: Path) -> Outcome:
    if status != 0:
        return refusal(stderr, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if cell == "sft":
        return sft_outcome(rows, model_dir, data_dir / "sft_val.jsonl")
    errors = [row["train/token_mult_prob_error"] for row in rows[1:]]
    engine = "vllm" if cell == VLLM_CELL else "hf"
    first, refits = errors[0], errors[1:]
    if len(errors) != 2 or not all(math.isfinite(error) for error in errors):
        return Outcome("error", f"no 2 steps of finite mismatch: {errors}", first)
    if first > MISMATCH[engine]:
        return Outcome("mismatch", f"start-up mismatch {first:.4f} > {MISMATCH[engine]}", first)
    if any(error > REFIT_MISMATCH for error in refits):
        return Outcome("mismatch", f"mismatch after a refit {max(refits):.4f} > {REFIT_MISMATCH}", first)
    return Outcome("pass", f"mismatch {first:.6f}", first)


def sft_outcome(rows: list[dict], model_dir: Path, val_path: Path) -> Outcome:
    """SFT's validation loss before training (packed, through the chunked LM head) against transformers' own forward
    of each validation chat alone: the mean NLL of the assistant tokens. Its number is the difference."""
    losses = [row["val/loss"] for row in rows if "val/loss" in row] + [row["train/loss"] for row in rows[1:]]
    if len(rows) != 3 or len(losses) != 4 or not all(math.isfinite(loss) for loss in losses):
        return Outcome("error", f"SFT did not log 2 steps of finite losses: {losses}")
    difference = abs(losses[0] - reference_nll(model_dir, val_path))
    if difference > SFT_LOSS_TOLERANCE:
        return Outcome(
            "mismatch", f"val/loss {losses[0]:.5f} differs from transformers' by {difference:.2e}", difference
        )
    return Outcome("pass", f"val/loss {losses[0]:.5f} = transformers' to {difference:.1e}", difference)


def reference_nll(model_dir: Path, val_path: Path) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reinforge.data.chat import render_chat

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    total, count = 0.0, 0
    with torch.no_grad():
        for line in val_path.read_text().splitlines():
            example = render_chat(json.loads(line), tokenizer)
            ids = torch.tensor([example.token_ids])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), dim=-1)
            token_logprobs = logprobs.gather(1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(example.loss_mask[1:], dtype=torch.float64)
            total -= float((token_logprobs * mask).sum())
            count += float(mask.sum())
    return total / count


def refusal(stderr: str, run_dir: Path) -> Outcome:
    """A one-line refusal, or the error that it is not."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("reinforge: error: ")]
    if "Traceback" in stderr or len(errors) != 1 or lines[-1] != errors[0]:
        return Outcome("error", "not a one-line error: " + (lines[-1][:400] if lines else "(nothing on stderr)"))
    line = errors[0].removeprefix("reinforge: error: ")
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "config.yaml").exists():
        return Outcome("error", "refused after the run directory was made: " + line)
    return Outcome("refused", line)


def run_vllm_cells(families: list[str], models: Path, data_dir: Path, runs: Path, out: Path) -> None:
    """Every family's vLLM cell, one after another in this process, each outcome a JSON line of `out` as it ends
    (a crash of the process loses only the cells after it)."""
    for name in families:
        outcome = run_recipe_cell(VLLM_CELL, models / name, data_dir, runs / name)
        with open(out, "a") as file:
            file.write(json.dumps({"family": name, **asdict(outcome)}) + "\n")


def main(argv: list[str]) -> None:
    """`python tests/e2e/_matrix.py vllm MODELS DATA RUNS OUT FAMILY...`: the vLLM cells, as JSON lines in OUT."""
    _, models, data_dir, runs, out, *families = argv
    run_vllm_cells(families, Path(models), Path(data_dir), Path(runs), Path(out))


if __name__ == "__main__":
    main(sys.argv[1:])
