"""`reinforge distill` end to end on the demo models: the student (models/demo) distilled from the stronger teacher
(models/demo_teacher) gains validation accuracy, a killed run resumes to the metrics of a run never killed, and a
teacher that cannot score the student's tokens is a one-line error before any run directory."""

import json
import subprocess
import sys

from _kill import assert_resumes_like_a_run_never_killed

from reinforge.cli import main
from reinforge.paths import PROJECT_ROOT

CONFIG = PROJECT_ROOT / "configs" / "distill_demo.yaml"
SMALL = [
    "rollout.num_prompts_per_step=8",
    "rollout.num_generations_per_prompt=4",
    "training.global_batch_size=32",
    "training.micro_batch_size=32",
    "generation.max_new_tokens=40",
    "checkpoint.save_final=false",
    "cluster.num_threads=1",
]


def distill(run_dir, *overrides, **kwargs):
    command = [
        sys.executable,
        "-m",
        "reinforge.cli",
        "distill",
        "--config",
        str(CONFIG),
        *SMALL,
        *overrides,
        f"logging.run_dir={run_dir}",
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_distilling_the_stronger_teacher_raises_validation_accuracy(tmp_path):
    """The demo config (the top-k KL) on small batches: 10 steps of 8 prompts x 4 answers."""
    result = distill(tmp_path / "run", "loop.max_steps=10", "loop.val_every=10", "data.max_val_prompts=48")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = rows(tmp_path / "run")
    first, last = metrics[0]["val/accuracy"], metrics[-1]["val/accuracy"]
    assert last >= first + 0.1, (first, last)
    steps = [row for row in metrics if row["step"] > 0]
    assert all(
        row["train/distill_topk_kl"] > 0 and row["train/distill_reverse_kl"] > 0 and "timing/teacher_s" in row
        for row in steps
    )


def resume_args(run_dir):
    return [
        sys.executable,
        "-m",
        "reinforge.cli",
        "distill",
        "--config",
        str(CONFIG),
        *SMALL,
        "rollout.num_prompts_per_step=4",
        "training.global_batch_size=16",
        "training.micro_batch_size=16",
        "loop.max_steps=4",
        "loop.val_every=2",
        "data.max_val_prompts=8",
        "checkpoint.save_every=1",
        "checkpoint.keep_last=2",
        "checkpoint.resume=auto",
        "distill.loss=reverse_kl",
        f"logging.run_dir={run_dir}",
    ]


def test_a_distillation_run_killed_after_step_2_resumes_to_the_metrics_of_a_run_never_killed(tmp_path):
    metrics = assert_resumes_like_a_run_never_killed(resume_args, tmp_path, step=2)
    assert [row["step"] for row in metrics] == [0, 1, 2, 3, 4]


def one_line_error(capsys, run_dir, *overrides):
    """The CLI in this process (no supervised child, no interpreter start-up per case): its exit status and stderr's
    lines."""
    here = "cluster.max_restarts=0"  # the supervisor relays the same line: tests/e2e/test_cli.py
    status = main(["distill", "--config", str(CONFIG), *SMALL, *overrides, here, f"logging.run_dir={run_dir}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("reinforge: error: "), lines
    return lines[0]


def test_a_teacher_with_another_tokenizer_or_a_task_without_a_teacher_is_a_one_line_error_before_any_run_directory(
    tmp_path, capsys
):
    """models/tool_demo's tokenizer has the demo's 449 tokens plus its tool-call tokens (488)."""
    other = one_line_error(capsys, tmp_path / "a", "distill.teachers=[{name_or_path: models/tool_demo}]")
    assert "models/tool_demo has another tokenizer" in other and "488 vs 449 tokens" in other
    orphan = one_line_error(
        capsys, tmp_path / "b", "distill.teachers=[{name_or_path: models/demo_teacher, tasks: [code]}]"
    )
    assert "no teacher scores task math" in orphan
    two_defaults = one_line_error(
        capsys, tmp_path / "c", "distill.teachers=[{name_or_path: models/demo_teacher}, {name_or_path: models/demo}]"
    )
    assert "at most one may be the default teacher" in two_defaults
    # GRPO's reward shaping is not in distillation's tree: unknown keys, whatever their value
    assert "loss.kl_in_reward: reinforge distill has no such setting" in one_line_error(
        capsys, tmp_path / "d", "loss.kl_in_reward=true", "loss.kl_coef=0.01"
    )
    assert "grpo.whiten_advantages: reinforge distill has no grpo section" in one_line_error(
        capsys, tmp_path / "e", "grpo.whiten_advantages=false"
    )
    assert "overlong.filtering: reinforge distill has no overlong section" in one_line_error(
        capsys, tmp_path / "f", "overlong.filtering=false"
    )
    assert not any((tmp_path / name).exists() for name in "abcdef")


def test_a_teacher_of_another_size_with_the_students_tokenizer_distils(tmp_path, capsys):
    """A random 2-layer, 64-wide Qwen2 with the demo's tokenizer (the student is 4 layers, 128 wide) teaches one
    step."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    student = PROJECT_ROOT / "models" / "demo"
    shape = Qwen2Config.from_pretrained(student).to_dict() | {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "layer_types": ["full_attention"] * 2,
    }
    Qwen2ForCausalLM(Qwen2Config(**shape)).save_pretrained(tmp_path / "teacher")
    AutoTokenizer.from_pretrained(student).save_pretrained(tmp_path / "teacher")
    status = main(
        [
            "distill",
            "--config",
            str(CONFIG),
            *SMALL,
            f"distill.teachers=[{{name_or_path: {tmp_path / 'teacher'}}}]",
            "loop.max_steps=1",
            "loop.val_every=0",
            "data.max_val_prompts=4",
            "cluster.max_restarts=0",  # in this process, not a supervised child
            f"logging.run_dir={tmp_path / 'run'}",
        ]
    )
    assert status == 0, capsys.readouterr().err
    step = rows(tmp_path / "run")[-1]
    assert step["train/distill_topk_kl"] > 1.0  # a random teacher is far from the student
