"""Sampling for the Tinker API: one reinforge generation engine per base model, serving the weights each request
names (engine_slot.py: the base, a training client's live weights, or weights saved for the sampler).

What a request may ask is the SDK's `SamplingParams` and `SampleRequest` (`SampleParams.of`): `max_tokens`,
`temperature` (0: greedy), `top_k` (-1: none), `top_p`, `seed` (None: a fresh one per request), `stop` (None: the
tokenizer's EOS ends a sample; strings or token ids: those too, EOS still; `[]`: nothing but `max_tokens`), and the
prompt's logprobs (`prompt_logprobs`, `topk_prompt_logprobs`, `prompt_logprobs_last_n`). What comes back per
prompt (`SampleResult`): each sample's tokens (the stop token or stop string's tokens included), the logprob of each
under the distribution it was sampled from (temperature, top-k and top-p applied, as reinforge's engines report
them: the numbers an importance-sampling loss needs), and `stop_reason` ("stop" or "length"). Prompt logprobs are
the model's own distribution (temperature 1, nothing filtered, as vLLM and Tinker give them), computed by the engine
itself on the weights it serves: the HF engine's model in a forward pass, vLLM's `prompt_logprobs`
(prompt_scores.py). Not supported (the service refuses them): `topk_sample_logprobs`, `target_prompt_logprobs`,
`prompt_alt_tokens_k`.
"""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

from reinforge.generation.base import GenerationConfig, SamplingParams
from reinforge.model_config import LoraConfig, ModelConfig
from reinforge.tinker.engine_slot import EngineSlot, LiveWeights, SamplerWeights, SavedWeights, live_backend, saved_key
from reinforge.tinker.errors import TinkerRequestError
from reinforge.tinker.prompt_scores import PromptScores, prompt_scores

MAX_SEED = 2**31 - 1
MAX_ALIASES = 64  # saved weights remembered as live ones (`Samplers.remember`)


@dataclass(frozen=True)
class SampleParams:
    """How to sample, as the SDK's `SamplingParams` and `SampleRequest` say."""

    max_tokens: int | None = None  # None: generation.max_new_tokens
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None  # score only the prompt's last N tokens (the others None)

    @classmethod
    def of(
        cls, sampling_params, prompt_logprobs: bool | None = False, topk_prompt_logprobs: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> "SampleParams":  # fmt: skip
        """From the SDK's `types.SamplingParams` and a `SampleRequest`'s prompt logprob fields."""
        return cls(
            max_tokens=sampling_params.max_tokens,
            temperature=sampling_params.temperature,
            top_k=sampling_params.top_k,
            top_p=sampling_params.top_p,
            seed=sampling_params.seed,
            stop=sampling_params.stop,
            prompt_logprobs=bool(prompt_logprobs),
            topk_prompt_logprobs=topk_prompt_logprobs,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
        )


@dataclass
class Sample:
    """One sampled sequence (the SDK's `SampledSequence` without its id, which the service gives)."""

    tokens: list[int]
    logprobs: list[float]  # of each token under the sampling distribution
    stop_reason: Literal["stop", "length"]


@dataclass
class SampleResult:
    """The samples of one prompt, and its prompt logprobs when asked (None at position 0, which has no context)."""

    sequences: list[Sample]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    timings: dict[str, float] = field(default_factory=dict)


class Samplers:
    """One generation engine per base model, built on first use from `generation` (the server config's section).

    `models`: each base model's name (what clients call it) -> its `ModelConfig` (its `lora` section, when set, is
    the LoRA defaults: with `generation.backend=vllm` and adapter sync, the engine takes adapters up to its rank);
    `tokenizer_for(name)`: that model's tokenizer; `run_dir`: where live LoRA adapters are written for vLLM;
    `seed`: the engines'; `max_model_len`: vLLM's context (default: the model's max_position_embeddings);
    `lora_rank`: with vLLM, the largest LoRA rank its engines take as adapters (LoRA clients of larger ranks are
    served merged; None: `model.lora`'s rank where its sync is adapter or auto, else every LoRA client merged)."""

    @classmethod
    def for_server(cls, config, tokenizer_for: Callable[[str], Any], run_dir: Path) -> "Samplers":
        """From the server's `TinkerServeConfig` (tinker/config.py): its served models, `generation`, `seed`, the
        longest sequence it takes and the largest LoRA rank (as vLLM adapters unless `model.lora.sync=merged`)."""
        merged = config.model.lora is not None and config.model.lora.sync == "merged"
        return cls(
            {name: config.model_config_for(name) for name in config.served_models()},
            config.generation,
            tokenizer_for,
            run_dir,
            config.seed,
            config.tinker.max_sequence_tokens or None,
            None if merged else config.tinker.max_lora_rank,
        )

    def __init__(
        self,
        models: Mapping[str, ModelConfig],
        generation: GenerationConfig,
        tokenizer_for: Callable[[str], Any],
        run_dir: Path,
        seed: int = 0,
        max_model_len: int | None = None,
        lora_rank: int | None = None,
    ):
        self.models, self.generation, self.tokenizer_for = dict(models), generation, tokenizer_for
        self.run_dir, self.seed, self.max_model_len, self.lora_rank = Path(run_dir), seed, max_model_len, lora_rank
        self.slots: dict[str, EngineSlot] = {}
        self.limits: dict[str, tuple[int, int | None]] = {}
        self.seeds = random.Random()  # a request without a seed gets a fresh one
        self.aliases: dict[tuple, tuple] = {}  # saved weights' key -> (the trainer, weakly; its version; LoRA rank)

    def slot(self, base_model: str) -> EngineSlot:
        """The engine of `base_model`, built now if it is the first request for it."""
        if base_model not in self.models:
            known = ", ".join(sorted(self.models))
            raise TinkerRequestError(f"unknown base model {base_model!r}; this server holds: {known}")
        if base_model not in self.slots:
            model = engine_model(self.models[base_model], self.generation, self.lora_rank)
            engine = build_engine(model, self.generation, self.tokenizer_for(base_model), self.seed, self.max_model_len)
            adapter_dir = self.run_dir / "sampler_adapters" / f"{len(self.slots)}"
            self.slots[base_model] = EngineSlot(engine, model, self.generation, adapter_dir)
        return self.slots[base_model]

    def sample(
        self, weights: SamplerWeights, prompts: list[list[int]], num_samples: int, params: SampleParams
    ) -> list[SampleResult]:
        """`num_samples` samples of each prompt with `weights` (the engine refitted first if it holds others)."""
        slot = self.slot(weights.base_model)
        weights = self._from_memory(weights, slot)
        eos = self.tokenizer_for(weights.base_model).eos_token_id
        engine_params = sampling_params(params, num_samples, self.generation, eos, self._seed(params))
        vocab, context = self._limits(weights.base_model)
        check_request(prompts, num_samples, params, engine_params.max_new_tokens, vocab, context)
        slot.serve(weights)
        completions = slot.engine.generate(prompts, engine_params).completions
        results = [
            SampleResult([Sample(c.token_ids, c.logprobs, c.finish_reason) for c in samples]) for samples in completions
        ]
        if params.prompt_logprobs or params.topk_prompt_logprobs:
            for result, scores in zip(results, prompt_scores(slot.engine, prompts, params.topk_prompt_logprobs)):
                _attach(result, scores, params)
        return results

    def remember(self, saved: SavedWeights, live: LiveWeights) -> None:
        """`saved` was just written from `live` (save_weights_for_sampler): while the trainer stays at that version,
        sampling `saved` takes the weights from the trainer's memory, or from the engine without a refit when it
        holds them already, instead of reading the directory back (a loop that saves and samples every step)."""
        version = live.trainer.version if live.version is None else live.version
        self.aliases[saved_key(saved)] = (weakref.ref(live.trainer), version, live.lora_rank)
        while len(self.aliases) > MAX_ALIASES:  # the oldest first: insertion order
            del self.aliases[next(iter(self.aliases))]

    def _from_memory(self, weights: SamplerWeights, slot: EngineSlot) -> SamplerWeights:
        """`weights`, or the live weights `remember` says they equal when the trainer or the engine still holds them."""
        alias = self.aliases.get(saved_key(weights)) if isinstance(weights, SavedWeights) else None
        trainer = alias[0]() if alias else None
        if trainer is None:
            return weights
        live = LiveWeights(weights.base_model, trainer, alias[1], alias[2])
        try:
            held = slot.weights_key(live) == slot.holds or (trainer.version == alias[1] and live_backend(trainer))
        except TinkerRequestError:  # the training client was freed: the directory it is
            return weights
        return live if held else weights

    def _seed(self, params: SampleParams) -> int:
        return self.seeds.randrange(MAX_SEED) if params.seed is None else params.seed

    def _limits(self, base_model: str) -> tuple[int, int | None]:
        """The model's vocabulary (token ids below it) and context (prompt and sample together)."""
        from reinforge.modeling import model_limits

        if base_model not in self.limits:
            limits = model_limits(self.models[base_model])
            self.limits[base_model] = (limits.vocab_size or 2**31, self.max_model_len or limits.max_positions)
        return self.limits[base_model]

    def shutdown(self) -> None:
        """Release every engine."""
        for slot in self.slots.values():
            slot.shutdown()
        self.slots.clear()


def _attach(result: SampleResult, scores: PromptScores, params: SampleParams) -> None:
    """The prompt logprobs asked for, None before the last `prompt_logprobs_last_n` tokens."""
    skip = len(scores.logprobs) - (params.prompt_logprobs_last_n or len(scores.logprobs))
    if params.prompt_logprobs:
        result.prompt_logprobs = [None] * skip + scores.logprobs[skip:]
    if params.topk_prompt_logprobs:
        result.topk_prompt_logprobs = [None] * skip + scores.topk[skip:]


def sampling_params(
    params: SampleParams, num_samples: int, generation: GenerationConfig, eos_token_id: int, seed: int
) -> SamplingParams:
    """The engine's sampling parameters for a Tinker request: stop strings or stop token ids (EOS still stops, as
    in vLLM), or with `stop=[]` nothing but the length."""
    stop = params.stop
    strings: tuple[str, ...] = ()
    ids: tuple[int, ...] = ()
    if isinstance(stop, str):
        strings = (stop,)
    elif stop is not None and all(isinstance(s, str) for s in stop):
        strings = tuple(stop)
    elif stop is not None:
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
            raise TinkerRequestError("sampling_params.stop must be a string, a list of strings or a list of token ids")
        ids = tuple(dict.fromkeys([*stop, eos_token_id]))
    return SamplingParams(
        max_new_tokens=generation.max_new_tokens if params.max_tokens is None else params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=ids,
        stop_strings=strings,
        ignore_eos=stop is not None and len(stop) == 0,
        num_samples=num_samples,
        seed=seed,
    )


def check_request(
    prompts: list[list[int]], num_samples: int, params: SampleParams, max_tokens: int, vocab: int, context: int | None
) -> None:
    """One-line `TinkerRequestError`s for what no engine can sample."""
    problems = [
        (num_samples < 1, f"num_samples={num_samples}: ask for 1 or more"),
        (max_tokens < 1, f"sampling_params.max_tokens={max_tokens}: ask for 1 or more"),
        (params.temperature < 0, f"sampling_params.temperature={params.temperature}: must be 0 (greedy) or more"),
        (not 0 < params.top_p <= 1, f"sampling_params.top_p={params.top_p}: must be in (0, 1]"),
        (params.top_k == 0 or params.top_k < -1, f"sampling_params.top_k={params.top_k}: -1 (none) or 1 or more"),
        (params.topk_prompt_logprobs < 0, f"topk_prompt_logprobs={params.topk_prompt_logprobs}: 0 or more"),
        (
            params.seed is not None and not 0 <= params.seed <= MAX_SEED,
            f"sampling_params.seed={params.seed}: 0 to 2**31-1",
        ),
    ]
    for failed, message in problems:
        if failed:
            raise TinkerRequestError(message)
    last_n = params.prompt_logprobs_last_n
    for prompt in prompts:
        if not prompt:
            raise TinkerRequestError("the prompt is empty; give at least one token")
        if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
            raise TinkerRequestError(
                f"prompt_logprobs_last_n={last_n}: must be between 1 and the prompt's length less one "
                f"({len(prompt) - 1})"
            )
        if (bad := next((t for t in prompt if not 0 <= t < vocab), None)) is not None:
            raise TinkerRequestError(f"prompt token {bad} is outside the model's vocabulary (0 to {vocab - 1})")
        if context is not None and len(prompt) + max_tokens > context:
            raise TinkerRequestError(
                f"the prompt's {len(prompt)} tokens and max_tokens={max_tokens} exceed the model's context of "
                f"{context} tokens; shorten the prompt or lower max_tokens"
            )


def engine_model(model: ModelConfig, generation: GenerationConfig, lora_rank: int | None) -> ModelConfig:
    """The model config an engine is built from: with vLLM and `lora_rank`, LoRA adapters of up to that rank."""
    if generation.backend != "vllm" or lora_rank is None:
        return model
    lora = (model.lora or LoraConfig()).model_copy(update={"rank": lora_rank, "sync": "adapter"})
    return model.model_copy(update={"lora": lora})


def build_engine(model: ModelConfig, generation: GenerationConfig, tokenizer, seed: int, max_model_len: int | None):
    """A generation engine for the base model `model` in this process, as loops/builders.py builds a run's."""
    base = model.model_copy(update={"lora": None}) if model.lora and generation.backend == "hf" else model
    if generation.backend == "hf":
        from reinforge.generation.hf import HFGenerationBackend
        from reinforge.modeling import load_model, resolve_device

        device = resolve_device(generation.device, "generation.device")
        return HFGenerationBackend(load_model(base), tokenizer, generation.max_batch_size, device)
    from reinforge.generation.vllm_backend import VLLMGenerationBackend
    from reinforge.generation.vllm_config import engine_kwargs
    from reinforge.modeling import model_limits

    longest = max_model_len or model_limits(model).max_positions or 4096
    return VLLMGenerationBackend(**engine_kwargs(base, generation.vllm, seed, longest))
