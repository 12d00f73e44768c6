"""`reinforge serve --model PATH`: the policy behind an OpenAI-compatible endpoint, standalone (for
evaluation, and for developing an agent against the model it will train).

Only argparse and reinforge/network.py are imported at module level, so that `reinforge --help` stays instant.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import threading
from contextlib import ExitStack
from pathlib import Path

from reinforge.network import add_bind_arguments, check_bind_address, token_from_env


def add_serve_command(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="serve a model behind an OpenAI-compatible endpoint (POST /v1/chat/completions, with token ids)",
        description="Serve a Hugging Face model directory (or hub id) until Ctrl-C: OpenAI's chat completions with "
        "tool calls, plus each message's prompt_token_ids, generation_token_ids and generation_log_probs (NeMo Gym's "
        "vllm_model reads them). Concurrent requests are batched into the engine. See docs/agents.md.",
    )
    serve.add_argument("--model", required=True, help="Hugging Face model directory or hub id, e.g. models/tool_demo")
    serve.add_argument(
        "--adapter",
        metavar="DIR",
        help="a PEFT LoRA adapter trained on --model (a LoRA run's final/), merged into its weights when they load "
        "(for vLLM, into a temporary model directory)",
    )
    serve.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="generation engine (default: hf)")
    serve.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="weights' dtype (default: auto, the dtype the model was saved in, as vLLM's default; float32 when its "
        "config names none)",
    )
    add_bind_arguments(serve, default_port=8000)
    serve.add_argument("--model-name", default="policy", help="the model id it reports (default: policy)")
    serve.add_argument(
        "--max-tokens", type=int, default=256, help="completion length when a request gives none (default: 256)"
    )
    serve.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length: prompt plus completion (default: the model's max_position_embeddings)",
    )
    serve.add_argument("--max-batch-size", type=int, default=256, help="most sequences per engine call (default: 256)")
    serve.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="most requests waiting for the engine; one more is answered 429 with Retry-After (default: 1024)",
    )
    serve.add_argument(
        "--batch-wait-s",
        type=float,
        default=0.02,
        help="how long a request waits for others to share its engine call (default: 0.02; a training run's "
        "endpoint waits longer, agent.endpoint.batch_wait_s)",
    )
    serve.add_argument("--seed", type=int, default=0, help="seed of the engine (vLLM)")
    serve.set_defaults(run=run_serve_command)


def run_serve_command(args: argparse.Namespace) -> None:
    from reinforge.errors import ConfigError
    from reinforge.model_config import ModelConfig
    from reinforge.modeling import adapter_base, load_processor, load_tokenizer, model_limits
    from reinforge.serving.app import build_app
    from reinforge.serving.config import ServingConfig
    from reinforge.serving.server import PolicyServer

    token = token_from_env(args.token_env, "--token-env")
    check_bind_address(args.host, args.allow_remote, token)
    try:
        config = ServingConfig(
            host=args.host,
            port=args.port,
            allow_remote=args.allow_remote,
            model_name=args.model_name,
            max_tokens=args.max_tokens,
            max_batch_size=args.max_batch_size,
            max_queued_requests=args.max_queued_requests,
            batch_wait_s=args.batch_wait_s,
        )
    except ValueError as exc:
        raise ConfigError(str(exc).splitlines()[-1]) from None
    model_config = ModelConfig(name_or_path=args.model, adapter=args.adapter)
    model_config = model_config.model_copy(update={"dtype": _dtype(args.dtype, model_config)})
    if model_config.adapter:
        adapter_base(model_config)  # an adapter of another base model is a one-line error before anything loads
    tokenizer = load_tokenizer(model_config)
    with ExitStack() as cleanup:
        engine, max_model_len = _engine(args, model_config, tokenizer, cleanup)
        cleanup.callback(engine.shutdown)
        server = PolicyServer(
            engine,
            tokenizer,
            config,
            max_model_len=max_model_len,
            default_max_tokens=args.max_tokens,
            managed=False,
            token=token,
            vocab_size=model_limits(model_config).vocab_size,
            processor=load_processor(model_config),  # a vision-language model's: requests may hold images
        )
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        cleanup.callback(server.stop)
        server.start(build_app(server))
        access = "token required" if token else "no token"
        served = args.model + (f" + adapter {args.adapter}" if args.adapter else "")
        print(
            f"serving {served} as {args.model_name!r} at {server.base_url} (OpenAI-compatible; {access}); Ctrl-C stops",
            flush=True,
        )
        stop.wait()


def _engine(args: argparse.Namespace, model_config, tokenizer, cleanup: ExitStack):
    """The generation engine and the context length it serves. vLLM loads a model directory: a `--adapter` is
    merged into a temporary one, deleted when the server stops (`cleanup`)."""
    from reinforge.errors import ConfigError
    from reinforge.modeling import check_weights, load_model, model_limits, model_location, resolve_device

    check_weights(model_config)  # vLLM's own error would be a traceback
    limit = model_limits(model_config).max_positions
    if args.max_model_len and limit and args.max_model_len > limit:
        raise ConfigError(
            f"--max-model-len {args.max_model_len} exceeds the model's max_position_embeddings={limit}; lower it to "
            f"{limit} or less, or leave it out"
        )
    if args.backend == "hf":
        from reinforge.generation.hf import HFGenerationBackend

        model = load_model(model_config)
        max_model_len = args.max_model_len or limit or 4096
        # a GPU where this process sees one, else the CPU (as generation.device=auto)
        engine = HFGenerationBackend(model, tokenizer, args.max_batch_size, resolve_device("auto", "device"))
        return engine, max_model_len
    try:
        from reinforge.generation.vllm_backend import VLLMGenerationBackend
    except ImportError:
        raise ConfigError("--backend vllm needs vLLM; run `make install`") from None
    if model_config.adapter:
        from reinforge.training.convert import merged_copy

        model_config = merged_copy(model_config, Path(cleanup.enter_context(tempfile.TemporaryDirectory())))
    location = model_location(model_config)
    max_model_len = args.max_model_len or limit or 4096
    engine = VLLMGenerationBackend(
        model_path=location, dtype=model_config.dtype, seed=args.seed, max_model_len=max_model_len
    )
    return engine, max_model_len


def _dtype(setting: str, model_config) -> str:
    """`--dtype`: `auto` is the dtype the model's config.json names (`dtype`, or `torch_dtype` before transformers
    4.56) where it is one the project loads, else float32."""
    if setting != "auto":
        return setting
    from transformers import AutoConfig

    from reinforge.modeling import DTYPES, model_location

    location = model_location(model_config)
    hf_config = AutoConfig.from_pretrained(location, trust_remote_code=model_config.trust_remote_code)
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(saved).removeprefix("torch.") if saved is not None else "float32"
    return name if name in DTYPES else "float32"
