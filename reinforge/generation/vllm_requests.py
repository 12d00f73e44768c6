"""A vLLM request from reinforge's sampling settings, and reinforge's completions from vLLM's finished request:
what the in-process engine (vllm_backend.py) and the in-flight engine on AsyncLLM (vllm_async.py) share."""

from __future__ import annotations

from reinforge.data.images import ImageInputs
from reinforge.generation.base import Completion, SamplingParams
from reinforge.generation.vllm_moe import route_array


def sampled_logprobs(sample) -> list[float]:
    """The logprob of each sampled token from a sample's `FlatLogprobs` (with `logprobs=0` it holds exactly
    one entry per position: the sampled token's)."""
    flat = sample.logprobs
    assert list(flat.token_ids) == list(sample.token_ids), "vLLM returned logprobs for other tokens than it sampled"
    return list(flat.logprobs)


def token_versions(spans, num_tokens: int) -> list[int] | None:
    """Each generated token's policy version from vLLM's `CompletionOutput.weight_versions` ([start, end) spans
    of output tokens, labelled by `set_weight_version`); None when vLLM gave none."""
    if not spans:
        return None
    versions = [0] * num_tokens
    for span in spans:
        versions[span.start : span.end] = [int(span.version)] * (min(span.end, num_tokens) - span.start)
    return versions


def vllm_sampling_params(
    params: SamplingParams, index: int, images: "ImageInputs | None", image_token: int | None, routes: bool
):
    """vLLM's sampling parameters for prompt `index` of a request (with `images`, the image token `image_token` is
    never sampled: the trainer puts image features at every image token; `routes`: the engine records routes)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    assert routes or not params.record_routes, "routes need an engine built with route_experts"
    greedy = params.temperature == 0
    return VLLMSamplingParams(
        n=params.num_samples,
        temperature=params.temperature,
        top_p=1.0 if greedy else params.top_p,
        top_k=0 if greedy or params.top_k <= 0 else params.top_k,
        max_tokens=params.max_new_tokens,
        stop_token_ids=None if params.ignore_eos else list(params.stop_token_ids) or None,
        stop=None if params.ignore_eos else list(params.stop_strings) or None,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=True,  # the stop string's tokens are trained on, as in the HF backend
        seed=params.seed * 1_000_003 + index,  # reproducible, and independent across prompts
        logprobs=0,  # just the sampled token's
        flat_logprobs=True,  # a few flat lists per sample instead of a dict per token
        detokenize=bool(params.stop_strings),  # only stop strings need text; rewards decode the token ids
        output_kind=RequestOutputKind.FINAL_ONLY,  # a request's samples once all of them are done
        logit_bias=None if images is None else {image_token: -100.0},
    )


def vllm_completions(output, index: int, params: SamplingParams, num_experts: int) -> list[Completion]:
    """The samples of one finished vLLM request (prompt `index`), with their tokens' policy versions."""
    return [
        Completion(
            prompt_index=index,
            token_ids=list(sample.token_ids),
            logprobs=sampled_logprobs(sample),
            finish_reason="length" if sample.finish_reason == "length" else "stop",
            routed_experts=route_array(sample.routed_experts, num_experts) if params.record_routes else None,
            token_versions=token_versions(sample.weight_versions, len(sample.token_ids)),
        )
        for sample in output.outputs
    ]
