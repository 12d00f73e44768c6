"""Recipe files into per-stage configs (reinforge/recipes): validation, chaining, override order,
one-line errors, run-directory checks, and the DeepScaleR recipe's plan. Nothing here trains."""

import socket

import pytest

from reinforge.cli import main
from reinforge.errors import ConfigError
from reinforge.paths import PROJECT_ROOT
from reinforge.recipes.markers import check_run_dir
from reinforge.recipes.runner import run_recipe
from reinforge.recipes.spec import expand_overrides, load_recipe
from reinforge.recipes.stages import build_stages

RECIPES = PROJECT_ROOT / "configs" / "recipes"


def stages_of(path, run_dir, overrides=()):
    return build_stages(load_recipe(path), path, run_dir, list(overrides))


def write(path, text):
    path.write_text(text)
    return path


def test_dotted_and_nested_overrides_make_one_tree():
    tree = expand_overrides(
        {"loop.max_steps": 3, "loop": {"val_every": 0, "loss.x": 1}, "env": {"extra_rewards": {"format": 0.5}}}
    )
    assert tree == {
        "loop": {"max_steps": 3, "val_every": 0, "loss": {"x": 1}},
        "env": {"extra_rewards": {"format": 0.5}},
    }


def test_stages_chain_run_dirs_and_final_weights(tmp_path):
    stages = stages_of(RECIPES / "demo_progressive.yaml", tmp_path / "run")
    assert [s.run_dir for s in stages] == [
        tmp_path / "run" / "stages" / n for n in ("01-short", "02-medium", "03-long")
    ]
    assert [s.config.logging.run_dir for s in stages] == [str(s.run_dir) for s in stages]
    assert [s.config.model.name_or_path for s in stages] == [
        "models/demo",
        str(stages[0].run_dir / "final"),
        str(stages[1].run_dir / "final"),
    ]
    assert [s.config.generation.max_new_tokens for s in stages] == [16, 32, 48]
    assert [s.config.checkpoint.resume for s in stages] == ["auto"] * 3
    assert all(s.config.checkpoint.save_final for s in stages)
    assert stages[2].config.optimizer.lr == 2.5e-5 and stages[0].config.optimizer.lr == 1e-4  # base's, then the stage's


def test_base_then_recipe_then_stage_then_command_line_overrides(tmp_path):
    write(tmp_path / "base.yaml", "loop:\n  max_steps: 7\n  val_every: 3\noptimizer:\n  lr: 0.001\nseed: 1\n")
    recipe = write(
        tmp_path / "r.yaml",
        "run_dir: x\nbase: base.yaml\noverrides: {loop.max_steps: 8, seed: 2}\n"
        "stages:\n  - name: a\n    overrides: {loop: {max_steps: 9}}\n  - name: b\n",
    )
    a, b = stages_of(recipe, tmp_path / "run", ["seed=5"])
    assert (a.config.loop.max_steps, a.config.loop.val_every, a.config.optimizer.lr, a.config.seed) == (9, 3, 0.001, 5)
    assert (b.config.loop.max_steps, b.config.seed) == (8, 5)
    assert a.config.checkpoint.save_final and b.config.checkpoint.save_final  # the default, kept for the last


def test_a_reward_model_stage_is_not_the_policy_the_next_stage_starts_from(tmp_path):
    recipe = write(
        tmp_path / "chain.yaml",
        f"run_dir: x\nstages:\n"
        f"  - {{name: sft, algorithm: sft, config: {PROJECT_ROOT}/configs/sft_demo.yaml}}\n"
        f"  - {{name: rm, algorithm: rm, config: {PROJECT_ROOT}/configs/rm_demo.yaml}}\n"
        f"  - {{name: rl, config: {PROJECT_ROOT}/configs/grpo_demo.yaml}}\n",
    )
    sft, rm, rl = stages_of(recipe, tmp_path / "run")
    assert [type(s.config).__name__ for s in (sft, rm, rl)] == ["SFTRunConfig", "RMRunConfig", "GRPORunConfig"]
    assert rm.config.model.name_or_path == str(sft.run_dir / "final")  # the reward model starts from the SFT policy
    assert rl.model_from is sft and rl.config.model.name_or_path == str(sft.run_dir / "final")


@pytest.mark.parametrize(
    "text, message",
    [
        ("run_dir: x\nstagez: []\n", r"unknown key stagez; did you mean stages\?"),
        (
            "run_dir: x\nstages:\n  - {name: a, overides: {}}\n",
            r"unknown key stages\[0\].overides; did you mean overrides\?",
        ),
        (
            "run_dir: x\nstages:\n  - {name: a, algorithm: reinforce}\n",
            r"stages\[0\].algorithm: Input should be 'grpo', 'ppo', 'distill', 'sft', 'dpo' or 'rm'",
        ),
        ("stages:\n  - {name: a}\n", r"run_dir is required"),
        ("run_dir: x\nstages: []\n", r"stages is empty"),
        ("run_dir: x\nstages:\n  - {name: a}\n  - {name: a}\n", r"stage name 'a' is used twice"),
        ("run_dir: x\nstages:\n  - {name: a/b}\n", r"stage 1 name 'a/b' must be letters"),
    ],
)
def test_recipe_file_mistakes_are_one_line_errors_naming_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(write(tmp_path / "r.yaml", text))


@pytest.mark.parametrize(
    "stage_overrides, message",
    [
        (
            "{grpo.max_stepz: 3}",
            r"stage 2 \(b\): unknown config key grpo.max_stepz: reinforge grpo has no such setting; "
            r"did you mean loop.max_steps\?",
        ),
        ("{generation.max_new_tokens: 0}", r"stage 2 \(b\): generation.max_new_tokens must be > 0"),
        ("{data.train_path: nope.jsonl}", r"stage 2 \(b\): data.train_path=nope.jsonl does not exist"),
        ("{logging.run_dir: elsewhere}", r"stage 2 \(b\): logging.run_dir is set by the recipe"),
        ("{model.name_or_path: other}", r"stage 2 \(b\): model.name_or_path is set by the recipe"),
    ],
)
def test_a_bad_stage_setting_names_the_stage_and_the_key(tmp_path, stage_overrides, message):
    recipe = write(
        tmp_path / "r.yaml",
        f"run_dir: x\nbase: {PROJECT_ROOT}/configs/grpo_demo.yaml\n"
        f"stages:\n  - name: a\n  - name: b\n    overrides: {stage_overrides}\n",
    )
    with pytest.raises(ConfigError, match=message):
        stages_of(recipe, tmp_path / "run")


def test_the_command_line_prints_a_bad_key_as_one_line(tmp_path, capsys):
    recipe = write(
        tmp_path / "r.yaml",
        f"run_dir: {tmp_path / 'run'}\nbase: {PROJECT_ROOT}/configs/grpo_demo.yaml\n"
        "stages:\n  - {name: a, overrides: {grpo.num_generatoins: 4}}\n",
    )
    assert main(["recipe", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"reinforge: error: recipe {recipe}, stage 1 (a): unknown config key grpo.num_generatoins: "
        "reinforge grpo has no such setting; did you mean rollout.num_generations_per_prompt?"
    ]
    assert not (tmp_path / "run").exists()


def test_a_run_directory_that_is_not_this_recipe_run_is_refused(tmp_path):
    stages = stages_of(RECIPES / "demo_progressive.yaml", tmp_path / "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")  # say, a GRPO run's directory
    with pytest.raises(ConfigError, match=r"holds something other than a recipe's run"):
        check_run_dir(tmp_path / "run", stages)
    (tmp_path / "run" / "recipe.yaml").write_text("")
    assert check_run_dir(tmp_path / "run", stages) == {}
    (tmp_path / "run" / "stages" / "02-renamed").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"02-renamed is not a stage of this recipe"):
        check_run_dir(tmp_path / "run", stages)


def test_deepscaler_recipe_validates_without_network_into_8k_16k_24k_stages(tmp_path, monkeypatch, capsys):
    def no_network(*args, **kwargs):
        raise OSError("network access in a --validate run")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    run_recipe(RECIPES / "deepscaler-1.5b.yaml", run_dir=str(tmp_path / "run"), validate_only=True)
    table = [line.split() for line in capsys.readouterr().out.splitlines() if line[:2] in ("1 ", "2 ", "3 ")]
    assert [(row[1], row[4], row[5]) for row in table] == [
        ("8k", "240", "8192"),
        ("16k", "290", "16384"),
        ("24k", "50", "24576"),
    ]
    assert not (tmp_path / "run").exists()

    first, second, third = stages_of(RECIPES / "deepscaler-1.5b.yaml", tmp_path / "run")
    assert (
        first.config.model.name_or_path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
        and first.config.model.dtype == "bfloat16"
    )
    assert third.config.model.name_or_path == str(second.run_dir / "final")
    assert {
        (s.config.training.backend, s.config.generation.backend, s.config.cluster.num_gpus_per_worker)
        for s in (first, second, third)
    } == {("fsdp2", "vllm", 1.0)}
    assert [
        (s.config.loss.kl_coef, s.config.loss.clip_eps_high, s.config.optimizer.lr) for s in (first, second, third)
    ] == [(0.0, 0.2, 2e-6), (0.001, 0.28, 2e-6), (0.0001, 0.28, 5e-7)]
    assert (
        first.config.rollout.num_prompts_per_step,
        first.config.rollout.num_generations_per_prompt,
        first.config.training.global_batch_size,
    ) == (128, 8, 64)
