"""`reinforge convert CHECKPOINT_DIR --out HF_DIR`: a training checkpoint as a Hugging Face directory.

A checkpoint holds the policy as the trainer saved it: one `state.pt` (single-process backend) or a
sharded torch.distributed.checkpoint (FSDP2, any number of ranks). Either is read in one process,
put into the model architecture named by the checkpoint's config.yaml, and written with
`save_pretrained` plus the tokenizer, so transformers and vLLM load the result like any model.
The output is written atomically and never over an existing directory.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import yaml

from reinforge.errors import ReinforgeError
from reinforge.run_dir import atomic_directory
from reinforge.training.checkpoint import is_complete, latest_checkpoint


def policy_state_dict(trainer_dir: Path) -> dict[str, torch.Tensor]:
    if (trainer_dir / "state.pt").is_file():
        return torch.load(trainer_dir / "state.pt", weights_only=False)["model"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(trainer_dir), f"{tmp}/full.pt")
        return torch.load(f"{tmp}/full.pt", weights_only=False)["model"]


def convert(checkpoint: Path, out: Path) -> Path:
    from reinforge.config.schema import ModelConfig
    from reinforge.modeling import load_model, load_tokenizer

    if (checkpoint / "checkpoints").is_dir():  # a run directory: its newest complete checkpoint
        checkpoint = latest_checkpoint(checkpoint) or checkpoint
    if not is_complete(checkpoint):
        raise ReinforgeError(f"{checkpoint} is not a complete reinforge checkpoint (no valid COMPLETE manifest); "
                             "give RUN_DIR/checkpoints/step_N or a run directory")
    if out.exists() and any(out.iterdir()):
        raise ReinforgeError(f"{out} already exists and is not empty; choose another --out")
    saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
    model_config = ModelConfig(**saved["model"])
    model = load_model(model_config.model_copy(update={"dtype": "float32"}))
    missing, unexpected = model.load_state_dict(policy_state_dict(checkpoint / "trainer"), strict=False)
    missing = [name for name in missing if not (model.config.tie_word_embeddings and name == "lm_head.weight")]
    if missing or unexpected:
        raise ReinforgeError(f"{checkpoint}: weights do not fit {model_config.name_or_path} (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model = model.to(getattr(torch, model_config.dtype))
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
        load_tokenizer(model_config).save_pretrained(tmp)
    return out
