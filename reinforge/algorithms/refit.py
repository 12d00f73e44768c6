"""The refit: the generation engine takes the trainer's current policy, after each optimizer step and
when a run resumes. Two ways, chosen by `model.lora.sync` (model_config.py, `adapter_sync`):

- merged (full fine-tuning, LoRA with the HF engine, or `sync=merged`): the trainer's Hugging Face
  weights, with LoRA the merged W + (alpha / r) B A computed afresh from the untouched base, are
  loaded into the engine in place (`update_weights`).
- adapter (LoRA with vLLM): the trainer writes its adapter in PEFT's format to RUN_DIR/adapter/,
  replaced atomically (a reader sees the previous adapter or the new one, whole), and the engine
  loads it (`load_adapter`); the engine's base weights are never rewritten. The directory is in the
  run directory so that engines in other processes (Ray) can read it.

The consistency gate and the mismatch metrics do not know which way ran: they compare the engine's
logprobs with the trainer's either way.
"""

from __future__ import annotations

from pathlib import Path

from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.generation.base import GenerationBackend
from reinforge.model_config import adapter_sync
from reinforge.run_dir import atomic_directory
from reinforge.training.base import TrainingBackend

ADAPTER_DIR = "adapter"


def refit(engine: GenerationBackend, trainer: TrainingBackend, config: RLRunConfig, run_dir: Path) -> None:
    """Give `engine` the trainer's current policy, the way `model.lora.sync` says."""
    if not adapter_sync(config):
        engine.update_weights(trainer.named_weights())
        return
    adapter = (run_dir / ADAPTER_DIR).resolve()  # absolute: engine processes may run elsewhere
    with atomic_directory(adapter) as tmp:
        trainer.save_adapter(tmp)
    engine.load_adapter(str(adapter))
