"""What a causal LM's forward does to its logits after the LM head, for the heads that apply the LM head themselves.

The trainer's chunked LM head (training/micro_batching.py, `head_chunk`; its vocabulary-parallel form,
training/parallel/tensor.py, `vocab_parallel_logprobs`) and the distillation teacher's (training/teacher.py) take
the decoder's hidden states and apply the head in chunks; the model's own forward is never asked for the logits.
So whatever that forward does after its head must be done here too, as transformers 5.19's models do it:
- `final_logit_softcapping` (Gemma 2 and 3, VaultGemma, nanochat): cap * tanh(logits / cap);
- `logit_scale` (Cohere, Cohere 2): logits * scale;
- `logits_scaling`: Granite's families divide by it, HyperCLOVA X multiplies by it.
Every transform is elementwise, so it applies to a rank's slice of the vocabulary as well. A setting the head does
not know (`output_multiplier`, `lm_head_multiplier`, or `logits_scaling` of another family) is a one-line error
naming it, never logprobs of other logits than the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from reinforge.errors import ConfigError

# Config attributes of models that change their logits after the LM head in a way the head does not know
UNKNOWN_TRANSFORMS = ("output_multiplier", "lm_head_multiplier")
SCALED_BY = {"granite": "divide", "hyperclovax": "multiply"}  # `logits_scaling`, by model type prefix


@dataclass(frozen=True)
class LogitTransform:
    """logits -> softcap(logits * multiplier / divisor); the identity by default."""

    multiplier: float = 1.0
    divisor: float = 1.0
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


IDENTITY = LogitTransform()


def logit_transform(config: PretrainedConfig) -> LogitTransform:
    """The transform `config`'s causal LM applies to its logits (a vision-language model's: its text model's)."""
    text = config.get_text_config()

    def setting(name: str) -> float | None:
        value = getattr(text, name, None)
        return None if value in (None, 1, 1.0) else float(value)

    unknown = [name for name in UNKNOWN_TRANSFORMS if setting(name) is not None]
    scaling = setting("logits_scaling")
    way = next((w for prefix, w in SCALED_BY.items() if text.model_type.startswith(prefix)), None)
    if scaling is not None and way is None:
        unknown.append("logits_scaling")
    if unknown:
        raise ConfigError(
            f"{text.model_type} transforms its logits after the LM head ({', '.join(unknown)}) in a way the trainer's "
            "chunked LM head does not know (training/logit_transform.py); its logprobs would not be the model's"
        )
    return LogitTransform(
        multiplier=(setting("logit_scale") or 1.0) * (scaling if way == "multiply" else 1.0),
        divisor=scaling if way == "divide" else 1.0,
        softcap=None if (cap := getattr(text, "final_logit_softcapping", None)) is None else float(cap),
    )
