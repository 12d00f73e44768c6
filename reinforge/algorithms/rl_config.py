"""The sections every RL recipe's run tree shares (`RLRunConfig`), and the loop's own (`loop:`).

Each recipe assembles its root from these plus its own sections (grpo_config.py: `grpo`, `overlong`; ppo_config.py:
`ppo`, `overlong`; distill_config.py: `distill`), so a setting a recipe does not read is an unknown key there.
The loop and its builders (loops/: rl_loop.py, builders.py, checkpointing.py, refit.py) read only these shared
sections.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from reinforge.algorithms.policy_loss import PolicyLossConfig
from reinforge.cluster.config import ClusterConfig
from reinforge.config.section import Section
from reinforge.data.curriculum import CurriculumConfig
from reinforge.data.prompts import DataConfig
from reinforge.envs.registry import EnvConfig
from reinforge.generation.base import GenerationConfig
from reinforge.generation.vllm_config import MOVED_VLLM_KEYS
from reinforge.hang import DeadlinesConfig
from reinforge.logging.loggers import LoggingConfig
from reinforge.model_config import VLLM_LORA_RANKS, ModelConfig, adapter_sync
from reinforge.rollout.agent_config import AgentConfig
from reinforge.rollout.rollout import RolloutConfig
from reinforge.training.base import TrainingConfig
from reinforge.training.checkpoint import CheckpointConfig
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.parallel.engine_layout import EngineLayout, engine_layout_problem

# Keys of earlier versions (before each recipe had its own tree) and where they are now, for the unknown-key error.
MOVED_KEYS = {
    **{f"grpo.{name}": f"rollout.{name}" for name in ("num_prompts_per_step", "num_generations_per_prompt")},
    **{f"grpo.{name}": f"rollout.{name}" for name in ("max_turns", "turn_reward", "max_observation_tokens")},
    "grpo.rollout": "rollout.driver",
    "grpo.async_rollouts": "rollout.mode=async",
    "rollout.async_generation": "rollout.mode=async",
    "grpo.max_staleness": "rollout.max_staleness",
    **{f"grpo.{name}": f"loop.{name}" for name in ("max_steps", "val_every", "val_benchmarks")},
    **{f"grpo.{name}": f"loop.{name}" for name in ("val_benchmark_limit", "val_benchmark_k")},
    "grpo.overlong_buffer_tokens": "overlong.buffer_tokens",
    "grpo.overlong_filtering": "overlong.filtering",
    **{f"training.{name}": f"optimizer.{name}" for name in ("lr", "weight_decay", "adam_beta1", "adam_beta2")},
    **{f"training.{name}": f"optimizer.{name}" for name in ("adam_eps", "max_grad_norm")},
    **{f"training.{name}": f"scheduler.{name}" for name in ("warmup_steps", "lr_schedule")},
    **MOVED_VLLM_KEYS,
}


class LoopConfig(Section):
    """`loop:` how long the RL loop runs and when it validates."""

    max_steps: int = Field(default=20, ge=0)
    """Steps to run (one rollout batch each)."""
    val_every: int = Field(default=5, ge=0)
    """Validate every this many steps (and before the first and after the last); 0: only then."""
    val_benchmarks: list[str] = []
    """Benchmarks evaluated with the validation, as `reinforge eval` does (aime2024, aime2025, math500,
    gsm8k, humaneval, mbpp, ifeval): val/<benchmark>/pass@1, pass@k, maj@k."""
    val_benchmark_limit: int | None = 50
    """First this many prompts of each validation benchmark; null: all."""
    val_benchmark_k: int = 1
    """Samples per benchmark prompt (n = k); 1 is greedy pass@1."""


class RLRunConfig(Section):
    """What every RL run has: the model, its prompts, the engine, the rollouts, the trainer, the environments,
    the cluster, checkpoints and logs. Not a run on its own: a recipe's root adds its sections."""

    moved_keys: ClassVar[dict[str, str]] = MOVED_KEYS

    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    generation: GenerationConfig = GenerationConfig()
    rollout: RolloutConfig = RolloutConfig()
    loop: LoopConfig = LoopConfig()
    training: TrainingConfig = TrainingConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    loss: PolicyLossConfig = PolicyLossConfig()
    env: EnvConfig = EnvConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    agent: AgentConfig = AgentConfig()
    cluster: ClusterConfig = ClusterConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    deadlines: DeadlinesConfig = DeadlinesConfig()
    logging: LoggingConfig = LoggingConfig()

    @property
    def num_trained_models(self) -> int:
        """Models the run trains, each on `training.num_workers` ranks of its own with FSDP2: the policy (a
        recipe that trains more, PPO's critic, says so)."""
        return 1

    @property
    def num_optimizer_steps(self) -> int:
        """The policy's optimizer steps over the whole run (the learning-rate schedule's length)."""
        rollout = self.rollout.num_prompts_per_step * self.rollout.num_generations_per_prompt
        return self.loop.max_steps * (rollout // self.training.global_batch_size)

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence a rollout can make: the prompt, every turn, every observation between turns."""
        rollout = self.rollout
        return (
            self.data.max_prompt_tokens
            + rollout.max_turns * self.generation.max_new_tokens
            + (rollout.max_turns - 1) * rollout.max_observation_tokens
        )

    @property
    def adapter_sync(self) -> bool:
        """Whether the engine takes the LoRA adapter itself (model_config.py, `adapter_sync`)."""
        return adapter_sync(self.model.lora, self.generation.backend)

    @property
    def off_policy(self) -> bool:
        """Whether generation may run ahead of training (async or in-flight generation with staleness >= 1)."""
        return self.rollout.mode != "sync" and self.rollout.max_staleness > 0

    @model_validator(mode="after")
    def _check_batch_sizes(self) -> "RLRunConfig":
        rollout, training = self.rollout, self.training
        rollout_batch = rollout.num_prompts_per_step * rollout.num_generations_per_prompt
        if training.global_batch_size <= 0 or rollout_batch % training.global_batch_size:
            example = rollout_batch // 2 if rollout_batch % 2 == 0 else rollout_batch
            raise ValueError(
                f"training.global_batch_size={training.global_batch_size} does not divide the rollout batch "
                f"(rollout.num_prompts_per_step x rollout.num_generations_per_prompt = {rollout_batch}); "
                f"set it to a divisor of {rollout_batch}, e.g. {rollout_batch} or {example}"
            )
        if training.global_batch_size % training.num_workers:
            raise ValueError(
                f"training.num_workers={training.num_workers} does not divide training.global_batch_size="
                f"{training.global_batch_size}; every rank trains on an equal share, so set it to a divisor"
            )
        if problem := self._engine_layout_problem():
            raise ValueError(problem)
        if rollout.mode != "sync" and training.backend == "fsdp2" and self.cluster.colocate:
            raise ValueError(
                f"rollout.mode={rollout.mode} with training.backend=fsdp2 needs cluster.colocate=false: the engines "
                "generate while the ranks train, so they need resources of their own"
            )
        if (
            rollout.mode == "in_flight"
            and rollout.in_flight_kv_cache == "recompute"
            and self.generation.backend != "vllm"
        ):
            raise ValueError(
                "rollout.in_flight_kv_cache=recompute needs generation.backend=vllm (the HF engine keeps the KV cache "
                "of a request in flight); set it to keep"
            )
        if self.env.num_workers < 0:
            raise ValueError("env.num_workers must be >= 0 (0: score in the driver process)")
        if training.micro_batch_size <= 0 or training.global_batch_size % training.micro_batch_size:
            raise ValueError(
                f"training.micro_batch_size={training.micro_batch_size} does not divide training.global_batch_size="
                f"{training.global_batch_size}; set it to a divisor of {training.global_batch_size}"
            )
        return self

    def _engine_layout_problem(self) -> str | None:
        """The engines' placement (training/parallel/engine_layout.py, the rules the planner proposes by)."""
        cluster, shared = self.cluster, self.cluster.colocate and self.training.backend == "fsdp2"
        if shared and cluster.generation_resources:
            return (
                "cluster.generation_resources with cluster.colocate=true: colocated engines sit in the training "
                "ranks' resources; set cluster.colocate=false, or place them with cluster.training_resources"
            )
        tp = self.generation.vllm.tensor_parallel_size
        layout = EngineLayout(self.generation.num_workers, tp, shared)
        return engine_layout_problem(
            layout, self.training.num_workers, cluster.gpus_per_node, on_gpu=cluster.num_gpus_per_worker > 0
        )

    @model_validator(mode="after")
    def _check_lora(self) -> "RLRunConfig":
        lora = self.model.lora
        if lora is None:
            return self
        if lora.sync == "adapter" and self.generation.backend != "vllm":
            raise ValueError(
                f"model.lora.sync=adapter needs generation.backend=vllm (the {self.generation.backend} engine has no "
                "LoRA support); set model.lora.sync=merged, or generation.backend=vllm"
            )
        if self.adapter_sync and lora.rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(
                f"model.lora.rank={lora.rank} is above vLLM's largest LoRA rank ({VLLM_LORA_RANKS[-1]}) for "
                "adapter sync; set model.lora.sync=merged or a lower rank"
            )
        if self.adapter_sync and lora.vision:
            raise ValueError(
                "model.lora.vision=true adapts the vision tower, which vLLM's LoRA does not (it adapts the language "
                "model only); set model.lora.sync=merged, or model.lora.vision=false"
            )
        if lora.quantize_base != "none" and self.training.backend == "fsdp2":
            raise ValueError(
                f"model.lora.quantize_base={lora.quantize_base} (QLoRA) needs training.backend=torch: FSDP2 does "
                "not shard bitsandbytes' 4-bit weights; set training.backend=torch or quantize_base=none"
            )
        return self

    @model_validator(mode="after")
    def _check_ranges(self) -> "RLRunConfig":
        gen, rollout = self.generation, self.rollout
        checks = [
            (gen.temperature > 0, "generation.temperature must be > 0 for training rollouts (validation is greedy)"),
            (gen.max_new_tokens > 0, "generation.max_new_tokens must be > 0"),
            (0 < gen.top_p <= 1, "generation.top_p must be in (0, 1]"),
            (self.logging.console_every >= 1, "logging.console_every must be >= 1"),
            (
                self.checkpoint.save_every >= 0 and self.checkpoint.keep_last >= 0,
                "checkpoint.save_every and checkpoint.keep_last must be >= 0",
            ),
            (gen.max_logprob_error >= 1, "generation.max_logprob_error must be >= 1 (1 means exact agreement)"),
            (gen.verify_refit_every >= 0, "generation.verify_refit_every must be >= 0 (0 turns the check off)"),
            (gen.verify_refit_columns >= 0, "generation.verify_refit_columns must be >= 0 (0: every column)"),
            (
                not (rollout.mode != "sync" and gen.vllm.sleep_mode),
                f"rollout.mode={rollout.mode} keeps the engine generating while the trainer works, so it never "
                "sleeps; set generation.vllm.sleep_mode to false or null",
            ),
            (
                rollout.driver != "agent" or bool(self.agent.names()),
                "rollout.driver=agent needs an agent: agent.python.NAME=module:function (your own) or "
                "agent.gym.NAME.url=URL (a NeMo Gym agent server)",
            ),
            (
                rollout.driver != "agent" or not self.env.extra_rewards,
                "env.extra_rewards score with in-process environments, which rollout.driver=agent does not use; "
                "score in the agent's verifier (reward_components) instead, or set env.extra_rewards={}",
            ),
            (
                rollout.driver != "agent" or not self.curriculum.prefilter,
                "curriculum.prefilter samples with in-process environments, which rollout.driver=agent does not "
                "use; pre-filter offline (reinforge curriculum prefilter) or set curriculum.prefilter=false",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self
