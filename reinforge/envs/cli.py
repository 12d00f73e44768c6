"""`reinforge env serve` and `reinforge env score`: an environment over HTTP, or on a file of answers;
`reinforge serve-rm`: a trained reward model over HTTP, for the judge environment.

Only argparse (and reinforge/network.py, which imports no web framework) is imported at module level, so
that `reinforge --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from reinforge.network import add_bind_arguments, check_bind_address, token_from_env

ENV_OVERRIDES_HELP = (
    "key=value overrides of the environment config, e.g. math.timeout_s=3 (the env section of the "
    "config; `env.` in front is optional)"
)
DEFAULT_SCORE_BATCH_SIZE = 256


def add_env_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `env serve` and `env score` to the `reinforge` command line."""
    env = subparsers.add_parser(
        "env",
        help="serve an environment over HTTP, or score a JSONL file of answers with one",
        description="Run a built-in environment (e.g. math) outside training: serve it over HTTP for remote "
        "trainers, or score a file of model answers offline.",
    )
    commands = env.add_subparsers(dest="env_command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="serve an environment over HTTP (POST /verify, GET /health, /metrics, /tools)",
        description="Serve a built-in environment over HTTP until Ctrl-C. Trainers reach it with "
        "env.<task>.url; see reinforge/envs/http_server.py for the endpoints. With --protocol gym it is a "
        "NeMo Gym resources server instead (reinforge/envs/gym_server.py).",
    )
    serve.add_argument("--env", required=True, help="built-in environment name, e.g. math")
    serve.add_argument(
        "--protocol",
        choices=("reinforge", "gym"),
        default="reinforge",
        help="reinforge (default): reinforge's own protocol, for env.remote; gym: a NeMo Gym resources server "
        "(/seed_session, /verify, one route per tool), for Gym agents and trainers",
    )
    add_bind_arguments(serve, default_port=None)
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="largest request body accepted; larger ones get HTTP 413 (default: 64 MiB)",
    )
    serve.add_argument("overrides", nargs="*", help=ENV_OVERRIDES_HELP)

    score = commands.add_parser(
        "score",
        help="score a JSONL file of answers offline; prints the mean reward",
        description="Score each record's `response` (the assistant's answer) with an environment; `prompt` or "
        "`messages` (the conversation before it) are optional, plus whatever the environment needs (math: "
        "`answer`). Writes each record back with `reward` and `components`.",
    )
    score.add_argument("--env", required=True, help="built-in environment name, e.g. math")
    score.add_argument("--input", required=True, type=Path, help="JSONL file of records with a `response` field")
    score.add_argument("--output", required=True, type=Path, help="JSONL file to write the scored records to")
    score.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_SCORE_BATCH_SIZE,
        help=f"records per environment call (default: {DEFAULT_SCORE_BATCH_SIZE})",
    )
    score.add_argument("overrides", nargs="*", help=ENV_OVERRIDES_HELP)
    env.set_defaults(run=run_env_command)


def run_env_command(args: argparse.Namespace) -> None:
    """Run `reinforge env serve` or `reinforge env score`; user errors raise `ReinforgeError`."""
    if args.env_command == "serve":
        _serve(args)
    else:
        _score(args)


def add_serve_rm_command(subparsers: argparse._SubParsersAction) -> None:
    """Add `serve-rm` (the reward model server of envs/reward_model_server.py) to the `reinforge` command line."""
    serve = subparsers.add_parser(
        "serve-rm",
        help="serve a reward model over HTTP (POST /score, GET /health) for the judge environment",
        description="Serve a Hugging Face sequence-classification model with one label (`reinforge rm`'s "
        "RUN_DIR/final, a LoRA one included) until Ctrl-C: POST /score answers one score per conversation. The judge "
        "environment reaches it with env.judge.mode=reward_model and env.judge.url (docs/environments.md).",
    )
    serve.add_argument("model_path", metavar="MODEL_DIR", help="the reward model's directory, e.g. runs/rm_demo/final")
    add_bind_arguments(serve, default_port=8001)
    serve.add_argument(
        "--device",
        default="auto",
        help="where the model runs: auto (a GPU this process sees, else the CPU; the default), cpu, cuda or cuda:N",
    )
    serve.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="weights' dtype (default: auto, the dtype the model was saved in)",
    )
    serve.add_argument(
        "--max-length",
        type=int,
        default=2048,
        help="tokens per conversation; longer ones lose their beginning (default: 2048)",
    )
    serve.add_argument("--batch-size", type=int, default=8, help="conversations per forward pass (default: 8)")
    serve.set_defaults(run=run_serve_rm_command)


def run_serve_rm_command(args: argparse.Namespace) -> None:
    import re

    from reinforge.envs.reward_model_server import serve_reward_model
    from reinforge.errors import ConfigError
    from reinforge.modeling import DEVICE_PATTERN, resolve_device

    if not re.fullmatch(DEVICE_PATTERN, args.device):
        raise ConfigError(f"--device {args.device}: choose auto, cpu, cuda or cuda:N")
    token = token_from_env(args.token_env, "--token-env")
    check_bind_address(args.host, args.allow_remote, token)
    device = str(resolve_device(args.device, "--device"))
    serve_reward_model(
        args.model_path, args.host, args.port, device, args.dtype, args.max_length, args.batch_size, token=token
    )


def _serve(args: argparse.Namespace) -> None:
    from reinforge.envs.http_server import DEFAULT_MAX_REQUEST_BYTES, check_bind_address, serve
    from reinforge.errors import ConfigError

    token = token_from_env(args.token_env, "--token-env")
    check_bind_address(args.host, args.allow_remote, token)  # before the environment starts its processes
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    max_request_bytes = args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES
    env = _build_env(args.env, args.overrides)
    if args.protocol == "gym":
        from reinforge.envs.gym_server import build_gym_app as build
    else:
        from reinforge.envs.http_server import build_app as build
    serve(
        env,
        host=args.host,
        port=args.port,
        token=token,
        max_request_bytes=max_request_bytes,
        allow_remote=args.allow_remote,
        build=build,
    )


def _score(args: argparse.Namespace) -> None:
    from reinforge.data.jsonl import read_jsonl
    from reinforge.errors import ConfigError, DataError

    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not args.input.is_file():
        raise DataError(f"input file {args.input} does not exist")
    records = read_jsonl(args.input, required_keys=("response",))
    requests = [_request(record, f"{args.input} record {i}") for i, record in enumerate(records, start=1)]
    env = _build_env(args.env, args.overrides)
    try:
        responses = []
        for start in range(0, len(requests), args.batch_size):
            responses.extend(env.step(requests[start : start + args.batch_size]))
        env_metrics = env.metrics()
    finally:
        env.close()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w", encoding="utf-8") as handle:
        for record, response in zip(records, responses):
            if response.infra_failure:  # no verdict (a judge or server that failed): never a made-up reward
                row = {**record, "reward": None, "infra_failure": response.infra_failure}
                row["infra_error"] = response.info.get("infra_error", "")
            else:
                row = {**record, "reward": response.reward, "components": response.components}
            handle.write(json.dumps(row) + "\n")
    scored = [r for r in responses if not r.infra_failure]
    mean = sum(r.reward for r in scored) / len(scored) if scored else float("nan")
    print(f"mean reward {mean:.4f} over {len(scored)} records; wrote {args.output}")
    if any(env_metrics.values()):
        print("environment counters: " + ", ".join(f"{k}={v:g}" for k, v in env_metrics.items()))
    unscored = [r for r in responses if r.infra_failure]
    if unscored:
        from reinforge.errors import InfrastructureError

        raise InfrastructureError(
            f"{len(unscored)} of {len(responses)} records have no score ({unscored[0].infra_failure}: "
            f"{unscored[0].info.get('infra_error', '')}); they are written with reward null: score them again"
        )


def _request(record: dict, where: str):
    """The conversation to score: the record's prompt (if any), then its response."""
    from reinforge.envs.base import EnvRequest
    from reinforge.errors import DataError

    if not isinstance(record["response"], str):
        raise DataError(f"{where}: `response` must be a string, got {type(record['response']).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise DataError(f'{where}: `messages` must be a list of {{"role": ..., "content": ...}} objects')
        messages = list(messages)
    elif "prompt" in record:
        messages = [{"role": "user", "content": str(record["prompt"])}]
    else:
        messages = []
    return EnvRequest(messages=messages + [{"role": "assistant", "content": record["response"]}], record=record)


def _build_env(name: str, overrides: list[str]):
    from reinforge.config.loader import load_recipe_config
    from reinforge.config.section import Section
    from reinforge.envs.registry import EnvConfig, build_env

    class EnvRoot(Section):  # `env.*` overrides, checked like a run's
        env: EnvConfig = EnvConfig()

    dotted = [o if o.startswith("env.") else f"env.{o}" for o in overrides]
    return build_env(name, load_recipe_config(EnvRoot, None, dotted).env)
