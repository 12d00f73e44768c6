"""The logprobs of a prompt's own tokens (Tinker's `prompt_logprobs`, `topk_prompt_logprobs`, and the SDK's
`compute_logprobs`), computed by the generation engine on the weights it serves: the model's own distribution at
each position (temperature 1, nothing filtered; what vLLM returns as prompt logprobs whatever its logprobs mode).
Position 0 has no context: None there."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PromptScores:
    logprobs: list[float | None]  # of each prompt token given the ones before it
    topk: list[list[tuple[int, float]] | None] | None  # the k likeliest (token, logprob) at each position; None: k=0


def prompt_scores(engine, prompts: list[list[int]], k: int) -> list[PromptScores]:
    """Each prompt's `PromptScores` from `engine` (the HF engine's model, or vLLM's prompt logprobs)."""
    if hasattr(engine, "llm"):
        return vllm_prompt_scores(engine, prompts, k)
    return [model_prompt_scores(engine.model, prompt, k) for prompt in prompts]


@torch.no_grad()
def model_prompt_scores(model: torch.nn.Module, prompt: list[int], k: int) -> PromptScores:
    """One forward pass of a Hugging Face causal LM over the prompt."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    logits_TV = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1].float()
    logprobs_TV = torch.log_softmax(logits_TV, dim=-1)
    chosen = logprobs_TV.gather(1, ids[0, 1:, None])[:, 0].cpu().tolist()
    topk = None
    if k > 0:
        values, indices = logprobs_TV.topk(min(k, logprobs_TV.shape[-1]), dim=-1)
        topk = [None, *(list(zip(i.tolist(), v.tolist())) for i, v in zip(indices.cpu(), values.cpu()))]
    return PromptScores([None, *chosen], topk)


def vllm_prompt_scores(engine, prompts: list[list[int]], k: int) -> list[PromptScores]:
    """vLLM's prompt logprobs (a one-token request each, with the adapter the engine serves)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt

    params = VLLMSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=k, detokenize=False)
    outputs = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False, lora_request=engine.adapter
    )
    scores = []
    for prompt, output in zip(prompts, outputs):
        positions = output.prompt_logprobs  # None, then {token: Logprob(logprob, rank)} per position
        chosen = [None] + [positions[i][token].logprob for i, token in enumerate(prompt) if i > 0]
        topk = None
        if k > 0:
            topk = [None] + [
                [(t, p.logprob) for t, p in sorted(positions[i].items(), key=lambda item: item[1].rank) if p.rank <= k]
                for i in range(1, len(prompt))
            ]
        scores.append(PromptScores(chosen, topk))
    return scores
