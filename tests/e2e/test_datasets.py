"""Datasets as users keep them, through the command line: GRPO from a parquet file and from a directory saved with
`datasets`, their columns renamed (`data.columns`); SFT from a parquet of chats; a missing column, a bad row and
an unreachable hub name each one line. All but the hub name's run through cli.main in this process (no interpreter
start-up). The files are the shipped demo data, rewritten by the real `datasets`."""

import json
import os
import subprocess
import sys

import datasets
import pytest

from reinforge.cli import main
from reinforge.paths import PROJECT_ROOT

CONFIGS = PROJECT_ROOT / "configs"
TINY = [  # one step of a few short rollouts: the data path is what is tested
    "loop.max_steps=1",
    "loop.val_every=0",
    "rollout.num_prompts_per_step=2",
    "rollout.num_generations_per_prompt=2",
    "training.global_batch_size=4",
    "training.micro_batch_size=4",
    "generation.max_new_tokens=8",
    "data.max_val_prompts=2",
]


def demo_records(name, count):
    lines = (PROJECT_ROOT / "data" / "demo" / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines[:count]]


@pytest.fixture(scope="module")
def gsm_style(tmp_path_factory):
    """The demo prompts as a user's GSM8K-style set: columns question/solution, as parquet and as save_to_disk."""
    root = tmp_path_factory.mktemp("user_data")
    rows = [{"question": r["prompt"], "solution": r["answer"]} for r in demo_records("train.jsonl", 16)]
    dataset = datasets.Dataset.from_list(rows)
    dataset.to_parquet(str(root / "train.parquet"))
    datasets.DatasetDict({"train": dataset, "test": dataset.select(range(4))}).save_to_disk(str(root / "saved"))
    return root


def here(capsys, *args) -> subprocess.CompletedProcess:
    """The command through cli.main in this process (no interpreter start-up; the real CLI's own runs are
    tests/e2e/test_cli.py's and test_sft.py's), as a finished command."""
    status = main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, captured.out, captured.err)


def grpo(capsys, run_dir, *overrides) -> subprocess.CompletedProcess:
    """`grpo` here (cluster.max_restarts=0: no supervised child; the supervisor relays the same line:
    tests/e2e/test_cli.py)."""
    return here(
        capsys, "grpo", "--config", CONFIGS / "grpo_demo.yaml", f"logging.run_dir={run_dir}", "checkpoint.resume=never",
        "cluster.max_restarts=0", *TINY, *overrides,
    )  # fmt: skip


def assert_one_line_error(result, *parts):
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reinforge: error: "), result.stderr[-2000:]
    for part in parts:
        assert part in lines[0], lines[0]


def trained_steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_trains_on_a_parquet_file_with_its_own_column_names(gsm_style, tmp_path, capsys):
    result = grpo(
        capsys,
        tmp_path / "run",
        f"data.train_path={gsm_style / 'train.parquet'}",
        "data.val_path=null",
        "data.columns.prompt=question",
        "data.columns.answer=solution",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert 1 in trained_steps(tmp_path / "run")


def test_grpo_streams_a_saved_dataset_dict_with_its_train_and_test_splits(gsm_style, tmp_path, capsys):
    saved = gsm_style / "saved"
    result = grpo(
        capsys,
        tmp_path / "run",
        f"data.train_path={saved}",
        f"data.val_path={saved}",
        "data.streaming=true",
        "data.columns.prompt=question",
        "data.columns.answer=solution",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert 1 in trained_steps(tmp_path / "run")


def test_sft_trains_on_a_parquet_of_chats(tmp_path, capsys):
    chats = [{"conversation": r["messages"]} for r in demo_records("sft.jsonl", 32)]
    datasets.Dataset.from_list(chats).to_parquet(str(tmp_path / "chats.parquet"))
    result = here(
        capsys, "sft", "--config", CONFIGS / "sft_demo.yaml", f"logging.run_dir={tmp_path / 'run'}",
        f"data.train_path={tmp_path / 'chats.parquet'}", "data.columns.messages=conversation", "data.val_fraction=0.25",
        "sft.max_steps=1", "training.global_batch_size=8", "checkpoint.resume=never", "cluster.max_restarts=0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "final").is_dir()


def test_a_missing_column_and_a_bad_row_are_one_line_errors_naming_the_row(gsm_style, tmp_path, capsys):
    parquet = gsm_style / "train.parquet"
    result = grpo(capsys, tmp_path / "run", f"data.train_path={parquet}", "data.columns.prompt=problem")
    assert_one_line_error(
        result, f"{parquet}: row 0: no column 'problem' (data.columns.prompt)", "its columns are question, solution"
    )
    rows = [{"question": "What is 2 + 2?", "solution": "4"}, {"question": None, "solution": "5"}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "bad.parquet"))
    bad = f"data.train_path={tmp_path / 'bad.parquet'}"
    result = grpo(capsys, tmp_path / "run", bad, "data.columns.prompt=question")
    assert_one_line_error(result, f"{tmp_path / 'bad.parquet'}: row 1: question must be a string")
    assert not (tmp_path / "run").exists()


def test_the_old_prompt_key_points_to_data_columns(tmp_path, capsys):
    result = grpo(capsys, tmp_path / "run", "data.prompt_key=question")
    assert_one_line_error(result, "unknown config key data.prompt_key", "did you mean data.columns.prompt?")


def test_a_hub_name_without_the_network_is_one_line_saying_so(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # no cached copy, no network
    command = ["grpo", "--config", CONFIGS / "grpo_demo.yaml", f"logging.run_dir={tmp_path / 'run'}", *TINY,
               "data.train_path=openai/gsm8k", "data.subset=main"]  # fmt: skip
    # a process of its own: huggingface_hub reads HF_HUB_OFFLINE when it is imported
    result = subprocess.run(
        [sys.executable, "-m", "reinforge.cli", *map(str, command)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=PROJECT_ROOT,
    )
    assert_one_line_error(
        result, "data.train_path=openai/gsm8k: could not reach the Hugging Face Hub", "connect this machine"
    )


def test_eval_takes_questions_from_a_saved_dataset_split_with_its_columns(gsm_style, tmp_path, capsys):
    demo = PROJECT_ROOT / "models" / "demo"
    result = here(
        capsys, "eval", "--model", demo, "--benchmark", gsm_style / "saved", "--split", "test",
        "--column", "prompt=question", "--column", "answer=solution", "--k", "1", "--limit", "2", "--backend", "hf",
        "--max-new-tokens", "8", "--output", tmp_path / "eval",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["num_prompts"] == 2
    bad = here(capsys, "eval", "--model", demo, "--benchmark", gsm_style / "saved", "--k", "1", "--column", "q")
    assert_one_line_error(bad, "--column 'q': expected FIELD=COLUMN")
