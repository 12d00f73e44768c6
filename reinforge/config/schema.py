"""The typed configuration tree.

Every setting lives here once, with its default and a docstring under it (STYLE.md #6). YAML files and
`key=value` overrides are only serialisations of this tree; `loader.py` turns them into it and
reports unknown keys with the nearest valid one. Cross-field checks run when the tree is built and
say which field is wrong, why, and what to set instead.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from reinforge.config.section import Section
from reinforge.envs.code_env import CodeEnvConfig
from reinforge.envs.format_env import FormatEnvConfig
from reinforge.envs.gym_config import GymResourcesConfig
from reinforge.envs.http_client import RemoteEnvConfig
from reinforge.envs.ifeval import IfEvalConfig
from reinforge.envs.judge import JudgeEnvConfig
from reinforge.envs.tool_use import ToolUseEnvConfig
from reinforge.logging.loggers import LoggersConfig
from reinforge.model_config import ModelConfig  # defined apart so that modeling.py imports it without the schema
from reinforge.rollout.agent_config import AgentConfig
from reinforge.training.lora_config import VLLM_LORA_RANKS, adapter_sync


class DataConfig(Section):
    train_path: str = "data/demo/train.jsonl"
    """JSONL file of training prompts; one object per line with `prompt` and `answer` (and `task`)."""
    val_path: str | None = "data/demo/val.jsonl"
    """JSONL file of held-out prompts for validation; null disables validation."""
    prompt_key: str = "prompt"
    """Record field holding the user message."""
    system_prompt: str | None = None
    """Optional system message put before every prompt whose record has no `system_key` field."""
    system_key: str = "system"
    """Record field holding that record's own system message (e.g. "detailed thinking on"); when a
    record has it (not null) it replaces `system_prompt` for that record, "" meaning none."""
    use_chat_template: bool = True
    """Render prompts with the tokenizer's chat template; false feeds the prompt text as it is."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this (after templating) are dropped from the dataset, with a count."""
    max_val_prompts: int | None = None
    """Use at most this many validation prompts (the first ones); null: all."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (seeded by `seed`)."""


class GenerationConfig(Section):
    backend: Literal["hf", "vllm"] = "hf"
    """Generation engine: `hf` (Hugging Face transformers, the reference implementation) or `vllm`."""
    max_new_tokens: int = 64
    """Longest completion; a sample that reaches it without a stop is marked truncated."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts; the trainer applies the same temperature to its logits."""
    top_p: float = 1.0
    """Nucleus sampling threshold; 1.0 disables it."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    stop_strings: list[str] = []
    """Extra strings that end a completion (the tokenizer's EOS always does)."""
    max_batch_size: int = 256
    """Most sequences the HF backend decodes at once; larger requests are split."""
    num_workers: int = 1
    """Generation engines, data-parallel over prompts, when the run uses Ray (training.backend=fsdp2)."""
    max_logprob_error: float = 1.05
    """Consistency gate: stop the run when the engine's and the trainer's logprobs of the same tokens
    differ by more than this token_mult_prob_error (checked at start-up and after the first refit)."""
    num_probe_prompts: int = 8
    """Training prompts sampled by the consistency probe."""
    vllm_max_model_len: int | None = None
    """vLLM's context length; null: data.max_prompt_tokens + generation.max_new_tokens."""
    vllm_enforce_eager: bool | None = None
    """Disable vLLM's torch.compile/CUDA graphs; null: eager on CPU (compiling costs ~35 s there), compiled on GPU."""
    vllm_block_size: int | None = None
    """Tokens per vLLM KV-cache block; null: vLLM's default (128 on CPU, 16 on GPU). On CPU (a multiple of 32
    there) 32 suits short sequences: the CPU attention kernel computes whole blocks, and the demo model
    generates 1.4x faster with 32 than with 128 (docs/benchmarks.md)."""
    vllm_cpu_kv_cache_gb: int = 1
    """vLLM KV-cache size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    vllm_gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take for weights and KV cache (the trainer needs the rest when colocated)."""
    vllm_sleep_mode: bool | None = None
    """Put vLLM to sleep while the trainer works (weights offloaded to CPU memory, KV cache freed) and
    wake it for the refit and the next rollout, so training and generation share a GPU's memory in
    turns; null: on when a GPU is present, off on CPU (where vLLM has no sleep mode)."""


class TrainingConfig(Section):
    backend: Literal["torch", "fsdp2"] = "torch"
    """Training engine: `torch` (one process, plain PyTorch) or `fsdp2` (PyTorch FSDP2 over
    `training.num_workers` ranks in Ray actors; gloo on CPU, NCCL on GPU)."""
    num_workers: int = 1
    """Training ranks for `fsdp2`; each trains on global_batch_size / num_workers sequences per step."""
    micro_batch_size: int = 32
    """Sequences per forward/backward pass; gradients accumulate over micro-batches."""
    global_batch_size: int = 128
    """Sequences per optimizer step. Must divide the rollout batch (prompts x generations)."""
    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to `lr`."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate shape after warm-up, over all optimizer steps of the run."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them:
    activation memory drops from O(layers) to O(1) layers for about a third more compute."""
    compile: bool = False
    """`torch.compile` each decoder layer and the LM head's logprob chunks: Inductor fuses the
    memory-bound work between the matmuls (norms, SwiGLU, rotary embedding; the upcast, log-sum-exp and
    entropy over the vocabulary). Worth it on GPUs (docs/benchmarks.md has the measured gain); the
    first steps pay the compilation, and small models on CPU gain nothing."""
    cpu_offload: bool = False
    """`fsdp2` on GPU: keep the sharded fp32 parameters, gradients and AdamW state in CPU memory and
    run the optimizer step there (FSDP2 CPUOffloadPolicy); frees GPU memory for 70B-class models."""
    sequence_packing: bool = True
    """GRPO logprob and training passes: lay a micro-batch's sequences end to end in rows as wide as its
    longest sequence (first-fit decreasing), each attending to itself only (training/segment_attention.py,
    whatever the model's attention implementation), instead of one right-padded sequence per row, so no
    compute is spent on padding. Same logprobs, loss and gradients as unpacked
    (tests/unit/test_packing_rl.py). (SFT packs with its own `sft.packing`.)"""
    share_prompts: bool = True
    """With `sequence_packing`: lay the samples of one prompt in a row as the prompt once, then each
    response attending to it and to itself (training/segment_attention.py: each answer attends over its
    prompt and itself only, whatever the model's attention implementation), so the prompt's other
    copies are not computed; same logprobs, loss and gradients (tests/unit/test_packing_rl.py). All the
    samples of a prompt share one copy, or as many as fit in `micro_batch_tokens`."""
    micro_batch_tokens: int | None = None
    """GRPO logprob and training passes: build micro-batches to this many computed positions (rows x
    row width, padding included) instead of `micro_batch_size` sequences, longest rows first; a sequence
    longer than the budget gets a micro-batch of its own. null: `micro_batch_size` sequences. (SFT sizes
    its micro-batches with `sft.micro_batch_tokens`.)"""
    logprob_chunk_tokens: int = 2048
    """Apply the LM head to at most this many tokens at a time when computing logprobs and entropies (the
    training pass recomputes each chunk's logits in the backward pass), so memory grows with
    chunk x vocabulary, not with sequence length x vocabulary."""

    @model_validator(mode="after")
    def _check_micro_batching(self) -> "TrainingConfig":
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(
                f"training.micro_batch_tokens={self.micro_batch_tokens} must be >= 1, or null to group "
                "micro-batches by training.micro_batch_size sequences"
            )
        if self.logprob_chunk_tokens < 1:
            raise ValueError(
                f"training.logprob_chunk_tokens={self.logprob_chunk_tokens} must be >= 1 "
                "(tokens per LM-head chunk; 2048 is a good default)"
            )
        return self


class GRPOConfig(Section):
    rollout: Literal["reinforge", "agent"] = "reinforge"
    """Who drives an episode: `reinforge` samples the turns itself and asks the environments (env.*);
    `agent` hands each episode to an agent (agent.*: a NeMo Gym agent server, or your own Python
    function) that calls the policy through the run's OpenAI-compatible endpoint; the trajectory is
    rebuilt from what the endpoint recorded (docs/agents.md)."""
    num_prompts_per_step: int = 16
    """Distinct prompts per step."""
    num_generations_per_prompt: int = 8
    """Completions sampled per prompt (the group size G)."""
    max_steps: int = 20
    """Steps to run (one rollout batch each)."""
    val_every: int = 5
    """Validate every this many steps (and before the first and after the last); 0: only then."""
    baseline: Literal["mean", "leave_one_out"] = "mean"
    """Group baseline: the group mean, or the mean of the other samples (RLOO)."""
    normalize_std: bool = True
    """Divide advantages by the group's reward standard deviation (GRPO); false for Dr.GRPO."""
    whiten_advantages: bool = False
    """After the group baseline, normalise the advantages by the mean and standard deviation of the whole
    batch, all groups together (REINFORCE++'s global advantage normalisation)."""
    whiten_over: Literal["tokens", "sequences"] = "tokens"
    """What the batch whitening (and GDPO's) averages over: every valid token, each carrying its sequence's
    advantage (REINFORCE++'s paper and reference implementations), or each sequence once."""
    decoupled_normalization: bool = False
    """GDPO (arXiv:2601.05242): normalise each reward component within its group, sum them with their weights,
    then whiten the sum over the batch, instead of normalising the summed reward. The components are the
    task reward and each of `env.extra_rewards` (with their weights), or else an agent's `reward_components`
    when they sum to its reward; a trajectory without them is one component (GRPO, whitened)."""
    skip_zero_advantage: bool = True
    """Leave sequences whose advantage is exactly 0 (groups whose rewards are all equal), and those with no
    token to train on (overlong filtering), out of the training pass when `loss.kl_coef` is 0: their loss
    is 0 whatever the policy, so they add nothing to the gradient.
    The loss still divides by the whole batch's counts, so the update is the same (up to float summation
    order); metric means (entropy, clip fraction, mismatch) are then over the sequences trained on."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (they have no advantage) and roll out
    further batches of `num_prompts_per_step` prompts until that many groups remain; the surplus is discarded."""
    dynamic_sampling_max_extra_rounds: int = 4
    """Most extra rollout rounds per step under dynamic sampling; when they are used up the step trains on
    the groups it has (fewer than `num_prompts_per_step`; none: the step is skipped)."""
    overlong_buffer_tokens: int = 0
    """L_cache of DAPO's soft overlong punishment: a reward penalty growing linearly from 0 to -1 over the
    last L_cache tokens before `generation.max_new_tokens` (L_max); single-turn only; 0 disables it."""
    overlong_filtering: bool = False
    """DAPO's overlong filtering: truncated answers (no stop before `generation.max_new_tokens`) are masked
    out of the loss; their rewards still count in their group's baseline."""
    val_benchmarks: list[str] = []
    """Benchmarks evaluated with the validation, as `reinforge eval` does (aime2024, aime2025, math500,
    gsm8k, humaneval, mbpp, ifeval): val/<benchmark>/pass@1, pass@k, maj@k."""
    val_benchmark_limit: int | None = 50
    """First this many prompts of each validation benchmark; null: all."""
    val_benchmark_k: int = 1
    """Samples per benchmark prompt (n = k); 1 is greedy pass@1."""
    max_turns: int = 1
    """Policy turns per trajectory: above 1, an environment may answer a turn with observations (tool
    results) that are appended as tokens, never trained on, and the policy continues."""
    turn_reward: Literal["last", "sum"] = "last"
    """Multi-turn reward: the last turn's, or the sum over turns (e.g. with per-call penalties)."""
    max_observation_tokens: int = 256
    """Longest observation appended in one turn; longer ones are cut (the chat template's framing kept)."""
    async_rollouts: bool = False
    """Async GRPO: the next steps' rollouts are generated while the current step trains, at most
    `max_staleness` policy versions behind; the engine pauses only for each refit. The engines then run
    as Ray actors with resources of their own (`generation.num_workers` x `cluster.num_cpus_per_worker`
    / `num_gpus_per_worker`; with FSDP2, `cluster.colocate=false`)."""
    max_staleness: int = Field(default=1, ge=0)
    """With `async_rollouts`: the most training steps the policy that generated a batch may lag behind
    the policy that trains on it. 0 is synchronous GRPO (same metrics as `async_rollouts=false`); 1
    overlaps each step's training with the next step's generation."""


class LossConfig(Section):
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen reference policy; 0 does not load the reference."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimate of KL(policy || reference) (Schulman 2020), with log r = logp_ref - logp: `k1` = -log r,
    `k2` = (log r)^2 / 2, `k3` = r - 1 - log r. In the loss their expected gradients differ: k1's is 0, k2's is
    that of KL(policy || reference), k3's (GRPO's choice) that of KL(reference || policy); in the reward
    (`kl_in_reward`) k1 gives that of KL(policy || reference). docs/algorithms.md derives them."""
    kl_in_reward: bool = False
    """Put the KL penalty in the reward instead of the loss (InstructGPT's PPO): each sequence's reward loses
    kl_coef x the sum of its tokens' estimates (old policy against reference, before the step's updates), so
    the penalty is normalised with the rewards and the loss has no KL term."""
    policy_loss: Literal["ppo_clip", "cispo"] = "ppo_clip"
    """`ppo_clip`: PPO's clipped surrogate (a clipped token gives no gradient); `cispo`: MiniMax-M1's CISPO, the
    importance weight clipped to [1 - clip_eps_low, 1 + clip_eps_high] and detached, times A log pi, so every
    token keeps a gradient (the paper sets no lower bound: clip_eps_low 1.0)."""
    clip_eps_low: float = 0.2
    """Lower clip: the ratio is clipped below at 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip: the ratio is clipped above at 1 + clip_eps_high (0.28 is DAPO's clip-higher)."""
    dual_clip_c: float | None = None
    """Dual-clip bound c > 1 for negative advantages (Ye et al. 2020); null disables it."""
    is_correction: Literal["auto", "none", "token_truncate", "sequence_mask"] = "auto"
    """Importance-sampling correction for the train/inference mismatch, with w_t = exp(logp_old - logp_gen)
    (`auto`: `token_truncate` under async generation with `grpo.max_staleness` >= 1, else `none`):
    `token_truncate` multiplies each token's loss by min(w_t, is_truncate_cap) (TIS); `sequence_mask` drops
    sequences whose geometric-mean ratio exp(mean_t log w_t) is outside [is_sequence_low, is_sequence_high]."""
    is_truncate_cap: float = 2.0
    """C in TIS: the cap on the per-token importance weight."""
    is_sequence_low: float = 0.5
    """Lower bound of the sequence ratio kept by `sequence_mask`."""
    is_sequence_high: float = 2.0
    """Upper bound of the sequence ratio kept by `sequence_mask`."""
    aggregation: Literal["token", "sequence", "constant"] = "token"
    """`token`: mean over all valid tokens of the global batch; `sequence`: mean over sequences of
    each sequence's token mean; `constant`: sum over valid tokens / (sequences x `constant_normaliser_tokens`)
    (Dr.GRPO)."""
    constant_normaliser_tokens: int | None = None
    """Tokens per sequence in the `constant` aggregation's divisor; null: `generation.max_new_tokens`."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio in the clipped objective: each token's own (PPO, GRPO), or the sequence's
    exp(mean_t (logp - logp_old)) on all its tokens, clipped as one (GSPO; use with `aggregation=sequence`)."""
    old_logprobs: Literal["auto", "recompute"] = "auto"
    """Where logp_old (the trainer's logprobs before the step's first update) comes from. `auto`: when the
    rollout is one optimizer step (`training.global_batch_size` >= its sequences) the policy being trained
    is the old policy, so the training pass's own logprobs, detached, are logp_old (the ratio is 1 in value
    and its gradient is the policy gradient, as in TRL), and no separate forward pass is spent on them; with
    several optimizer steps per rollout they are computed in a pass of their own. `recompute`: always that
    separate pass (the same numbers, one more forward pass)."""


class MathEnvConfig(Section):
    timeout_s: float = 5.0
    """Per-sample verification time limit; a timeout scores 0 and is counted."""


class EnvConfig(Section):
    default_task: str = "math"
    """Environment for records that do not name a `task`."""
    num_workers: int = 0
    """Verifier worker processes (Ray actors, each holding every environment the run uses) that score
    a batch in parallel slices; 0 scores in the driver process."""
    num_cpus_per_worker: float = 1.0
    """CPUs reserved for each verifier worker."""
    math: MathEnvConfig = MathEnvConfig()
    """The `math` environment: answer extraction plus math-verify."""
    code: CodeEnvConfig = CodeEnvConfig()
    """The `code` environment: model-written Python against unit tests in a sandbox."""
    ifeval: IfEvalConfig = IfEvalConfig()
    """The `ifeval` environment: IFEval's 25 verifiable instruction types."""
    format: FormatEnvConfig = FormatEnvConfig()
    """The `format` environment: "detailed thinking on/off" compliance (<think> tags)."""
    judge: JudgeEnvConfig = JudgeEnvConfig()
    """The `judge` environment: an LLM judge or reward model over HTTP, or a local reward model."""
    tool_use: ToolUseEnvConfig = ToolUseEnvConfig()
    """The `tool_use` environment: calculator and sandboxed Python tools, then a scored final answer
    (needs grpo.max_turns > 1)."""
    extra_rewards: dict[str, float] = {}
    """Environments that score every trajectory's final answer on top of its task's, with weights:
    reward = task reward + sum of weight x extra reward; e.g. {format: 0.5} adds reasoning-mode
    compliance to any task. Each appears as a reward component."""
    custom: dict[str, str] = {}
    """Your own environments: task name -> `module:Class` (importable; built with no arguments), e.g.
    `env.custom.sql=my_project.envs:SqlEnv`. See docs/environments.md."""
    remote: dict[str, RemoteEnvConfig] = {}
    """Tasks scored by environment servers (`reinforge env serve`): task name -> server, e.g.
    `env.remote.code.url=http://10.0.0.5:8000`. A remote task may have any name, built in or not."""
    gym: dict[str, GymResourcesConfig] = {}
    """Tasks scored by NeMo Gym resources servers while reinforge drives the model: task name -> server,
    e.g. `env.gym.weather.url=http://127.0.0.1:18001`. The server's tools are called for the policy's
    `<tool_call>`s (its session cookie kept per trajectory), and its /verify scores the episode
    (docs/agents.md). Needs grpo.max_turns > 1 for tools."""


class CurriculumConfig(Section):
    """Llama-Nemotron's RL data curriculum (arXiv:2505.00949): a pass-rate pre-filter and a sampler that
    moves from easy to hard prompts. Implemented in reinforge/data/curriculum.py (docs/algorithms.md)."""

    prefilter: bool = False
    """Before training, sample `prefilter_samples` answers to every training prompt with the initial policy
    and drop the prompts whose pass rate is at least `prefilter_threshold`. The pass rates are stored in
    RUN_DIR/curriculum/pass_rates.jsonl and reused on resume; records that carry a `pass_rate` field
    (`reinforge curriculum prefilter` writes them) are not sampled again."""
    prefilter_samples: int = 8
    """Answers sampled per prompt to measure its pass rate (k); pass rates are then multiples of 1/k."""
    prefilter_threshold: float = 0.75
    """Prompts with pass rate >= this are dropped: the policy already solves them."""
    prefilter_temperature: float | None = None
    """Sampling temperature of the pre-filter; null: generation.temperature."""
    success_reward: float = 1.0
    """A sampled answer passes when its reward is at least this; with 0/1 rewards (math, code) the pass
    rate is the mean reward. Lower it for graded rewards (a judge's scores)."""
    sampler: Literal["uniform", "progressive"] = "uniform"
    """`uniform`: shuffled epochs (data.shuffle) over the kept prompts; `progressive`: each batch follows a
    Gaussian over pass rate whose centre moves from `start_pass_rate` to `end_pass_rate` (needs pass rates:
    `prefilter=true`, or a `pass_rate` field in every record)."""
    num_bins: int | None = None
    """Pass-rate bins of the progressive sampler: null: one bin per distinct pass rate (with the pre-filter,
    the multiples of 1/k); N: N equal-width bins over [0, 1], each at its centre (empty ones are left out)."""
    sigma: float = 0.15
    """Width (standard deviation, in pass rate) of the progressive sampler's Gaussian target."""
    start_pass_rate: float = 0.75
    """Centre of the Gaussian for the first batch (easy: a high pass rate)."""
    end_pass_rate: float = 0.0
    """Centre of the Gaussian from batch `num_steps` on (hard: a low pass rate)."""
    num_steps: int | None = None
    """Batches over which the centre moves linearly from start to end; null: grpo.max_steps. Dynamic
    sampling draws extra batches in a step, which move the centre too."""

    @model_validator(mode="after")
    def _check(self) -> "CurriculumConfig":
        checks = [
            (self.prefilter_samples >= 1, "curriculum.prefilter_samples must be >= 1 (8 in Llama-Nemotron)"),
            (
                0 < self.prefilter_threshold <= 1,
                "curriculum.prefilter_threshold must be in (0, 1]: prompts with a pass rate at or above it are dropped",
            ),
            (
                self.prefilter_temperature is None or self.prefilter_temperature > 0,
                "curriculum.prefilter_temperature must be > 0 (or null for generation.temperature)",
            ),
            (
                self.num_bins is None or self.num_bins >= 1,
                "curriculum.num_bins must be >= 1 (or null: one bin per distinct pass rate)",
            ),
            (self.sigma > 0, "curriculum.sigma must be > 0 (the Gaussian's width in pass rate, e.g. 0.15)"),
            (
                0 <= self.start_pass_rate <= 1 and 0 <= self.end_pass_rate <= 1,
                "curriculum.start_pass_rate and curriculum.end_pass_rate must be in [0, 1]",
            ),
            (
                self.num_steps is None or self.num_steps >= 1,
                "curriculum.num_steps must be >= 1 (or null: grpo.max_steps)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self


class ClusterConfig(Section):
    num_threads: int = 0
    """torch intra-op threads per process; 0 keeps torch's default (all cores)."""
    address: str = ""
    """Ray cluster to use: empty starts a local Ray; `auto` or HOST:PORT joins a running cluster."""
    num_cpus: int = 0
    """CPUs a local Ray may use; 0: all of this machine's."""
    num_cpus_per_worker: float = 1.0
    """CPUs reserved for each Ray worker (training rank)."""
    num_gpus_per_worker: float = 0.0
    """GPUs reserved for each Ray worker; 1 on a GPU cluster."""
    colocate: bool = True
    """With Ray: true puts generation engine i in training rank i's resources (they take turns);
    false gives the engines resources of their own (split placement)."""
    worker_timeout_s: float = 600.0
    """A worker call that makes no progress for this long ends the run (a dead worker ends it at once)."""


class CheckpointConfig(Section):
    save_final: bool = True
    """Write the trained policy in Hugging Face format to RUN_DIR/final at the end."""
    save_every: int = 0
    """Write a checkpoint (weights, optimizer, data position, RNG, step) every this many steps to
    RUN_DIR/checkpoints/step_N; 0: never."""
    keep_last: int = 2
    """Keep the newest this many checkpoints (0: keep all)."""
    keep_best_metric: str | None = None
    """Also keep the checkpoint with the best value of this metric (e.g. val/accuracy)."""
    keep_best_mode: Literal["max", "min"] = "max"
    """Whether a higher or a lower `keep_best_metric` is better."""
    resume: Literal["auto", "never"] = "never"
    """`auto`: continue from the newest complete checkpoint in logging.run_dir (which is then reused,
    not suffixed); `never`: always start a new run."""


class LoggingConfig(Section):
    run_dir: str = "runs/grpo"
    """Run directory: config.yaml, metrics.jsonl, final/. If it already holds a run, a suffix -1, -2, ...
    is added."""
    console_every: int = 1
    """Print a compact metrics line every this many steps."""
    loggers: LoggersConfig = LoggersConfig()
    """Where the metrics go besides RUN_DIR/metrics.jsonl (always written): TensorBoard, Weights & Biases, MLflow."""
    capture_dependency_logs: bool = True
    """Send the logs of vLLM, Ray, transformers and other dependencies, and anything written to stderr
    during the run, to RUN_DIR/logs/dependencies.log instead of the console."""


class Config(Section):
    """The whole run."""

    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    generation: GenerationConfig = GenerationConfig()
    training: TrainingConfig = TrainingConfig()
    grpo: GRPOConfig = GRPOConfig()
    loss: LossConfig = LossConfig()
    env: EnvConfig = EnvConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    agent: AgentConfig = AgentConfig()
    cluster: ClusterConfig = ClusterConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()

    @property
    def num_trained_models(self) -> int:
        """Models the run trains, each on `training.num_workers` ranks of its own with FSDP2: the policy (a
        recipe that trains more, PPO's critic, says so)."""
        return 1

    @model_validator(mode="after")
    def _check_batch_sizes(self) -> "Config":
        g, t = self.grpo, self.training
        rollout = g.num_prompts_per_step * g.num_generations_per_prompt
        if g.num_generations_per_prompt < 2:
            raise ValueError(
                "grpo.num_generations_per_prompt must be at least 2: a group baseline needs two samples; set it to 2 or more"
            )
        if t.global_batch_size <= 0 or rollout % t.global_batch_size:
            raise ValueError(
                f"training.global_batch_size={t.global_batch_size} does not divide the rollout batch "
                f"(grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {rollout}); "
                f"set it to a divisor of {rollout}, e.g. {rollout} or {rollout // 2 if rollout % 2 == 0 else rollout}"
            )
        if t.num_workers < 1 or t.global_batch_size % t.num_workers:
            raise ValueError(
                f"training.num_workers={t.num_workers} does not divide training.global_batch_size={t.global_batch_size}; "
                "every rank trains on an equal share, so set it to a divisor"
            )
        if t.num_workers > 1 and t.backend != "fsdp2":
            raise ValueError(
                f"training.num_workers={t.num_workers} needs training.backend=fsdp2; the torch backend is one process"
            )
        if self.cluster.colocate and t.backend == "fsdp2" and self.generation.num_workers > t.num_workers:
            raise ValueError(
                f"generation.num_workers={self.generation.num_workers} > training.num_workers={t.num_workers} with cluster.colocate=true: "
                "each engine shares one training rank's resources; lower generation.num_workers or set cluster.colocate=false"
            )
        if g.async_rollouts and t.backend == "fsdp2" and self.cluster.colocate:
            raise ValueError(
                "grpo.async_rollouts=true with training.backend=fsdp2 needs cluster.colocate=false: the engines generate "
                "while the ranks train, so they need resources of their own"
            )
        if self.env.num_workers < 0:
            raise ValueError("env.num_workers must be >= 0 (0: score in the driver process)")
        if t.cpu_offload and t.backend != "fsdp2":
            raise ValueError("training.cpu_offload=true needs training.backend=fsdp2 (FSDP2's CPUOffloadPolicy)")
        if g.dynamic_sampling and t.backend == "fsdp2" and g.num_generations_per_prompt % t.num_workers:
            raise ValueError(
                f"grpo.dynamic_sampling=true with training.num_workers={t.num_workers}: a step may train on fewer groups, "
                f"and a batch of whole groups of grpo.num_generations_per_prompt={g.num_generations_per_prompt} must split "
                "evenly over the ranks; make num_generations_per_prompt a multiple of training.num_workers"
            )
        if t.micro_batch_size <= 0 or t.global_batch_size % t.micro_batch_size:
            raise ValueError(
                f"training.micro_batch_size={t.micro_batch_size} does not divide training.global_batch_size="
                f"{t.global_batch_size}; set it to a divisor of {t.global_batch_size}"
            )
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> "Config":
        lora = self.model.lora
        if lora is None:
            return self
        if lora.sync == "adapter" and self.generation.backend != "vllm":
            raise ValueError(
                f"model.lora.sync=adapter needs generation.backend=vllm (the {self.generation.backend} engine has no "
                "LoRA support); set model.lora.sync=merged, or generation.backend=vllm"
            )
        if adapter_sync(self) and lora.rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(
                f"model.lora.rank={lora.rank} is above vLLM's largest LoRA rank ({VLLM_LORA_RANKS[-1]}) for "
                "adapter sync; set model.lora.sync=merged or a lower rank"
            )
        if lora.quantize_base != "none" and self.training.backend == "fsdp2":
            raise ValueError(
                f"model.lora.quantize_base={lora.quantize_base} (QLoRA) needs training.backend=torch: FSDP2 does "
                "not shard bitsandbytes' 4-bit weights; set training.backend=torch or quantize_base=none"
            )
        return self

    @model_validator(mode="after")
    def _check_ranges(self) -> "Config":
        checks = [
            (
                self.generation.temperature > 0,
                "generation.temperature must be > 0 for training rollouts (validation is greedy)",
            ),
            (self.generation.max_new_tokens > 0, "generation.max_new_tokens must be > 0"),
            (0 < self.generation.top_p <= 1, "generation.top_p must be in (0, 1]"),
            (
                self.loss.clip_eps_low > 0 and self.loss.clip_eps_high > 0,
                "loss.clip_eps_low and loss.clip_eps_high must be > 0",
            ),
            (
                self.loss.clip_eps_low < 1 or (self.loss.policy_loss == "cispo" and self.loss.clip_eps_low == 1),
                "loss.clip_eps_low must be < 1 so that the lower clip 1 - eps stays positive (with loss.policy_loss=cispo, 1: no lower bound)",
            ),
            (
                self.loss.dual_clip_c is None or self.loss.dual_clip_c > 1,
                "loss.dual_clip_c must be > 1 (or null to disable dual clip)",
            ),
            (self.loss.kl_coef >= 0, "loss.kl_coef must be >= 0"),
            (self.training.lr > 0, "training.lr must be > 0"),
            (self.grpo.max_steps >= 0, "grpo.max_steps must be >= 0"),
            (self.grpo.max_turns >= 1, "grpo.max_turns must be >= 1 (1: single-turn)"),
            (self.grpo.val_every >= 0, "grpo.val_every must be >= 0 (0: validate only before and after training)"),
            (self.logging.console_every >= 1, "logging.console_every must be >= 1"),
            (
                self.checkpoint.save_every >= 0 and self.checkpoint.keep_last >= 0,
                "checkpoint.save_every and checkpoint.keep_last must be >= 0",
            ),
            (
                self.generation.max_logprob_error >= 1,
                "generation.max_logprob_error must be >= 1 (1 means exact agreement)",
            ),
            (self.loss.is_truncate_cap > 0, "loss.is_truncate_cap must be > 0"),
            (
                0 <= self.loss.is_sequence_low < 1 < self.loss.is_sequence_high,
                "loss.is_sequence_low must be in [0, 1) and loss.is_sequence_high > 1",
            ),
            (self.grpo.dynamic_sampling_max_extra_rounds >= 0, "grpo.dynamic_sampling_max_extra_rounds must be >= 0"),
            (
                0 <= self.grpo.overlong_buffer_tokens <= self.generation.max_new_tokens,
                f"grpo.overlong_buffer_tokens={self.grpo.overlong_buffer_tokens} must be in [0, generation.max_new_tokens="
                f"{self.generation.max_new_tokens}]: the buffer is the last tokens before the length limit (0 disables the penalty)",
            ),
            (
                self.grpo.overlong_buffer_tokens == 0 or self.grpo.max_turns == 1,
                "grpo.overlong_buffer_tokens > 0 needs grpo.max_turns=1: L_max is generation.max_new_tokens, a per-turn limit, "
                "so a multi-turn answer would be punished for its number of turns; set overlong_buffer_tokens=0",
            ),
            (
                not (self.grpo.async_rollouts and self.generation.vllm_sleep_mode),
                "grpo.async_rollouts=true keeps the engine generating while the trainer works, so it never sleeps; "
                "set generation.vllm_sleep_mode to false or null",
            ),
            (
                self.grpo.rollout != "agent" or bool(self.agent.names()),
                "grpo.rollout=agent needs an agent: agent.python.NAME=module:function (your own) or agent.gym.NAME.url=URL "
                "(a NeMo Gym agent server)",
            ),
            (
                self.grpo.rollout != "agent" or not self.env.extra_rewards,
                "env.extra_rewards score with in-process environments, which grpo.rollout=agent does not use; score in the "
                "agent's verifier (reward_components) instead, or set env.extra_rewards={}",
            ),
            (
                self.grpo.rollout != "agent" or not self.curriculum.prefilter,
                "curriculum.prefilter samples with in-process environments, which grpo.rollout=agent does not use; pre-filter "
                "offline (reinforge curriculum prefilter) or set curriculum.prefilter=false",
            ),
            (
                self.loss.constant_normaliser_tokens is None or self.loss.constant_normaliser_tokens > 0,
                "loss.constant_normaliser_tokens must be > 0 (or null for generation.max_new_tokens)",
            ),
            (
                self.loss.policy_loss != "cispo" or self.loss.dual_clip_c is None,
                "loss.dual_clip_c does not apply to loss.policy_loss=cispo (its clipped weights keep their gradient); set it to null",
            ),
            (
                not self.loss.kl_in_reward or self.loss.kl_coef > 0,
                "loss.kl_in_reward=true has no penalty to put in the reward with loss.kl_coef=0; set loss.kl_coef > 0",
            ),
            (
                not (self.grpo.decoupled_normalization and self.grpo.whiten_advantages),
                "grpo.decoupled_normalization (GDPO) already whitens the advantages over the batch; set grpo.whiten_advantages=false",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self
