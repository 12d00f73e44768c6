"""Run tinker-cookbook's minimal loops, unchanged, against a reinforge Tinker server on the demo model.

    python scripts/run_tinker_cookbook.py sl_loop|rl_loop [--data DIR] [--tokenizer DIR] [FIELD=VALUE ...]

runs `tinker_cookbook.recipes.<recipe>.main` through chz exactly as `python -m tinker_cookbook.recipes.<recipe>
FIELD=VALUE ...` would (the fields are the recipe's own: base_url, model_name, batch_size, group_size, max_tokens,
learning_rate, loss_fn, lora_rank, max_steps, log_path, save_every, ...), after three things a hub-less machine
needs and the recipe cannot be told:

- the data: the recipes load `HuggingFaceH4/no_robots` and `openai/gsm8k` by name; the demo's are written under
  DIR (scripts/tinker_cookbook_data.py) and the recipe runs there, where `datasets` finds them before the hub
  (offline: HF_HUB_OFFLINE and HF_DATASETS_OFFLINE are set);
- the tokenizer: the recipe calls `get_tokenizer(model_name)`, which looks in the cookbook's own registry before
  the hub; the demo tokenizer (models/tinker_demo) is registered there under `model_name`;
- the renderer: the recipe picks it from `model_name`, which must be a name the cookbook knows, so the demo is
  served under `Qwen/Qwen3-4B-Instruct-2507` (its renderer writes the demo's chat template byte for byte; the
  default here when `model_name=` is not given, and the server's name for models/tinker_demo in
  configs/tinker_cookbook.yaml).

The server comes from TINKER_BASE_URL (or `base_url=`) and TINKER_API_KEY, as for any Tinker script. A script,
not part of the package: the cookbook is only a test dependency of reinforge, and a user's hub model needs none of
this (its tokenizer and renderer come with its name).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tinker_cookbook_data import MODEL_NAME, ROOT, write_datasets  # noqa: E402

RECIPES = ("sl_loop", "rl_loop")


def recipe_fields(fields: list[str]) -> tuple[list[str], str]:
    """The recipe's chz arguments, with `model_name` added when absent and a relative `log_path` made absolute (the
    recipe runs in the data directory); and the model name."""
    out, model_name = [], None
    for field in fields:
        key, _, value = field.partition("=")
        if key == "log_path":
            field = f"log_path={Path(value).resolve()}"
        if key == "model_name":
            model_name = value
        out.append(field)
    if model_name is None:
        model_name = MODEL_NAME
        out.append(f"model_name={model_name}")
    return out, model_name


def register_demo_tokenizer(model_name: str, tokenizer_dir: Path) -> None:
    """The tokenizer at `tokenizer_dir`, loaded once, in the cookbook's registry under `model_name`."""
    from tinker_cookbook.tokenizer_utils import register_tokenizer
    from transformers import AutoTokenizer

    register_tokenizer(model_name, functools.cache(lambda: AutoTokenizer.from_pretrained(tokenizer_dir)))


def run(
    recipe: str, base_url: str, work_dir: Path, fields: list[str], timeout_s: float, options: tuple[str, ...] = ()
) -> tuple[list[dict], float]:
    """This script on `recipe` in a process of its own against the server at `base_url`, data under work_dir/data,
    logs in work_dir/RECIPE (no checkpoint but the recipe's final one), `options` this script's own: the rows of its
    metrics.jsonl and its wall time; a failed run raises with the tail of its output."""
    log_path = work_dir / recipe
    command = [sys.executable, __file__, recipe, "--data", str(work_dir / "data"), *options, f"base_url={base_url}"]
    command += [f"log_path={log_path}", "save_every=0", *fields]
    env = {**os.environ, "TINKER_API_KEY": os.environ.get("TINKER_API_KEY", "tml-reinforge"), "TINKER_TELEMETRY": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{recipe} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows, wall


@contextlib.contextmanager
def cookbook_server(run_dir: Path, *overrides: str):
    """`reinforge serve-tinker configs/tinker_cookbook.yaml` on a free loopback port, in this process; yields its
    URL."""
    from reinforge.config.loader import load_recipe_config
    from reinforge.tinker.cli import start_server
    from reinforge.tinker.config import TinkerServeConfig

    config_path = ROOT / "configs" / "tinker_cookbook.yaml"
    config = load_recipe_config(
        TinkerServeConfig,
        config_path,
        [
            "tinker.port=0",
            f"tinker.run_dir={run_dir}",
            f"tinker.base_models={{{MODEL_NAME}: {ROOT / 'models' / 'tinker_demo'}}}",
            *overrides,
        ],
    )
    server = start_server(config)
    try:
        yield server.url
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", choices=RECIPES)
    parser.add_argument("--data", type=Path, default=ROOT / "runs" / "tinker_cookbook" / "data")
    parser.add_argument("--tokenizer", type=Path, default=ROOT / "models" / "tinker_demo")
    parser.add_argument("--rl-problems", type=int, help="gsm8k's train split: only the first N problems, cycled")
    args, fields = parser.parse_known_args(argv)
    fields, model_name = recipe_fields(fields)
    data_dir = write_datasets(args.data.resolve(), args.rl_problems)
    for name, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("HF_DATASETS_OFFLINE", "1"),
        ("HF_DATASETS_CACHE", str(data_dir / ".cache")),
    ):
        os.environ.setdefault(name, value)  # before `datasets` is imported, which reads them once
    register_demo_tokenizer(model_name, args.tokenizer.resolve())
    os.chdir(data_dir)

    import chz

    recipe = importlib.import_module(f"tinker_cookbook.recipes.{args.recipe}")
    chz.nested_entrypoint(recipe.main, argv=fields)


if __name__ == "__main__":
    main()
