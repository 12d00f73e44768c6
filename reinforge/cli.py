"""The `reinforge` command line."""

from __future__ import annotations

import argparse
import os
import sys

from reinforge.paths import PROJECT_ROOT

DEMO_CONFIG = PROJECT_ROOT / "configs" / "grpo_demo.yaml"

OVERRIDES_HELP = (
    "key=value overrides, type-checked against the config schema, e.g. grpo.max_steps=10 "
    "training.lr=1e-5 model.name_or_path=Qwen/Qwen2.5-1.5B. Sections: model, data, generation, training, "
    "grpo, loss, env, cluster, checkpoint, logging, plus seed."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reinforge", description="Reinforcement-learning post-training of LLMs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    grpo = commands.add_parser(
        "grpo",
        help="train a policy with GRPO on verifiable rewards",
        description="Run GRPO: sample groups of answers, score them with environments, update the policy "
        "with a clipped policy-gradient loss. Writes config.yaml, metrics.jsonl and final/ to logging.run_dir.",
    )
    grpo.add_argument("--config", required=True, help="YAML config file (may inherit with `defaults:`)")
    grpo.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)

    demo = commands.add_parser(
        "demo",
        help="GRPO on the embedded demo model (a few minutes on a laptop CPU)",
        description=f"Same as `reinforge grpo --config {DEMO_CONFIG}`: GRPO lifts the tiny demo model's "
        "accuracy on arithmetic word problems; prints validation accuracy before and after.",
    )
    demo.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)

    from reinforge.envs.cli import add_env_commands

    add_env_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Imports after parsing so that `--help` is instant.
    from reinforge.config import load_config
    from reinforge.errors import ReinforgeError

    try:
        if args.command in ("grpo", "demo"):
            from reinforge.algorithms import grpo
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
            config = load_config(args.config if args.command == "grpo" else DEMO_CONFIG, args.overrides)
            grpo.train(config)
        elif args.command == "env":
            from reinforge.envs.cli import run_env_command

            run_env_command(args)
    except ReinforgeError as exc:
        print(f"reinforge: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("reinforge: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
