"""The `reinforge` command line: `build_parser` lists the subcommands; each is declared by an `add_<cmd>_parser`
beside the `run_<cmd>` that runs it (here, or in its package's cli.py), which it sets as the parsed `args.run`."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from reinforge import __version__
from reinforge.envs.cli import add_env_commands, add_serve_rm_command
from reinforge.evaluation.cli import add_eval_command
from reinforge.paths import PROJECT_ROOT
from reinforge.serving.cli import add_serve_command
from reinforge.tinker.cli import add_serve_tinker_command
from reinforge.training.parallel.plan_cli import add_plan_command

DEMO_CONFIG = PROJECT_ROOT / "configs" / "grpo_demo.yaml"
CONFIG_HELP = "YAML config file (may inherit with `defaults:`)"
RL_COMMANDS = ("grpo", "ppo", "distill")  # the runs with generation engines: `--validate` checks their layout
RECIPE_COMMANDS = ("grpo", "ppo", "distill", "sft", "dpo", "rm", "demo")  # checkpointed, so restartable (supervisor.py)

# name: (summary, description, an override of its own for the help's example); each trains with its recipe
TRAINING_COMMANDS = {
    "grpo": (
        "train a policy with GRPO on verifiable rewards",
        "Run GRPO: sample groups of answers, score them with environments, update the policy "
        "with a clipped policy-gradient loss. Writes config.yaml, metrics.jsonl and final/ to logging.run_dir.",
        "loop.max_steps=10",
    ),
    "ppo": (
        "train a policy with PPO and a critic (GAE advantages per token)",
        "Run PPO: the RL loop with a critic (a value head on its own copy of the base model) trained on the same "
        "rollouts, GAE advantages per token, a clipped value loss. Writes config.yaml, metrics.jsonl and final/ to "
        "logging.run_dir; checkpoints hold the critic too.",
        "ppo.critic_lr=1e-5",
    ),
    "distill": (
        "on-policy distillation: the student samples, a frozen teacher scores its tokens",
        "Run on-policy distillation: the RL loop, the student trained toward a frozen teacher (same tokenizer) on "
        "its own samples, by the per-token reverse KL as advantage or a top-k logits KL (docs/algorithms.md). "
        "Writes config.yaml, metrics.jsonl and final/ to logging.run_dir.",
        "distill.topk=32",
    ),
    "sft": (
        "supervised fine-tuning on chat data (loss on assistant tokens, packed batches)",
        "Run SFT: chats rendered with the model's chat template, loss on the assistant tokens, "
        "packed micro-batches. Writes config.yaml, metrics.jsonl and final/ to logging.run_dir.",
        "sft.max_steps=10",
    ),
    "dpo": (
        "train a policy with DPO on preference pairs (prompt, chosen, rejected)",
        "Run DPO: the policy learns to prefer the chosen reply over the rejected one relative to a frozen "
        "reference (the starting model). Writes config.yaml, metrics.jsonl and final/ to logging.run_dir.",
        "dpo.max_steps=10",
    ),
    "rm": (
        "train a Bradley-Terry reward model on preference pairs",
        "Train a reward model: a scalar head on a causal LM, loss -log sigmoid(r_chosen - r_rejected). Writes "
        "config.yaml, metrics.jsonl and final/, which `reinforge serve-rm RUN_DIR/final` serves to the judge "
        "environment.",
        "rm.max_steps=10",
    ),
}


def overrides_help(recipe: str, example: str) -> str:
    return (
        f"key=value overrides, type-checked against {recipe}'s config tree, e.g. {example} "
        "optimizer.lr=1e-5 model.name_or_path=Qwen/Qwen2.5-1.5B; a key this recipe does not have is an error "
        "naming the nearest one it has (the sections are in docs/configuration.md)."
    )


class RenamedFlag(argparse.Action):
    """A flag that also answers to its old name (`aliases`, listed after the new one): the old name still
    works and says once on stderr which name replaces it."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string != self.option_strings[0]:
            print(f"reinforge: warning: {option_string} is deprecated; use {self.option_strings[0]}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_output_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    """`--output`, as every command that writes a named file or directory calls it (`--out`: its old name)."""
    parser.add_argument(
        "--output", "--out", required=True, action=RenamedFlag, help=f"{help_text} (--out: the old name, deprecated)"
    )


def add_training_parsers(commands: argparse._SubParsersAction) -> None:
    for name, (summary, description, example) in TRAINING_COMMANDS.items():
        parser = commands.add_parser(name, help=summary, description=description)
        parser.add_argument("--config", required=True, help=CONFIG_HELP)
        parser.add_argument("overrides", nargs="*", help=overrides_help(name, example))
        if name in RL_COMMANDS:
            parser.add_argument(
                "--validate",
                "--dry-run",
                dest="validate",
                action="store_true",
                help="check the config, the training ranks' layout and the engines' (count, tensor-parallel size, "
                "placement) against the model's sizes, and print where each runs; load no weights, start no Ray",
            )
        parser.set_defaults(run=run_training)
    demo = commands.add_parser(
        "demo",
        help="GRPO on the embedded demo model (a few minutes on a laptop CPU)",
        description="Same as `reinforge grpo --config configs/grpo_demo.yaml`: GRPO lifts the tiny demo model's "
        "accuracy on arithmetic word problems; prints validation accuracy before and after.",
    )
    demo.add_argument("overrides", nargs="*", help=overrides_help("grpo", "loop.max_steps=10"))
    demo.set_defaults(run=run_training)


def run_training(args: argparse.Namespace) -> None:
    from reinforge.config.loader import load_recipe_config
    from reinforge.loops.registry import RECIPES

    recipe = RECIPES["grpo" if args.command == "demo" else args.command]
    path = DEMO_CONFIG if args.command == "demo" else args.config
    config = load_recipe_config(recipe.config_class, path, args.overrides)
    if getattr(args, "validate", False):
        from reinforge.loops.dry_run import validate_run

        print("\n".join(validate_run(config)))
        return
    recipe.train(config)


def add_recipe_parser(commands: argparse._SubParsersAction) -> None:
    recipe = commands.add_parser(
        "recipe",
        help="run a multi-stage recipe (e.g. GRPO at growing context lengths, or SFT then GRPO)",
        description="Run the stages of a recipe file in order, each from the previous stage's final weights, in "
        "RUN_DIR/stages/<kk>-<name>. Rerunning the same command skips finished stages and resumes the unfinished one. "
        "See docs/recipes.md.",
    )
    recipe.add_argument("recipe", metavar="FILE", help="recipe YAML file (run_dir, base, overrides, stages)")
    recipe.add_argument(
        "--validate",
        "--dry-run",
        dest="validate",
        action="store_true",
        help="build and check every stage's config and print the plan; load no model, run nothing",
    )
    recipe.add_argument("--run-dir", help="RUN_DIR instead of the recipe's run_dir")
    recipe.add_argument(
        "overrides", nargs="*", help="key=value overrides applied to every stage, after the recipe's own"
    )
    recipe.set_defaults(run=run_recipe)


def run_recipe(args: argparse.Namespace) -> None:
    from reinforge.recipes.runner import run_recipe_command

    run_recipe_command(args)


def add_curriculum_parser(commands: argparse._SubParsersAction) -> None:
    curriculum = commands.add_parser(
        "curriculum",
        help="offline pass-rate pre-filtering of a prompt file (Llama-Nemotron's curriculum)",
        description="Measure each prompt's pass rate with the config's model before training, and keep the "
        "prompts it does not already solve (docs/algorithms.md, 'Curriculum').",
    )
    prefilter = curriculum.add_subparsers(dest="curriculum_command", required=True, metavar="COMMAND").add_parser(
        "prefilter",
        help="write data.train_path's records with a measured `pass_rate` field",
        description="Sample curriculum.prefilter_samples answers to each prompt of data.train_path with the config's "
        "model, score them, and write the records below curriculum.prefilter_threshold (all with --keep-all) with "
        "their pass_rate.",
    )
    prefilter.add_argument("--config", required=True, help=CONFIG_HELP)
    add_output_argument(prefilter, "JSONL file to write")
    prefilter.add_argument("--keep-all", action="store_true", help="also write the prompts at or above the threshold")
    prefilter.add_argument("overrides", nargs="*", help=overrides_help("grpo", "curriculum.prefilter_samples=4"))
    prefilter.set_defaults(run=run_curriculum)


def run_curriculum(args: argparse.Namespace) -> None:
    from reinforge.config.loader import load_recipe_config
    from reinforge.loops.curriculum_prefilter import prefilter_file
    from reinforge.loops.registry import RECIPES

    config = load_recipe_config(RECIPES["grpo"].config_class, args.config, args.overrides)
    written, measured = prefilter_file(config, Path(args.output), args.keep_all)
    print(f"{args.output}: {written} of {measured} records")


def add_report_parser(commands: argparse._SubParsersAction) -> None:
    report = commands.add_parser(
        "report",
        help="plots and a summary of a run, written to RUN_DIR/report/",
        description="Read RUN_DIR/metrics.jsonl and config.yaml; write PNG plots (reward, validation accuracy, KL, "
        "entropy, lengths, mismatch, time per phase, throughput) and summary.md to RUN_DIR/report/.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (it holds metrics.jsonl)")
    report.set_defaults(run=run_report)


def run_report(args: argparse.Namespace) -> None:
    from reinforge.logging.report import write_report

    for path in write_report(args.run_dir):
        print(path)


def add_convert_parser(commands: argparse._SubParsersAction) -> None:
    convert = commands.add_parser(
        "convert",
        help="a training checkpoint as a Hugging Face directory; a LoRA adapter merged into its base (--merge)",
        description="Write the policy of a checkpoint (RUN_DIR/checkpoints/step_N, or a run directory: its newest "
        "complete checkpoint), single-process or FSDP2-sharded, as a Hugging Face directory that transformers and "
        "vLLM load. A LoRA run's checkpoint becomes a PEFT adapter directory, or with --merge the base model with the "
        "adapter merged in; --merge also takes a PEFT adapter directory (a LoRA run's final/).",
    )
    convert.add_argument(
        "checkpoint",
        metavar="CHECKPOINT_DIR",
        help="RUN_DIR/checkpoints/step_N, RUN_DIR, or with --merge a PEFT adapter directory (RUN_DIR/final)",
    )
    add_output_argument(convert, "new directory to write")
    convert.add_argument(
        "--merge",
        action="store_true",
        help="merge a LoRA adapter into its base weights: write a whole Hugging Face model",
    )
    convert.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> None:
    from reinforge.training.convert import convert

    print(convert(Path(args.checkpoint), Path(args.output), merge=args.merge))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reinforge", description="Reinforcement-learning post-training of LLMs.")
    parser.add_argument("--version", action="version", version=f"reinforge {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        add_training_parsers,
        add_recipe_parser,
        add_env_commands,
        add_eval_command,
        add_serve_command,
        add_serve_rm_command,
        add_serve_tinker_command,
        add_plan_command,
        add_curriculum_parser,
        add_report_parser,
        add_convert_parser,
    ):
        add(commands)
    return parser


def run_command(args: argparse.Namespace) -> None:
    """The parsed command's `run`: its imports inside it, so that each command loads only what it needs."""
    args.run(args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """argparse's, except that key=value overrides may also come after an option that follows the
    positionals (`reinforge recipe FILE --run-dir DIR k=v`): argparse stops the positionals' list at the
    option and would call the rest unrecognized. They are appended in order; anything else is still refused."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(item.startswith("-") or "=" not in item for item in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    """The command line. `argv=None`: this process's own, so that its exit is bounded (hang.py `bound_exit`); a
    caller that passes `argv` (a test) keeps its process whatever happens."""
    entry, argv = argv is None, sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # torch's OpenMP threads spin up to 300,000 times at every barrier before they sleep: on cores another
    # process also uses, a spinning thread holds the core its descheduled partner needs (the demo's step took
    # 4.5x as long beside one other torch process). 1,000 spins keep it under 2x there (one core of two is
    # taken, so 2x is the floor), for about 5% alone; vLLM's generation is unchanged (docs/benchmarks.md). It
    # must be set before torch loads; the processes this one starts inherit it; a value you set wins.
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    if args.command in RECIPE_COMMANDS:
        from reinforge import supervisor

        settings = supervisor.settings(getattr(args, "config", None) or str(DEMO_CONFIG), args.overrides)
        dry_run = getattr(args, "validate", False)  # trains nothing, so nothing to restart: no child process
        if settings.max_restarts and not supervisor.supervised() and not dry_run:
            return supervisor.supervise(argv, settings)
    # Imports after parsing so that `--help` is instant.
    from reinforge import exits, hang

    exits.start_heartbeat()  # a supervised run's: its supervisor ends it when the beats stop (a stopped process)
    exits.keep_console()  # the last lines reach the console even while fd 2 is the run's log
    if entry:
        hang.enable_exit_deadline()
    try:
        # the commands that load models: transformers' errors only, no bars
        if args.command not in ("env", "report", "plan"):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            if args.command != "convert":
                hf_logging.set_verbosity_error()
        run_command(args)
        status = 0
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001  every end is one line and a status (docs/reliability.md)
        status = report_failure(exc)
    hang.bound_exit(None, status)  # what is left (threads joined at exit, Ray's atexit) has a deadline too
    exits.end_heartbeat(hang.exit_deadline_s())  # the supervisor waits that long more for its end
    return status


def report_failure(exc: BaseException) -> int:
    """Print the one line of a command that ended with `exc`; return its exit status (exits.py `exit_status`): 75 for
    what a restart may get past (an InfrastructureError, a transient error of the filesystem or network), 2 for the
    input's errors and for bugs (never restarted: they would repeat), 130 interrupted."""
    from reinforge.errors import ReinforgeError
    from reinforge.exits import INFRASTRUCTURE_EXIT, exit_status

    status = exit_status(exc)
    if isinstance(exc, KeyboardInterrupt):
        print("reinforge: interrupted", file=sys.stderr)
        return status
    transient = (
        " (transient: a restart from the last checkpoint may get past it)" if status == INFRASTRUCTURE_EXIT else ""
    )
    if isinstance(exc, ReinforgeError):
        line = str(exc)
    elif isinstance(exc, OSError) and exc.filename is not None:  # a path, wherever it was opened
        line = f"{exc.filename}: {exc.strerror}" + (transient or "; check the path and its permissions")
    elif transient:
        line = f"{type(exc).__name__}: {first_line(exc)}{transient}"
    else:
        line = bug_line(exc)
    print(f"reinforge: error: {line}", file=sys.stderr)
    return status


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def bug_line(exc: BaseException) -> str:
    """The line of an exception nobody expected: what and where (the innermost frame in reinforge), and where its
    whole traceback is (RUN_DIR/logs/traceback.txt once the run has a directory, else printed here, above the line)."""
    from reinforge.run_dir import announced_run_dir

    package = Path(__file__).resolve().parent
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [frame for frame in frames if Path(frame.filename).resolve().is_relative_to(package)] or frames
    where = ""
    if ours:
        path = Path(ours[-1].filename).resolve()
        shown = path.relative_to(package.parent) if path.is_relative_to(package.parent) else path
        where = f" at {shown}:{ours[-1].lineno} in {ours[-1].name}"
    text = "".join(traceback.format_exception(exc))
    log = "above"
    if run_dir := announced_run_dir():
        try:
            (run_dir / "logs").mkdir(exist_ok=True)
            with open(run_dir / "logs" / "traceback.txt", "a") as file:
                file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n{text}\n")
            log = f"in {run_dir / 'logs' / 'traceback.txt'}"
        except OSError:
            pass
    if log == "above":
        print(text, end="", file=sys.stderr)
    if type(exc).__name__ == "OutOfMemoryError":  # torch's: the same step would meet it again
        what = "out of accelerator memory; lower training.micro_batch_size or the engine's memory share"
    else:
        what = f"a bug, not the input: {type(exc).__name__}: {first_line(exc)}"
    return f"{what}{where}; not restarted (it would happen again); the traceback is {log}"


if __name__ == "__main__":
    sys.exit(main())
