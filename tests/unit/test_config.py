import typing

import pytest
import yaml

from reinforge.config import Config, load_config, save_config
from reinforge.errors import ConfigError


def test_misspelled_override_names_the_nearest_valid_key():
    with pytest.raises(
        ConfigError, match=r"unknown config key grpo.num_generatoins; did you mean grpo.num_generations_per_prompt\?"
    ):
        load_config(None, ["grpo.num_generatoins=4"])


def test_unknown_key_in_a_yaml_file_is_an_error_with_a_suggestion(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  learning_rate: 1e-5\n")
    with pytest.raises(ConfigError, match=r"unknown config key training.learning_rate; did you mean training.lr\?"):
        load_config(path)


def test_override_values_are_type_checked():
    with pytest.raises(ConfigError, match=r"config key grpo.max_steps: .*integer.*'abc'"):
        load_config(None, ["grpo.max_steps=abc"])
    with pytest.raises(ConfigError, match=r"config key generation.backend"):
        load_config(None, ["generation.backend=nonsense"])


def test_overrides_parse_numbers_booleans_nulls_and_keep_strings():
    config = load_config(
        None, ["training.lr=1e-4", "grpo.normalize_std=false", "loss.dual_clip_c=null", "model.name_or_path=123"]
    )
    assert config.training.lr == 1e-4
    assert config.grpo.normalize_std is False
    assert config.loss.dual_clip_c is None
    assert config.model.name_or_path == "123"


def test_batch_sizes_that_do_not_divide_say_field_reason_and_fix():
    with pytest.raises(
        ConfigError,
        match=r"training.global_batch_size=100 does not divide the rollout batch .* = 128\); set it to a divisor of 128",
    ):
        load_config(None, ["training.global_batch_size=100"])
    with pytest.raises(
        ConfigError, match=r"training.micro_batch_size=48 does not divide training.global_batch_size=128"
    ):
        load_config(None, ["training.micro_batch_size=48"])


def test_lora_sync_settings_the_engine_cannot_take_are_one_line_errors():
    from reinforge.generation.vllm_backend import engine_kwargs
    from reinforge.training.lora_config import VLLM_LORA_RANKS, vllm_max_lora_rank

    with pytest.raises(
        ConfigError,
        match=r"^model.lora.sync=adapter needs generation.backend=vllm \(the hf engine has no LoRA support\); set model.lora.sync=merged",
    ):
        load_config(None, ["model.lora.rank=8", "model.lora.sync=adapter"])
    with pytest.raises(ConfigError, match=r"model.lora.rank=600 is above vLLM's largest LoRA rank \(512\)"):
        load_config(None, ["model.lora.rank=600", "generation.backend=vllm"])
    # auto: vLLM takes the adapter, rounded up to a rank it accepts; the HF engine takes merged weights
    assert engine_kwargs(load_config(None, ["model.lora.rank=12", "generation.backend=vllm"]))["lora_rank"] == 12
    assert (
        engine_kwargs(load_config(None, ["model.lora.rank=12", "generation.backend=vllm", "model.lora.sync=merged"]))[
            "lora_rank"
        ]
        is None
    )
    assert [vllm_max_lora_rank(r) for r in (1, 2, 12, 16, 300, 512)] == [1, 8, 16, 16, 320, 512]
    from vllm.config.lora import MaxLoRARanks

    assert VLLM_LORA_RANKS == typing.get_args(MaxLoRARanks)  # the sizes of the vLLM installed


def test_defaults_key_inherits_and_the_child_wins_key_by_key(tmp_path):
    (tmp_path / "base.yaml").write_text("grpo:\n  max_steps: 7\n  val_every: 3\ntraining:\n  lr: 0.001\n")
    (tmp_path / "child.yaml").write_text("defaults: base.yaml\ngrpo:\n  max_steps: 9\n")
    config = load_config(tmp_path / "child.yaml", ["training.lr=0.002"])
    assert (config.grpo.max_steps, config.grpo.val_every, config.training.lr) == (9, 3, 0.002)


def test_saved_config_loads_back_equal(tmp_path):
    config = load_config(None, ["grpo.max_steps=3", "generation.stop_strings=[END]", "seed=5"])
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config
    assert set(yaml.safe_load((tmp_path / "config.yaml").read_text())) == set(Config.model_fields)


def test_fixed_top_level_sections_exist():
    assert set(Config.model_fields) == {
        "seed",
        "model",
        "data",
        "generation",
        "training",
        "grpo",
        "loss",
        "env",
        "curriculum",
        "agent",
        "cluster",
        "checkpoint",
        "logging",
    }


def test_missing_config_file_and_bad_yaml_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  max_steps: [1,\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
