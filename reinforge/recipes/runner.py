"""`reinforge recipe FILE`: run the stages of a recipe in order, in this process, resumably.

Before anything runs, every stage's config is built and checked (`stages.py`) and the run directory
is checked against the recipe (`markers.py`), so a mistake in the last stage, or a recipe changed
under finished stages, is a one-line error before hours of training. Then, stage by stage:

- a finished stage (its marker exists and its config is unchanged) is skipped;
- an unfinished stage continues from its newest checkpoint (`checkpoint.resume=auto`; with
  `checkpoint.save_every=0` it has none and starts over in its directory);
- after training, a LoRA stage's adapter (final/) is merged into its base in merged/, the weights the
  next stage starts from; the stage's marker is written and RUN_DIR/recipe.jsonl is rewritten.

`--validate` stops after the checks and prints the plan: no model is loaded, the hub is not contacted.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

from reinforge.errors import ReinforgeError
from reinforge.recipes.markers import check_run_dir, write_marker, write_summary
from reinforge.recipes.spec import load_recipe
from reinforge.recipes.stages import Stage, build_stages
from reinforge.run_dir import atomic_write_text
from reinforge.training.lora import save_merged


def run_recipe(
    path: str | Path, overrides: list[str] = (), run_dir: str | None = None, validate_only: bool = False
) -> list[dict[str, Any]]:
    """Run (or with `validate_only`, only check and describe) a recipe; returns the finished stages' markers."""
    path = Path(path)
    recipe = load_recipe(path)
    root = Path(run_dir or recipe.run_dir)
    stages = build_stages(recipe, path, root, list(overrides))
    markers = check_run_dir(root, stages)
    print(f"recipe {path}: {len(stages)} stages, run directory {root}")
    print(plan_table(stages, markers))
    if validate_only:
        print(f"recipe is valid: {len(stages)} stage configs built and checked; nothing was run")
        return [markers[n] for n in sorted(markers)]

    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / "recipe.yaml", path.read_text())
    for stage in stages:
        if stage.number in markers:
            print(f"\n== {stage.label}: finished earlier, skipped (weights: {markers[stage.number]['weights']})")
            continue
        markers[stage.number] = run_stage(stage)
        write_summary(root, markers)
    summary, last = write_summary(root, markers), markers[stages[-1].number]
    print(
        f"\nrecipe finished: {len(stages)} stages; per-stage final metrics: {summary}"
        + (f"; final model: {last['weights']}" if last["weights"] else "")
    )
    return [markers[n] for n in sorted(markers)]


def run_stage(stage: Stage) -> dict[str, Any]:
    """Train one stage and mark it finished."""
    source = (
        f"final weights of stage {stage.model_from.number} ({stage.model_from.name})"
        if stage.model_from
        else stage.config.model.name_or_path
    )
    print(f"\n== {stage.label}: {stage.max_steps} steps from {source}; run directory {stage.run_dir}")
    if stage.run_dir.exists():
        print("   unfinished earlier: continuing from its newest checkpoint (starting over if it has none)")
    started_at = time.time()
    try:
        result = stage.train_fn()(stage.config)
    except ReinforgeError as exc:  # e.g. GRPO refusing to resume under a changed config: say which stage
        raise type(exc)(f"{stage.label}: {exc}") from None
    # The markers and the next stage look for this stage's files in stage.run_dir: a suffixed directory
    # (which a non-resumable loop makes when the directory is taken) would break the chain.
    assert Path(result.run_dir).resolve() == stage.run_dir.resolve(), (result.run_dir, stage.run_dir)
    if stage.recipe.policy and stage.config.model.lora is not None and stage.weights is not None:
        # a LoRA stage's final/ is its adapter; the next stage starts from a whole model
        save_merged(stage.config.model, stage.run_dir / "final", stage.weights)
    marker = write_marker(stage, started_at)
    _release_memory()
    return marker


def plan_table(stages: list[Stage], markers: dict[int, dict[str, Any]]) -> str:
    """The stages with their key settings, one row each, as plain aligned text."""
    header = [
        "#",
        "stage",
        "algorithm",
        "status",
        "steps",
        "max_new_tokens",
        "batch",
        "lr",
        "kl",
        "clip",
        "backend",
        "model",
    ]
    rows = [header] + [[str(s.number), s.name, s.algorithm, _status(s, markers), *key_settings(s)] for s in stages]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def key_settings(stage: Stage) -> list[str]:
    """steps, max_new_tokens, batch, lr, kl, clip, backend, model: what tells the stages of a recipe apart."""
    c = stage.config
    model = f"stage {stage.model_from.number} final" if stage.model_from else c.model.name_or_path
    if stage.recipe.rl:
        rollout = c.rollout
        return [
            str(c.loop.max_steps),
            str(c.generation.max_new_tokens),
            f"{rollout.num_prompts_per_step}x{rollout.num_generations_per_prompt}",
            f"{c.optimizer.lr:g}",
            f"{c.loss.kl_coef:g}",
            f"{c.loss.clip_eps_low:g}/{c.loss.clip_eps_high:g}",
            f"{c.training.backend}x{c.training.num_workers}+{c.generation.backend}",
            model,
        ]
    batch = (
        f"{c.training.global_batch_size} seqs"
        if stage.algorithm == "sft"
        else f"{c.training.global_batch_size // 2} pairs"
    )
    kl = f"beta {c.dpo.beta:g}" if stage.algorithm == "dpo" else "-"
    return [str(stage.max_steps), "-", batch, f"{c.optimizer.lr:g}", kl, "-", c.training.backend, model]


def _status(stage: Stage, markers: dict[int, dict[str, Any]]) -> str:
    if stage.number in markers:
        return "finished"
    return "unfinished" if stage.run_dir.exists() else "pending"


def _release_memory() -> None:
    """Free what the stage left (models, optimizer state, CUDA cache) before the next stage loads its own."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_recipe_command(args) -> None:
    run_recipe(args.recipe, args.overrides, run_dir=args.run_dir, validate_only=args.validate)
