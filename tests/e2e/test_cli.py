"""The command line as a user meets it: one-line errors, reproducible runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reinforge.cli import parse_args

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "grpo_demo.yaml"
SMALL = [
    "loop.max_steps=2",
    "rollout.num_prompts_per_step=4",
    "rollout.num_generations_per_prompt=4",
    "loop.val_every=0",
    "training.global_batch_size=8",
    "training.micro_batch_size=8",
    "data.max_val_prompts=8",
    "generation.max_new_tokens=24",
]


def reinforge(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "reinforge.cli", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def assert_one_line_error(result, pattern):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reinforge: error: "), result.stderr
    assert pattern in lines[0]


def test_misspelled_key_exits_nonzero_with_did_you_mean_and_no_traceback():
    result = reinforge("grpo", "--config", DEMO, "grpo.num_generatoins=4")
    assert_one_line_error(result, "did you mean rollout.num_generations_per_prompt?")


def test_missing_dataset_file_is_a_one_line_error(tmp_path):
    result = reinforge(
        "grpo", "--config", DEMO, f"data.train_path={tmp_path / 'nope.jsonl'}", f"logging.run_dir={tmp_path / 'run'}"
    )
    assert_one_line_error(result, "nope.jsonl does not exist")
    assert not (tmp_path / "run").exists()


def test_malformed_jsonl_line_is_named_by_its_line_number(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1 + 1?", "answer": "2"}\n{"prompt": "2 + 2?", "answer": "4"}\n{"prompt": "oops", \n')
    result = reinforge("grpo", "--config", DEMO, f"data.train_path={data}")
    assert_one_line_error(result, f"{data}:3: malformed JSON")


def test_model_path_that_does_not_exist_is_a_one_line_error(tmp_path):
    result = reinforge("grpo", "--config", DEMO, f"model.name_or_path={tmp_path / 'no_model'}")
    assert_one_line_error(result, "no such directory")


def test_saved_config_reproduces_the_run(tmp_path):
    first = reinforge("grpo", "--config", DEMO, *SMALL, f"logging.run_dir={tmp_path / 'run'}")
    assert first.returncode == 0, first.stderr
    again = reinforge("grpo", "--config", tmp_path / "run" / "config.yaml")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "run-1" / "metrics.jsonl").is_file(), "a second run must not overwrite the first"

    def deterministic(run):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in rows]

    assert deterministic("run") == deterministic("run-1")
    assert len(deterministic("run")) == 3  # step 0 validation, steps 1 and 2


@pytest.mark.parametrize(
    "argv, overrides",
    [
        (["recipe", "r.yaml", "--run-dir", "d", "a.b=1", "c=2"], ["a.b=1", "c=2"]),
        (["recipe", "r.yaml", "a.b=1", "--run-dir", "d", "c=2"], ["a.b=1", "c=2"]),
        (["recipe", "--run-dir", "d", "r.yaml", "a.b=1", "c=2"], ["a.b=1", "c=2"]),
        (["grpo", "a.b=1", "--config", "x.yaml", "c=2"], ["a.b=1", "c=2"]),
    ],
)
def test_overrides_may_follow_an_option_after_the_positionals_and_keep_their_order(argv, overrides):
    args = parse_args(argv)
    assert args.overrides == overrides
    assert getattr(args, "run_dir", "d") == "d"


def test_an_unknown_option_or_a_stray_word_is_still_refused(capsys):
    for argv in (
        ["recipe", "r.yaml", "--run-dir", "d", "--bogus"],
        ["recipe", "r.yaml", "--run-dir", "d", "stray"],
        ["report", "run", "a=1"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err.strip().splitlines()[-1]


def test_serve_refuses_a_context_longer_than_the_models_in_one_line():
    """The demo model has 2048 positions; `--max-model-len 4096` would serve prompts it cannot position."""
    result = subprocess.run(
        [sys.executable, "-m", "reinforge.cli", "serve", "--model", "models/demo", "--max-model-len", "4096",
         "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert_one_line_error(result, "--max-model-len 4096 exceeds the model's max_position_embeddings=2048")
