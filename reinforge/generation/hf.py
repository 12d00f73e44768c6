"""Hugging Face transformers generation backend: the reference implementation.

Batched `model.generate` with a KV cache and left padding. The logprob of each sampled token is read
from the scores that generate actually sampled from (after temperature, top-k and top-p), so it is the
sampling distribution's logprob, as vLLM reports it. The engine keeps its own copy of the weights;
`update_weights` copies the trainer's into it in place.

With `params.record_routes` (a mixture-of-experts model, router replay) forward hooks on the routers read the
experts of every token as generate computes with them: the prefill call gives the prompt's (left padding
stripped), each decode call one generated token per row; each completion keeps those of its own tokens, by
vLLM's convention (generation/routes.py: the last generated token, never fed back, has none). The hooks
change nothing, so the tokens and logprobs are those of a run without them.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Iterable

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from reinforge.data.images import ImageInputs, image_token_id, merge_images
from reinforge.errors import NumericalError
from reinforge.generation.base import Completion, GenerationResult, SamplingParams
from reinforge.generation.routes import RouteRecorder, generation_routes, row_routes
from reinforge.generation.weight_digest import WeightDigests, report


class HFGenerationBackend:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_batch_size: int,
        device: torch.device | None = None,
    ):
        """`device`: where the engine generates (the model is moved there); None: where the model is."""
        self.model = (model if device is None else model.to(device)).eval().requires_grad_(False)
        # the engine samples exactly as `generation.*` says (the distribution the trainer's logprobs are of): none of
        # the checkpoint's own sampling defaults (generation_config.json: Qwen2.5-Instruct's top_k=20,
        # repetition_penalty=1.05, ...), which generate would otherwise apply to every setting left unset
        config = self.model.generation_config
        self.model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
        )
        self.device = next(self.model.parameters()).device
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size

    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        params: SamplingParams,
        images: list[ImageInputs | None] | None = None,
        on_step: Callable[[], int] | None = None,
    ) -> GenerationResult:
        """`images`: each prompt's images (a vision-language model; data/images.py), whose image tokens the prompt
        holds; the image token is never sampled. `on_step` (in-flight generation, generation/in_flight.py) is called
        between two decoding steps, after each forward: it returns the policy version of the weights that computed
        that forward's logits (the version of the tokens sampled from them) and may load new weights, which the next
        forward computes with; each completion's `token_versions` are then those versions. The KV cache of the
        tokens so far is kept."""
        requests = [(index, ids) for index, ids in enumerate(prompt_token_ids) for _ in range(params.num_samples)]
        images = images or [None] * len(prompt_token_ids)
        completions: list[list[Completion]] = [[] for _ in prompt_token_ids]
        on_gpu = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=on_gpu):  # sampling never disturbs the caller's RNG
            for chunk_index, start in enumerate(range(0, len(requests), self.max_batch_size)):
                torch.manual_seed(params.seed * 1_000_003 + chunk_index)
                chunk = requests[start : start + self.max_batch_size]
                chunk_images = [images[index] for index, _ in chunk]
                for (prompt_index, _), completion in zip(
                    chunk, self._generate_chunk([ids for _, ids in chunk], params, on_step, chunk_images)
                ):
                    completion.prompt_index = prompt_index
                    completions[prompt_index].append(completion)
        return GenerationResult(completions=completions)

    def _generate_chunk(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_step: Callable[[], int] | None = None,
        images: list[ImageInputs | None] | None = None,
    ) -> list[Completion]:
        pad_id = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompts):  # left padding: every prompt ends at the same column
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        stop_ids = [] if params.ignore_eos else list(params.stop_token_ids) or [self.tokenizer.eos_token_id]
        recorder = RouteRecorder(self.model) if params.record_routes else None
        versions: list[int] = []  # of each decoding step, with `on_step`
        sampled = SampledLogprobs(params)
        hook = LogitsProcessorList(([BetweenSteps(on_step, versions)] if on_step else []) + [sampled])
        # a left-padded batch's images in row order: the order of their image tokens
        present = [i for i in images or () if i is not None]
        pixels = merge_images(present, self.model.config.model_type) if present else {}
        pixels = {name: tensor.to(self.device) for name, tensor in pixels.items()}
        with recorder.recording() if recorder else nullcontext():
            output = self._generate(
                input_ids.to(self.device), attention_mask.to(self.device), stop_ids, params, hook, pixels
            )
        logprobs_BN = sampled.finish(output[:, -1]).cpu()
        new_tokens_BN = output[:, width:].cpu()
        completions = [
            self._cut(new_tokens_BN[row].tolist(), logprobs_BN[row].tolist(), set(stop_ids), params)
            for row in range(len(prompts))
        ]
        if recorder:
            _attach_routes(completions, prompts, recorder, width)
        for completion in completions if on_step else ():
            completion.token_versions = versions[: len(completion.token_ids)]
        return completions

    def _generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        stop_ids: list[int],
        params: SamplingParams,
        logits_processor: LogitsProcessorList | None = None,
        pixels: dict[str, torch.Tensor] | None = None,
    ):
        pad_id, greedy = self.tokenizer.pad_token_id, params.temperature == 0
        # an image prompt's trainer forward puts image features at every image token: one must never be sampled
        suppress = [image_token_id(self.model.config)] if pixels else None
        return self.model.generate(
            **(pixels or {}),
            suppress_tokens=suppress,
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=params.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy else max(params.top_k, 0),  # 0: no top-k (None would take the model's default)
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
            stop_strings=None if params.ignore_eos else list(params.stop_strings) or None,
            tokenizer=self.tokenizer if params.stop_strings and not params.ignore_eos else None,
            repetition_penalty=1.0,
            logits_processor=logits_processor,
        )

    def _cut(self, tokens: list[int], logprobs: list[float], stop_ids: set[int], params: SamplingParams) -> Completion:
        """Keep the tokens up to and including the first stop token or the end of a stop string."""
        end = next((i + 1 for i, token in enumerate(tokens) if token in stop_ids), None)
        if end is None and params.stop_strings and not params.ignore_eos:
            end = next(
                (
                    i + 1
                    for i in range(len(tokens))
                    if any(s in self.tokenizer.decode(tokens[: i + 1]) for s in params.stop_strings)
                ),
                None,
            )
        finish_reason = "stop" if end is not None else "length"
        end = end if end is not None else len(tokens)
        return Completion(prompt_index=-1, token_ids=tokens[:end], logprobs=logprobs[:end], finish_reason=finish_reason)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_state_dict(dict(named_tensors), strict=True)

    def init_weight_transfer(self, info: dict) -> None:
        """Join the refit's transfer group as its member `info["rank_offset"]` (generation/weight_transfer.py)."""
        from reinforge.generation.weight_transfer import TransferInfo, open_group

        info = TransferInfo(**info)
        self.transfer = open_group(info, info.rank_offset)

    def receive_weights(self, version: int | None = None) -> None:
        """`update_weights` through the transfer, bucket by bucket (Hugging Face names); every weight must come."""
        from reinforge.generation.weight_transfer import receive

        expected, loaded = set(self.model.state_dict()), set()
        params = self.model.state_dict(keep_vars=True)

        def load(named, group_end: bool) -> None:
            with torch.no_grad():
                for name, tensor in named:
                    params[name].copy_(tensor)
                    loaded.add(name)

        receive(self.transfer[0], load)
        if missing := sorted(expected - loaded):
            raise RuntimeError(f"the refit sent no {missing[0]} (and {len(missing) - 1} more)")

    def transfer_ranks(self) -> int:
        return 1

    def refit_layout(self):
        """The sender sends this engine the trainer's own names and layout (no checkpoint to match), in its dtype."""
        from reinforge.generation.weight_transfer import WireLayout

        return WireLayout(dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."))

    def weight_digests(self, columns: int = 0, step: int = 0) -> list[WeightDigests]:
        """The digest of every weight the engine computes with (its state_dict, Hugging Face names), of its sampled
        columns (weight_digest.column_sample)."""
        return [report("hf engine", self.model.state_dict().items(), columns=columns, step=step)]

    def weight_layout(self) -> list[WeightDigests]:
        """The engine's weights' names, shapes and dtypes, nothing hashed (the refit check's expected side)."""
        return [report("hf engine", self.model.state_dict().items(), digests=False)]

    def sleep(self) -> None:
        """Nothing to release: the HF engine holds only the weights, which it needs for the refit."""

    def shutdown(self) -> None:
        self.model = None


class SampledLogprobs(LogitsProcessor):
    """The logprob of each sampled token under the distribution it was sampled from, one decoding step at a time
    (so memory is one [B, V] step, not generate's `output_scores`, [B, N, V] over the whole answer).

    generate applies its custom logits processors before its sampling warpers, so this applies the same warpers
    (transformers' own: temperature, top-k, top-p, in generate's order) to a copy of the scores it is given; the
    token sampled from a step's distribution is the last column of the next call's input_ids (`finish` takes the
    last step's)."""

    def __init__(self, params: SamplingParams):
        warpers = []
        if params.temperature > 0:  # greedy: the plain distribution, as generate leaves it
            if params.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                warpers.append(TopPLogitsWarper(params.top_p))
        self.warpers = LogitsProcessorList(warpers)
        self.step_logprobs: torch.Tensor | None = None  # [B, V], of the step whose token is not yet known
        self.taken: list[torch.Tensor] = []  # [B] each

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        check_finite_logits(scores, len(self.taken))
        self._take(input_ids[:, -1])
        self.step_logprobs = torch.log_softmax(self.warpers(input_ids, scores.float()), dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self.step_logprobs is not None:
            self.taken.append(self.step_logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """[B, N]: each step's sampled token's logprob, given the tokens sampled at the last step."""
        self._take(last_tokens)
        self.step_logprobs = None
        return torch.stack(self.taken, dim=1)


def check_finite_logits(scores: torch.Tensor, step: int) -> None:
    """A one-line error, not torch.multinomial's traceback, when a decoding step's logits hold a NaN or +inf or a row
    has no finite logit (-inf is a token masked out): the engine's weights are not finite."""
    finite = torch.isfinite(scores)
    if bool((finite | (scores == float("-inf"))).all() and finite.any(dim=-1).all()):
        return
    raise NumericalError(
        f"the HF generation engine's logits are not finite at decoding step {step}: the policy's weights it holds "
        "are not finite, or so large that the forward overflows (the trainer checks its own after every step: "
        "docs/reliability.md, Numerical faults)"
    )


class BetweenSteps(LogitsProcessor):
    """Calls `on_step` once per decoding step, after the forward and before sampling (a logits processor that
    leaves the scores as they are), and keeps the version it returns for the step's tokens."""

    def __init__(self, on_step: Callable[[], int], versions: list[int]):
        self.on_step, self.versions = on_step, versions

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.versions.append(self.on_step())
        return scores


def _attach_routes(completions: list[Completion], prompts: list[list[int]], recorder: RouteRecorder, width: int):
    """Give each completion of a left-padded chunk the routes of its own tokens (generation/routes.py)."""
    prefill_BWLK, decode_BDLK = generation_routes(recorder.calls(), len(prompts), width)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        completion.routed_experts = row_routes(
            prefill_BWLK, decode_BDLK, row, len(prompt), len(completion.token_ids), recorder.dtype
        )


class HFGenerationWorker(HFGenerationBackend):
    """The HF backend built from config inside its own process (a Ray actor)."""

    def __init__(self, model_config, max_batch_size: int, device: str = "auto"):
        from reinforge.modeling import load_model, load_tokenizer, resolve_device

        device = resolve_device(device, "generation.device")  # in this actor: the GPU Ray gave it, if any
        super().__init__(load_model(model_config), load_tokenizer(model_config), max_batch_size, device)
