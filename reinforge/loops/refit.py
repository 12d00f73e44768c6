"""The refit: the generation engine takes the trainer's current policy, after each optimizer step and
when a run resumes. Two ways, chosen by `model.lora.sync` (model_config.py, `adapter_sync`):

- merged (full fine-tuning, LoRA with the HF engine, or `sync=merged`): the trainer's Hugging Face
  weights, with LoRA the merged W + (alpha / r) B A computed afresh from the untouched base, are
  loaded into the engine in place (`update_weights`).
- adapter (LoRA with vLLM): the trainer writes its adapter in PEFT's format to RUN_DIR/adapter/,
  replaced atomically (a reader sees the previous adapter or the new one, whole), and the engine
  loads it (`load_adapter`); the engine's base weights are never rewritten. The directory is in the
  run directory so that engines in other processes (Ray) can read it.

Then, every `generation.verify_refit_every` steps and at resume, every engine proves it serves what was
just sent (generation/weight_digest.py): the digest of each weight (or adapter tensor) where the engine
holds it must equal the digest of the tensor sent, or the run stops with a `RefitMismatch` naming the
engine and the weight. The consistency gate and the mismatch metrics do not know which way ran: they
compare the engine's logprobs with the trainer's either way.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from reinforge.algorithms.rl_config import RLRunConfig
from reinforge.generation.base import GenerationBackend
from reinforge.generation.weight_digest import Expectation, adapter_tensors, check, verify
from reinforge.logging.memory import PeakGrowth
from reinforge.logging.metrics import Timers
from reinforge.run_dir import atomic_directory
from reinforge.training.base import TrainingBackend

ADAPTER_DIR = "adapter"


def verify_due(every: int, step: int | None) -> bool:
    """Verify this refit? Every `every`th step's (never with 0), and always at resume (`step` None)."""
    return every > 0 and (step is None or step % every == 0)


def refit(
    engine: GenerationBackend,
    trainer: TrainingBackend,
    config: RLRunConfig,
    run_dir: Path,
    step: int | None = None,
    timers: Timers | None = None,
) -> dict[str, float]:
    """Give `engine` the trainer's current policy, the way `model.lora.sync` says, and verify it when due
    (`step`: the step just trained, None at resume; the check's time is `timing/refit_verify_s`). Its metrics:
    what the wire moved to engines in Ray (`perf/refit_bytes`, `perf/refit_buckets`), and how far the driver's
    resident memory rose meanwhile (`perf/refit_driver_growth_mb`, where Linux tells)."""
    with PeakGrowth() as driver:
        metrics = _refit(engine, trainer, config, run_dir, step, timers)
    if driver.growth_mb is not None:
        metrics["perf/refit_driver_growth_mb"] = driver.growth_mb
    return metrics


def _refit(engine, trainer, config: RLRunConfig, run_dir: Path, step: int | None, timers: Timers | None) -> dict:
    due = verify_due(config.generation.verify_refit_every, step)
    timed = timers.time("refit_verify") if timers else nullcontext()
    sample = dict(columns=config.generation.verify_refit_columns, step=step or 0)
    if not config.adapter_sync and getattr(engine, "wire", None) is not None:  # engines in Ray: from the ranks
        expect = Expectation(engine.wire.layouts(), **sample) if due else None
        stats = engine.wire.refit(trainer, config.generation.refit_bucket_mb << 20, expect=expect)
        if due:
            with timed:
                check(engine.weight_digests(**sample), stats["expectation"])
        return {"perf/refit_bytes": stats["bytes"], "perf/refit_buckets": stats["buckets"]}
    if not config.adapter_sync:
        weights = list(trainer.named_weights())
        engine.update_weights(weights)
        if due:
            with timed:
                verify(engine.weight_digests(**sample), dict(weights), **sample)
        return {}
    adapter = (run_dir / ADAPTER_DIR).resolve()  # absolute: engine processes may run elsewhere
    with atomic_directory(adapter) as tmp:
        trainer.save_adapter(tmp)
    engine.load_adapter(str(adapter))
    if due:
        with timed:
            verify(engine.adapter_digests(), adapter_tensors(adapter, config.model.dtype), what="LoRA adapter")
    return {}
