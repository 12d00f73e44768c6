"""vLLM's side of image prompts (data/images.py): the prompt vLLM takes, and the check that it expanded it as the
model's processor did.

vLLM expands each image placeholder into the image's tokens itself (given the expanded ids, it would expand them
again), so it gets the prompt with one placeholder per image and the images (`multi_modal_data`); the prompt it
reports back must be the one the trainer scores.
"""

from __future__ import annotations

from typing import Any

from reinforge.data.images import ImageInputs
from reinforge.errors import ReinforgeError


def vllm_prompt(ids: list[int], inputs: ImageInputs | None) -> Any:
    """vLLM's prompt: the token ids, or an image prompt's placeholder form and its images."""
    from vllm.inputs import TokensPrompt

    if inputs is None:
        return TokensPrompt(prompt_token_ids=ids)
    return TokensPrompt(prompt_token_ids=inputs.engine_prompt_ids, multi_modal_data={"image": inputs.images})


def check_expansion(ids: list[int], inputs: ImageInputs | None, output: Any) -> None:
    """A one-line error when vLLM's expansion of an image prompt (`output.prompt_token_ids`) is not `ids`."""
    if inputs is not None and list(output.prompt_token_ids) != list(ids):
        raise ReinforgeError(
            "vLLM expanded an image prompt into other tokens than the model's processor did; the processor "
            "beside the model (processor_config.json) and vLLM's for this model family disagree"
        )
