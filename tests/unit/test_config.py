import typing

import pytest
import yaml

from reinforge.algorithms.distill_config import DistillRunConfig
from reinforge.algorithms.grpo_config import GRPORunConfig, load_config
from reinforge.algorithms.ppo_config import PPORunConfig
from reinforge.config.loader import load_recipe_config, save_config
from reinforge.errors import ConfigError
from reinforge.loops.registry import RECIPES


def test_misspelled_override_names_the_nearest_valid_key():
    with pytest.raises(
        ConfigError,
        match=r"^unknown config key grpo.num_generatoins: reinforge grpo has no such setting; "
        r"did you mean rollout.num_generations_per_prompt\?$",
    ):
        load_config(None, ["grpo.num_generatoins=4"])


def test_unknown_key_in_a_yaml_file_is_an_error_with_a_suggestion(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optimizer:\n  weight_decy: 0.1\n")
    with pytest.raises(
        ConfigError,
        match=r"^unknown config key optimizer.weight_decy: reinforge grpo has no such setting; "
        r"did you mean optimizer.weight_decay\?$",
    ):
        load_config(path)


@pytest.mark.parametrize(
    "old, new",
    [
        ("grpo.max_steps", "loop.max_steps"),
        ("grpo.val_every", "loop.val_every"),
        ("grpo.num_prompts_per_step", "rollout.num_prompts_per_step"),
        ("grpo.num_generations_per_prompt", "rollout.num_generations_per_prompt"),
        ("grpo.max_turns", "rollout.max_turns"),
        ("grpo.max_staleness", "rollout.max_staleness"),
        ("grpo.rollout", "rollout.driver"),
        ("grpo.async_rollouts", "rollout.mode=async"),
        ("grpo.overlong_buffer_tokens", "overlong.buffer_tokens"),
        ("grpo.overlong_filtering", "overlong.filtering"),
        ("training.lr", "optimizer.lr"),
        ("training.max_grad_norm", "optimizer.max_grad_norm"),
        ("training.warmup_steps", "scheduler.warmup_steps"),
        ("training.lr_schedule", "scheduler.lr_schedule"),
        ("generation.vllm_block_size", "generation.vllm.block_size"),
        ("generation.vllm_gpu_memory_utilization", "generation.vllm.gpu_memory_utilization"),
        ("generation.vllm_sleep_mode", "generation.vllm.sleep_mode"),
    ],
)
def test_a_moved_key_is_refused_and_the_error_names_its_new_place(old, new):
    with pytest.raises(
        ConfigError, match=rf"^unknown config key {old}: reinforge grpo has no such setting; did you mean {new}\?$"
    ):
        load_config(None, [f"{old}=1"])


@pytest.mark.parametrize(
    "key, hint",
    [
        ("baseline", r"its sections are .*\bppo\b"),
        ("normalize_std", r"its sections are .*\bppo\b"),
        ("decoupled_normalization", r"its sections are .*\bppo\b"),
        ("skip_zero_advantage", r"its sections are .*\bppo\b"),
        ("whiten_advantages", r"did you mean ppo.whiten_advantages\?"),  # PPO's own whitening, of GAE's advantages
    ],
)
def test_ppo_refuses_grpo_advantage_settings_it_does_not_read(key, hint):
    with pytest.raises(
        ConfigError, match=rf"^unknown config key grpo.{key}: reinforge ppo has no grpo section; {hint}"
    ):
        load_recipe_config(PPORunConfig, None, [f"grpo.{key}=false"])


def test_distillation_refuses_grpo_losses_and_the_kl_in_the_reward():
    with pytest.raises(
        ConfigError, match=r"^unknown config key grpo.whiten_advantages: reinforge distill has no grpo section"
    ):
        load_recipe_config(DistillRunConfig, None, ["grpo.whiten_advantages=true"])
    with pytest.raises(
        ConfigError,
        match=r"^unknown config key grpo.normalize_std: reinforge distill has no grpo section; "
        r"did you mean distill.reward_normalize_std\?$",
    ):
        load_recipe_config(DistillRunConfig, None, ["grpo.normalize_std=false"])
    with pytest.raises(
        ConfigError, match=r"^unknown config key loss.kl_in_reward: reinforge distill has no such setting"
    ):
        load_recipe_config(DistillRunConfig, None, ["loss.kl_coef=0.1", "loss.kl_in_reward=true"])
    with pytest.raises(
        ConfigError, match=r"^unknown config key overlong.buffer_tokens: reinforge distill has no overlong"
    ):
        load_recipe_config(DistillRunConfig, None, ["overlong.buffer_tokens=4"])
    # the same settings are GRPO's and PPO's, so the refusals above are distillation's tree, not a typo
    for root in (GRPORunConfig, PPORunConfig):
        config = load_recipe_config(root, None, ["loss.kl_coef=0.1", "loss.kl_in_reward=true"])
        assert config.loss.kl_in_reward is True
    assert load_config(None, ["grpo.whiten_advantages=true"]).grpo.whiten_advantages is True


def test_grpo_refuses_ppo_settings():
    with pytest.raises(
        ConfigError,
        match=r"^unknown config key ppo.gamma: reinforge grpo has no ppo section; its sections are .*\bgrpo\b",
    ):
        load_config(None, ["ppo.gamma=0.9"])
    assert load_recipe_config(PPORunConfig, None, ["ppo.gamma=0.9"]).ppo.gamma == 0.9


RL_SECTIONS = {
    "seed",
    "model",
    "data",
    "generation",
    "rollout",
    "loop",
    "training",
    "optimizer",
    "scheduler",
    "loss",
    "env",
    "curriculum",
    "agent",
    "cluster",
    "checkpoint",
    "deadlines",
    "logging",
}
OFFLINE_SECTIONS = {
    "seed",
    "cluster",
    "deadlines",
    "model",
    "data",
    "training",
    "optimizer",
    "scheduler",
    "checkpoint",
    "logging",
}


def test_each_recipe_has_exactly_the_sections_it_reads():
    assert {name: set(recipe.config_class.model_fields) for name, recipe in RECIPES.items()} == {
        "grpo": RL_SECTIONS | {"grpo", "overlong"},
        "ppo": RL_SECTIONS | {"ppo", "overlong"},
        "distill": RL_SECTIONS | {"distill"},
        "sft": OFFLINE_SECTIONS | {"sft"},
        "dpo": OFFLINE_SECTIONS | {"dpo"},
        "rm": OFFLINE_SECTIONS | {"rm"},
    }


def test_override_values_are_type_checked():
    with pytest.raises(ConfigError, match=r"config key loop.max_steps: .*integer.*'abc'"):
        load_config(None, ["loop.max_steps=abc"])
    with pytest.raises(ConfigError, match=r"config key generation.backend"):
        load_config(None, ["generation.backend=nonsense"])


def test_overrides_parse_numbers_booleans_nulls_and_keep_strings():
    config = load_config(
        None, ["optimizer.lr=1e-4", "grpo.normalize_std=false", "loss.dual_clip_c=null", "model.name_or_path=123"]
    )
    assert config.optimizer.lr == 1e-4
    assert config.grpo.normalize_std is False
    assert config.loss.dual_clip_c is None
    assert config.model.name_or_path == "123"


def test_batch_sizes_that_do_not_divide_say_field_reason_and_fix():
    with pytest.raises(
        ConfigError,
        match=r"training.global_batch_size=100 does not divide the rollout batch .* = 128\); "
        r"set it to a divisor of 128",
    ):
        load_config(None, ["training.global_batch_size=100"])
    with pytest.raises(
        ConfigError, match=r"training.micro_batch_size=48 does not divide training.global_batch_size=128"
    ):
        load_config(None, ["training.micro_batch_size=48"])


def test_vllm_settings_are_read_from_their_section_and_refused_with_the_hf_engine():
    config = load_config(
        None, ["generation.backend=vllm", "generation.vllm.block_size=32", "data.max_prompt_tokens=50"]
    )
    assert config.generation.vllm.block_size == 32
    from reinforge.loops.builders import vllm_engine_kwargs

    kwargs = vllm_engine_kwargs(config)  # the context: prompt + new tokens (64 by default), vllm.max_model_len unset
    assert (kwargs["block_size"], kwargs["max_model_len"]) == (32, 50 + 64)
    with pytest.raises(
        ConfigError,
        match=r"^generation.vllm configures the vLLM engine, and generation.backend=hf; set generation.backend=vllm, "
        r"or remove generation.vllm$",
    ):
        load_config(None, ["generation.vllm.block_size=32"])


@pytest.mark.parametrize("recipe", ["grpo", "ppo", "distill", "sft", "dpo", "rm"])
def test_every_recipe_checks_the_backend_rules_on_its_training_section(recipe):
    config_class = RECIPES[recipe].config_class
    with pytest.raises(ConfigError, match=r"^training.num_workers=2 needs training.backend=fsdp2; the torch backend"):
        load_recipe_config(config_class, None, ["training.num_workers=2"])
    with pytest.raises(ConfigError, match=r"^training.cpu_offload=true needs training.backend=fsdp2"):
        load_recipe_config(config_class, None, ["training.cpu_offload=true"])
    with pytest.raises(ConfigError, match=r"^config key training.num_workers: Input should be greater than or equal"):
        load_recipe_config(config_class, None, ["training.num_workers=0"])


def test_lora_sync_settings_the_engine_cannot_take_are_one_line_errors():
    from reinforge.loops.builders import vllm_engine_kwargs
    from reinforge.model_config import VLLM_LORA_RANKS, vllm_max_lora_rank

    with pytest.raises(
        ConfigError,
        match=r"^model.lora.sync=adapter needs generation.backend=vllm \(the hf engine has no LoRA support\); "
        r"set model.lora.sync=merged",
    ):
        load_config(None, ["model.lora.rank=8", "model.lora.sync=adapter"])
    with pytest.raises(ConfigError, match=r"model.lora.rank=600 is above vLLM's largest LoRA rank \(512\)"):
        load_config(None, ["model.lora.rank=600", "generation.backend=vllm"])
    # auto: vLLM takes the adapter, rounded up to a rank it accepts; the HF engine takes merged weights
    vllm = ["model.lora.rank=12", "generation.backend=vllm"]
    assert vllm_engine_kwargs(load_config(None, vllm))["lora_rank"] == 12
    assert vllm_engine_kwargs(load_config(None, [*vllm, "model.lora.sync=merged"]))["lora_rank"] is None
    assert [vllm_max_lora_rank(r) for r in (1, 2, 12, 16, 300, 512)] == [1, 8, 16, 16, 320, 512]
    from vllm.config.lora import MaxLoRARanks

    assert VLLM_LORA_RANKS == typing.get_args(MaxLoRARanks)  # the sizes of the vLLM installed


def test_defaults_key_inherits_and_the_child_wins_key_by_key(tmp_path):
    (tmp_path / "base.yaml").write_text("loop:\n  max_steps: 7\n  val_every: 3\noptimizer:\n  lr: 0.001\n")
    (tmp_path / "child.yaml").write_text("defaults: base.yaml\nloop:\n  max_steps: 9\n")
    config = load_config(tmp_path / "child.yaml", ["optimizer.lr=0.002"])
    assert (config.loop.max_steps, config.loop.val_every, config.optimizer.lr) == (9, 3, 0.002)


def test_saved_config_loads_back_equal(tmp_path):
    config = load_config(None, ["loop.max_steps=3", "generation.stop_strings=[END]", "seed=5"])
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config
    assert set(yaml.safe_load((tmp_path / "config.yaml").read_text())) == set(GRPORunConfig.model_fields)


def test_missing_config_file_and_bad_yaml_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("loop:\n  max_steps: [1,\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)


def test_router_replay_off_on_the_command_line_is_off_not_yaml_false():
    assert load_config(None, ["model.moe.router_replay=off"]).model.moe.router_replay == "off"
    assert load_config(None, ["model.moe.router_replay=rollout"]).model.moe.router_replay == "rollout"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster.training_resources={GPU: 1}"], "cluster.training_resources names Ray's own resource 'GPU'"),
        (["cluster.colocate=false", "cluster.generation_resources={node_b: 0}"], "generation_resources.node_b=0 must"),
        (
            ["training.backend=fsdp2", "training.num_workers=2", "cluster.generation_resources={node_b: 1}"],
            "cluster.generation_resources with cluster.colocate=true",
        ),
        (
            ["generation.backend=vllm", "generation.vllm.tensor_parallel_size=16", "cluster.num_gpus_per_worker=1"],
            "tensor_parallel_size=16 exceeds the 8 GPUs of a node (cluster.gpus_per_node)",
        ),
    ],
)
def test_placement_settings_the_run_cannot_honour_are_one_line_errors(overrides, message):
    """Custom resources and engine layouts are checked as the config loads, before any run directory exists."""
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_placement_by_custom_resource_loads():
    config = load_config(
        None,
        [
            "cluster.colocate=false",
            "cluster.training_resources={node_a: 1}",
            "cluster.generation_resources={node_b: 1}",
        ],
    )
    assert config.cluster.training_resources == {"node_a": 1.0} and config.cluster.generation_resources == {"node_b": 1}
