"""Multi-stage recipes (`reinforge recipe FILE`): stages of grpo, ppo, distill, sft, dpo or rm run in order, each
starting from the previous stage's final weights, resumable stage by stage. DeepScaleR's 8K -> 16K ->
24K context schedule (configs/recipes/deepscaler-1.5b.yaml) and SFT -> RL chains are recipes.

- `spec.py`: the recipe file and its validation;
- `stages.py`: one validated config per stage, chained through the run directory;
- `markers.py`: finished-stage markers, the checks on a rerun, RUN_DIR/recipe.jsonl;
- `runner.py`: the command: validate, print the plan, run the unfinished stages.

See docs/recipes.md.
"""
