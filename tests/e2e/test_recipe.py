"""`reinforge recipe` end to end on the demo model: configs/recipes/demo_progressive.yaml's three GRPO
stages (max_new_tokens 16 -> 32 -> 48), shortened to 2 small steps each; a run killed in stage 2 and
rerun; a rerun under a changed recipe refused. (The DeepScaleR recipe's offline --validate is a unit test.)"""

import json
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

from reinforge.cli import main
from reinforge.paths import PROJECT_ROOT
from reinforge.recipes.runner import run_recipe

RECIPE = PROJECT_ROOT / "configs" / "recipes" / "demo_progressive.yaml"
SHORTER = [
    "loop.max_steps=2",
    "rollout.num_prompts_per_step=4",
    "training.global_batch_size=16",
    "training.micro_batch_size=16",
    "data.max_val_prompts=8",
]
STAGES = ["01-short", "02-medium", "03-long"]


def command(run_dir, *extra):
    return [sys.executable, "-m", "reinforge.cli", "recipe", "--run-dir", str(run_dir), str(RECIPE), *SHORTER, *extra]


def comparable(stage_dir):
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in rows]


def weights(directory):
    return load_file(str(directory / "model.safetensors"))


def assert_same_tensors(a, b):
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)


def files_state(directory):
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
        if p.is_file()
    }


def kill_once_a_checkpoint_is_in(command_line: list[str], checkpoints) -> None:
    """Start the recipe and SIGKILL it once a checkpoint is renamed into `checkpoints` (its temporary directory
    holds COMPLETE a moment before: the fsync); fail if it ended first."""
    process = subprocess.Popen(command_line, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while process.poll() is None and time.time() < deadline:
        if checkpoints.is_dir() and any(
            p.name.startswith("step_") and (p / "COMPLETE").is_file() for p in checkpoints.iterdir()
        ):
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    assert process.wait(timeout=60) == -signal.SIGKILL, process.stderr.read().decode()[-3000:]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("recipe") / "uninterrupted"
    result = subprocess.run(command(run_dir), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result.stdout


def test_each_stage_starts_from_the_previous_stage_final_weights_with_a_longer_context(finished_run):
    run_dir, stdout = finished_run
    assert [f"stage {k} of 3" in stdout for k in (1, 2, 3)] == [True] * 3
    configs = [yaml.safe_load((run_dir / "stages" / name / "config.yaml").read_text()) for name in STAGES]
    assert [c["generation"]["max_new_tokens"] for c in configs] == [16, 32, 48]
    assert [c["loop"]["max_steps"] for c in configs] == [2, 2, 2]
    assert configs[0]["model"]["name_or_path"] == "models/demo"
    finals = [run_dir / "stages" / name / "final" for name in STAGES]
    for config, previous_final in zip(configs[1:], finals):
        assert config["model"]["name_or_path"] == str(previous_final)
    tensors = [weights(PROJECT_ROOT / "models" / "demo")] + [weights(final) for final in finals]
    for config, start in zip(configs, tensors):  # what each stage loaded is what the one before it ended with
        assert_same_tensors(weights(PROJECT_ROOT / config["model"]["name_or_path"]), start)
    for before, after in zip(tensors, tensors[1:]):  # and every stage trained it further
        assert any(not torch.equal(before[name], after[name]) for name in before)

    summary = [json.loads(line) for line in (run_dir / "recipe.jsonl").read_text().splitlines()]
    assert [row["stage"] for row in summary] == ["short", "medium", "long"]
    for row, name in zip(summary, STAGES):
        last_row = json.loads((run_dir / "stages" / name / "metrics.jsonl").read_text().splitlines()[-1])
        assert row["metrics"] == last_row and row["metrics"]["step"] == 2 and "val/accuracy" in row["metrics"]
        assert row["weights"] == str(run_dir / "stages" / name / "final")


def test_a_recipe_killed_in_stage_2_resumes_there_with_the_metrics_of_a_run_never_killed(finished_run, tmp_path):
    reference, _ = finished_run
    run_dir = tmp_path / "killed"
    kill_once_a_checkpoint_is_in(command(run_dir), run_dir / "stages" / "02-medium" / "checkpoints")
    assert (run_dir / "stages" / "01-short" / "stage_complete.json").is_file()
    assert not (run_dir / "stages" / "02-medium" / "stage_complete.json").exists()
    stage_1 = files_state(run_dir / "stages" / "01-short")
    stage_1_final = weights(run_dir / "stages" / "01-short" / "final")

    rerun = subprocess.run(command(run_dir), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "stage 1 of 3 (short, grpo): finished earlier, skipped" in rerun.stdout
    # killed after stage 2's step-1 checkpoint; on a loaded machine the kill can land after step 2's (keep_last 1
    # then removed step 1's): either way stage 2 resumes from its own checkpoint instead of starting over
    assert re.search(r"resumed from step_0000000[12]\b", rerun.stdout), rerun.stdout[-2000:]
    assert files_state(run_dir / "stages" / "01-short") == stage_1, "stage 1 was run again"
    stage_2_start = yaml.safe_load((run_dir / "stages" / "02-medium" / "config.yaml").read_text())["model"][
        "name_or_path"
    ]
    assert_same_tensors(weights(PROJECT_ROOT / stage_2_start), stage_1_final)
    # Stage 1 ran in the same process history in both runs: bitwise equal. The stages after it ran here in a
    # process that had not trained stage 1 first, and CPU kernels then round differently (about 1e-7
    # relative, seen the same without any kill): equal up to that rounding.
    assert comparable(run_dir / "stages" / "01-short") == comparable(reference / "stages" / "01-short")
    for name in STAGES[1:]:
        resumed, uninterrupted = comparable(run_dir / "stages" / name), comparable(reference / "stages" / name)
        assert len(resumed) == len(uninterrupted) == 3, name  # steps 0, 1, 2: none lost, none repeated
        for row, expected in zip(resumed, uninterrupted):
            assert row == pytest.approx(expected, rel=1e-3, abs=1e-6), (name, row["step"])
    assert len((run_dir / "recipe.jsonl").read_text().splitlines()) == 3


def test_rerunning_with_a_finished_stage_changed_is_refused_naming_stage_and_setting(finished_run, capsys):
    run_dir, _ = finished_run
    before = files_state(run_dir)
    assert main(command(run_dir, "optimizer.lr=3e-4")[3:]) == 2  # in-process: refused before anything loads
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "reinforge: error: stage 1 of 3 (short, grpo) is finished with optimizer.lr=0.0001"
    )
    assert "new run_dir" in lines[0]
    assert files_state(run_dir) == before


def test_an_sft_then_grpo_recipe_starts_an_uncheckpointed_sft_stage_over_and_chains_its_weights(tmp_path):
    """A leftover SFT stage directory with no checkpoint (checkpoint.save_every=0) is started over in place, not
    suffixed."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join((PROJECT_ROOT / "data" / "demo" / "sft.jsonl").read_text().splitlines(keepends=True)[:16]))
    recipe = tmp_path / "chain.yaml"
    recipe.write_text(
        f"run_dir: {tmp_path / 'run'}\nstages:\n"
        f"  - name: sft\n    algorithm: sft\n    config: {PROJECT_ROOT / 'configs' / 'sft_demo.yaml'}\n"
        f"    overrides: {{data.train_path: {chats}, data.val_fraction: 0, sft.max_steps: 2, sft.random_init: false,\n"
        f"                training.global_batch_size: 8, scheduler.warmup_steps: 0, cluster.num_threads: 1}}\n"
        f"  - name: rl\n    config: {PROJECT_ROOT / 'configs' / 'grpo_demo.yaml'}\n"
        f"    overrides: {{loop.max_steps: 1, rollout.num_prompts_per_step: 2, rollout.num_generations_per_prompt: 4,\n"
        f"                training.global_batch_size: 8, training.micro_batch_size: 8, data.max_val_prompts: 4,\n"
        f"                cluster.num_threads: 1}}\n"
    )
    leftover = tmp_path / "run" / "stages" / "01-sft"  # as a killed run leaves it
    leftover.mkdir(parents=True)
    (tmp_path / "run" / "recipe.yaml").write_text(recipe.read_text())
    (leftover / "metrics.jsonl").write_text('{"step": 1, "train/loss": 99.0}\n')

    sft, rl = run_recipe(recipe)
    assert not (tmp_path / "run" / "stages" / "01-sft-1").exists()
    assert [json.loads(line)["step"] for line in (leftover / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert sft["metrics"]["step"] == 2 and sft["weights"] == str(leftover / "final")
    rl_config = yaml.safe_load((tmp_path / "run" / "stages" / "02-rl" / "config.yaml").read_text())
    assert rl_config["model"]["name_or_path"] == str(leftover / "final")
    trained, start = weights(leftover / "final"), weights(PROJECT_ROOT / "models" / "demo")
    assert any(not torch.equal(trained[name], start[name]) for name in start)
    assert rl["metrics"]["step"] == 1 and "val/accuracy" in rl["metrics"]


CHAIN = PROJECT_ROOT / "configs" / "recipes" / "demo_rl_chain.yaml"
CHAIN_STAGES = ["01-grpo", "02-ppo", "03-distill"]


def chain_command(run_dir):
    return [sys.executable, "-m", "reinforge.cli", "recipe", "--run-dir", str(run_dir), str(CHAIN), *SHORTER]


def test_a_grpo_ppo_distill_recipe_killed_in_its_ppo_stage_resumes_there_like_a_run_never_killed(tmp_path):
    """configs/recipes/demo_rl_chain.yaml: GRPO, then PPO (a critic beside the policy) from GRPO's final weights,
    then distillation from PPO's. Killed once the PPO stage's first checkpoint is in place, the rerun skips the GRPO
    stage, resumes PPO from its checkpoint (critic included) and runs distillation; every stage's metrics equal
    those of the same recipe run through without a kill."""
    reference = tmp_path / "uninterrupted"
    result = subprocess.run(chain_command(reference), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    configs = [yaml.safe_load((reference / "stages" / name / "config.yaml").read_text()) for name in CHAIN_STAGES]
    assert "ppo" in configs[1] and "grpo" not in configs[1] and "distill" in configs[2] and "grpo" in configs[0]
    for config, previous in zip(configs[1:], CHAIN_STAGES):
        assert config["model"]["name_or_path"] == str(reference / "stages" / previous / "final")

    run_dir = tmp_path / "killed"
    checkpoints = run_dir / "stages" / "02-ppo" / "checkpoints"
    kill_once_a_checkpoint_is_in(chain_command(run_dir), checkpoints)
    assert not (run_dir / "stages" / "03-distill").exists()
    assert any((p / "critic").is_dir() for p in checkpoints.iterdir() if p.name.startswith("step_"))

    rerun = subprocess.run(chain_command(run_dir), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "stage 1 of 3 (grpo, grpo): finished earlier, skipped" in rerun.stdout
    assert re.search(r"resumed from step_0000000[12]\b", rerun.stdout), rerun.stdout[-2000:]
    assert comparable(run_dir / "stages" / "01-grpo") == comparable(reference / "stages" / "01-grpo")
    for name in CHAIN_STAGES[1:]:  # other process histories: equal up to CPU kernels' rounding (see above)
        resumed, uninterrupted = comparable(run_dir / "stages" / name), comparable(reference / "stages" / name)
        assert len(resumed) == len(uninterrupted) == 3, name  # steps 0, 1, 2: none lost, none repeated
        for row, expected in zip(resumed, uninterrupted):
            assert row == pytest.approx(expected, rel=1e-3, abs=1e-6), (name, row["step"])
