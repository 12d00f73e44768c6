"""`reinforge sft` on the demo config, as a user runs it: the validation loss must fall."""

import json
import os
import subprocess
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

from reinforge.algorithms.sft_config import SFTRunConfig
from reinforge.cli import main
from reinforge.config.loader import load_recipe_config
from reinforge.paths import PROJECT_ROOT

CONFIG = PROJECT_ROOT / "configs" / "sft_demo.yaml"
REQUIRED = [
    "train/loss",
    "train/grad_norm",
    "train/lr",
    "train/num_trained_tokens",
    "timing/step_s",
    "perf/tokens_per_s",
    "perf/packing_efficiency",
]


def reinforge(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "reinforge.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600
    )


def test_sft_on_the_demo_chats_lowers_the_validation_loss(tmp_path):
    run_dir = tmp_path / "run"
    result = reinforge(
        "sft",
        "--config",
        str(CONFIG),
        "sft.max_steps=30",
        "sft.val_every=15",
        "cluster.num_threads=1",
        f"logging.run_dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(31))
    for row in rows[1:]:
        missing = [key for key in REQUIRED if key not in row]
        assert not missing, missing
        assert row["perf/packing_efficiency"] > 0.85  # 51-75-token chats packed into rows of 256
    val = {row["step"]: row["val/loss"] for row in rows if "val/loss" in row}
    assert list(val) == [0, 15, 30]
    assert val[30] < val[15] < val[0] - 1.0, val  # from random weights: ~6.1 (ln 449) at step 0
    assert rows[-1]["train/lr"] < rows[15]["train/lr"]  # cosine decay
    assert "val/loss at step 0" in result.stdout

    # the model and tokenizer load the ordinary way; the saved config reproduces the run's
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    assert model.config.vocab_size == len(tokenizer)
    saved = load_recipe_config(SFTRunConfig, run_dir / "config.yaml")
    assert saved == load_recipe_config(
        SFTRunConfig,
        CONFIG,
        ["sft.max_steps=30", "sft.val_every=15", "cluster.num_threads=1", f"logging.run_dir={run_dir}"],
    )


def test_sft_config_mistakes_are_one_line_errors_with_exit_status_2(tmp_path, capsys):
    for overrides, message in [
        (
            ["sft.max_step=3"],
            "unknown config key sft.max_step: reinforge sft has no such setting; did you mean sft.max_steps?",
        ),
        # settings SFT does not read are unknown keys, whatever their value (the RL recipes' default included)
        (["training.micro_batch_size=32"], "unknown config key training.micro_batch_size: reinforge sft has no such"),
        (["training.share_prompts=true"], "unknown config key training.share_prompts: reinforge sft has no such"),
        (["grpo.normalize_std=true"], "unknown config key grpo.normalize_std: reinforge sft has no grpo section"),
        (["sft.packing=true"], "unknown config key sft.packing: reinforge sft has no such setting"),
        (["training.lr=1e-3"], "did you mean optimizer.lr?"),
        (["training.micro_batch_tokens=100"], "training.micro_batch_tokens=100 < data.max_seq_len=256"),
        (["training.backend=fsdp2", "training.num_workers=3"], "does not split over training.num_workers=3 ranks"),
        (["data.val_path=data/demo/sft.jsonl"], "data.val_path and data.val_fraction are both set"),
        (["data.train_path=nope.jsonl"], "dataset file nope.jsonl does not exist"),
        # one thread setting for every command; the RL runs' engine placement is not SFT's
        (
            ["num_threads=1"],
            "unknown config key num_threads: reinforge sft has no such setting; did you mean cluster.num_threads?",
        ),
        (["cluster.colocate=true"], "unknown config key cluster.colocate: reinforge sft has no such setting"),
    ]:
        run_dir = f"logging.run_dir={tmp_path / 'run'}"
        status = main(["sft", "--config", str(CONFIG), run_dir, "cluster.max_restarts=0", *overrides])  # in-process
        stderr = capsys.readouterr().err
        assert status == 2, (overrides, stderr)
        assert stderr.startswith("reinforge: error: ") and message in stderr, stderr
        assert len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "run").exists()  # a bad input never leaves a half-made run directory
