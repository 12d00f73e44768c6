"""`reinforge convert CHECKPOINT_DIR --output HF_DIR [--merge]`: a training checkpoint as a Hugging Face directory.

A checkpoint holds the policy as the trainer saved it, a torch.distributed.checkpoint of global tensors whatever
the layout that wrote it (one process, N FSDP2 ranks, a tensor-parallel mesh: training/state.py), or one
`state.pt` (the one-process format before it). Either is read in one process, put into the model architecture
named by the checkpoint's config.yaml, and written with `save_pretrained` plus the tokenizer, so transformers
and vLLM load the result like any model.

A LoRA run's checkpoint holds only its adapter (keys such as `model.layers.0.self_attn.q_proj.lora_A.default.weight`):
it is written as a PEFT adapter directory (what the run's `final/` holds), or with `--merge` as the merged
model, the adapter folded into the base weights (PEFT's `merge_and_unload`, in float32, then the run's dtype).
A PEFT adapter directory itself (a LoRA run's `final/`) converts only with `--merge`, onto the base model
its adapter_config.json names. The output is written atomically and never over an existing directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from reinforge.errors import ReinforgeError
from reinforge.run_dir import atomic_directory
from reinforge.training.checkpoint import latest_checkpoint, verifies


def policy_state_dict(trainer_dir: Path) -> dict[str, torch.Tensor]:
    """The policy's whole weights (or its LoRA adapter's) in a checkpoint's `trainer/`, of any layout."""
    from reinforge.training.state import model_state_dict

    return model_state_dict(trainer_dir)


def convert(checkpoint: Path, out: Path, merge: bool = False) -> Path:
    """Write `checkpoint` (a checkpoint, a run directory: its newest complete checkpoint, or with `merge` a
    PEFT adapter directory) to `out` as a Hugging Face model directory, or a LoRA checkpoint without `merge`
    as a PEFT adapter directory."""
    if out.exists() and any(out.iterdir()):
        raise ReinforgeError(f"{out} already exists and is not empty; choose another --output")
    if (checkpoint / "adapter_config.json").is_file():
        return merge_adapter_directory(checkpoint, out, merge)
    if (checkpoint / "checkpoints").is_dir():  # a run directory: its newest complete checkpoint
        checkpoint = latest_checkpoint(checkpoint) or checkpoint
    if not verifies(checkpoint):
        raise ReinforgeError(
            f"{checkpoint} is not a complete reinforge checkpoint (no COMPLETE manifest, or files that do not match "
            "its sizes and checksums); "
            "give RUN_DIR/checkpoints/step_N, a run directory or, with --merge, a PEFT adapter directory"
        )
    from reinforge.model_config import ModelConfig
    from reinforge.modeling import load_model, save_tokenizer
    from reinforge.training.lora import absolute_location, add_lora, is_adapter_key, load_adapter_state_dict

    model_config = ModelConfig(**yaml.safe_load((checkpoint / "config.yaml").read_text())["model"])
    state = policy_state_dict(checkpoint / "trainer")
    model = load_model(model_config.model_copy(update={"dtype": "float32"}))  # with a stage's model.adapter merged in
    if any(is_adapter_key(name) for name in state):
        if model_config.lora is None:
            raise ReinforgeError(f"{checkpoint}: its weights are LoRA adapters but its config.yaml has no model.lora")
        peft_model = add_lora(model, model_config.lora, absolute_location(model_config))
        load_adapter_state_dict(peft_model, state)
        if not merge:  # the adapter in PEFT's format, as the run's final/ holds it
            with atomic_directory(out) as tmp:
                peft_model.save_pretrained(tmp)
                save_tokenizer(model_config, tmp)
            return out
        model = peft_model.merge_and_unload()
    elif merge:
        raise ReinforgeError(
            f"{checkpoint} holds a whole model, not a LoRA adapter: there is nothing to merge; drop --merge"
        )
    else:
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [name for name in missing if not (model.config.tie_word_embeddings and name == "lm_head.weight")]
        if missing or unexpected:
            raise ReinforgeError(
                f"{checkpoint}: weights do not fit {model_config.name_or_path} (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]})"
            )
    model = model.to(getattr(torch, model_config.dtype))
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
        save_tokenizer(model_config, tmp)
    return out


def merge_adapter_directory(adapter_dir: Path, out: Path, merge: bool) -> Path:
    """A PEFT adapter directory merged onto the base its adapter_config.json names, in the base's own dtype."""
    from transformers import AutoConfig

    from reinforge.model_config import ModelConfig
    from reinforge.modeling import DTYPES, model_location
    from reinforge.training.lora import save_merged

    if not merge:
        raise ReinforgeError(
            f"{adapter_dir} is already a PEFT adapter directory; add --merge to write the merged model"
        )
    base = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ReinforgeError(
            f"{adapter_dir / 'adapter_config.json'} names no base_model_name_or_path to merge the adapter into"
        )
    base_config = ModelConfig(name_or_path=base)
    stored = getattr(AutoConfig.from_pretrained(model_location(base_config)), "dtype", None)
    dtype = next((name for name, value in DTYPES.items() if value == stored), "float32")
    return save_merged(base_config.model_copy(update={"dtype": dtype}), adapter_dir, out)


def merged_copy(model_config, directory: Path):
    """`model_config` with its `model.adapter` merged into the base and saved in `directory`, as a config of
    that whole model (no adapter): for an engine that loads a model directory itself (vLLM)."""
    from reinforge.training.lora import save_merged

    merged = save_merged(model_config, Path(model_config.adapter), directory / "merged")
    return model_config.model_copy(update={"name_or_path": str(merged), "adapter": None})
