"""`reinforge eval`: a model on a benchmark, pass@k and friends.

Only argparse (and the light benchmark table) is imported at module level, so that `reinforge --help`
stays instant. Flags left out take `evaluate`'s defaults, which are documented there only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reinforge.data.sources import SourceConfig


def add_eval_command(subparsers: argparse._SubParsersAction) -> None:
    """Add `eval` to the `reinforge` command line."""
    from reinforge.evaluation.benchmarks import BENCHMARKS

    parser = subparsers.add_parser(
        "eval",
        help="evaluate a model on a benchmark (pass@1, pass@k, maj@k)",
        description="Sample n answers per benchmark prompt, score them with the benchmark's environment (math "
        "verifier, code sandbox, IFEval checks) and write samples.jsonl and summary.json. See docs/evaluation.md.",
    )
    parser.add_argument(
        "--model",
        required=True,
        help="Hugging Face model directory, reinforge run directory (its final/ is used) or hub id",
    )
    parser.add_argument(
        "--adapter",
        metavar="DIR",
        help="a PEFT LoRA adapter trained on --model (a LoRA run's final/), merged into its weights when they load",
    )
    parser.add_argument(
        "--benchmark",
        required=True,
        metavar="NAME",
        help=f"one of: {', '.join(BENCHMARKS)}; or questions of your own (question, answer, images): a .jsonl, "
        ".json, .parquet or .arrow file, a directory saved by datasets, or a hub dataset name (owner/name)",
    )
    parser.add_argument(
        "--split", help="the split of a hub dataset or a saved DatasetDict given as --benchmark (default: test)"
    )
    parser.add_argument("--subset", help="a hub dataset's configuration (e.g. main for openai/gsm8k)")
    parser.add_argument(
        "--column",
        action="append",
        default=[],
        metavar="FIELD=COLUMN",
        help="the column holding a field of --benchmark's questions, e.g. --column prompt=problem "
        "--column answer=solution (fields: prompt, answer, images, task); repeatable",
    )
    parser.add_argument("--k", type=int, required=True, help="k of pass@k and maj@k")
    parser.add_argument("--n", type=int, help="samples per prompt, n >= k (default: k)")
    parser.add_argument("--limit", type=int, help="evaluate only the first N prompts of the benchmark")
    parser.add_argument(
        "--backend",
        choices=("hf", "vllm"),
        default="hf",
        help="generation engine (default: hf, as every command; vllm decodes long answers and many samples far "
        "faster, once its engine has started)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        help="directory for summary.json and samples.jsonl (default: runs/eval/<benchmark>; "
        "a non-empty one is never overwritten, <dir>-1 is used instead)",
    )
    parser.add_argument("--max-new-tokens", type=int, help="longest answer in tokens (default: 1024)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: greedy when n=1, else 0.6)")
    parser.add_argument(
        "--batch-size",
        type=int,
        help="prompts sent to the engine at a time; the HF engine decodes all their samples at once (default: 32)",
    )
    parser.add_argument("--seed", type=int, help="sampling seed (default: 0)")
    parser.set_defaults(run=run_eval_command)


def run_eval_command(args: argparse.Namespace) -> None:
    from reinforge.evaluation.benchmarks import get_benchmark

    source = source_config(args)
    get_benchmark(args.benchmark, source)  # a misspelt name fails before the heavy imports
    from reinforge.evaluation.evaluate import evaluate
    from reinforge.model_config import ModelConfig

    options = {
        "num_samples": args.n,
        "limit": args.limit,
        "backend": args.backend,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "data": source,
    }
    result = evaluate(
        ModelConfig(name_or_path=args.model, adapter=args.adapter),
        args.benchmark,
        args.k,
        output_dir=args.output
        or Path("runs") / "eval" / Path(args.benchmark).name.removesuffix(Path(args.benchmark).suffix),
        **{name: value for name, value in options.items() if value is not None},
    )
    shown = {
        name: value for name, value in result.summary.items() if "@" in name or name in ("mean_accuracy", "num_prompts")
    }
    print(json.dumps(shown))
    print(f"summary: {result.output_dir / 'summary.json'}   samples: {result.output_dir / 'samples.jsonl'}")


def source_config(args: argparse.Namespace) -> "SourceConfig":
    """--split, --subset and --column as data/sources.py's settings; a malformed --column is a one-line error."""
    from reinforge.data.sources import SourceConfig
    from reinforge.errors import ReinforgeError

    columns = {}
    for given in args.column:
        field, sep, column = given.partition("=")
        if not sep or not field or not column:
            raise ReinforgeError(f"--column {given!r}: expected FIELD=COLUMN, e.g. --column prompt=problem")
        columns[field] = column
    try:
        return SourceConfig(split=args.split or "test", subset=args.subset, columns=columns)
    except ValueError as exc:
        first = exc.errors()[0] if hasattr(exc, "errors") else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ReinforgeError(
            f"--column {where.removeprefix('columns.')}: not a field; choose one of prompt, answer, images, task"
        ) from None
