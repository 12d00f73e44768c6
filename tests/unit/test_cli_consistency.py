"""The command line read as one tool: help on every subcommand and flag, one name per thing (`--output`,
`--config`), the same defaults everywhere (engine, dtype), `--version`; `reinforge plan`'s table and engine."""

import argparse
import json
import shutil
import subprocess
import sys

import pytest

from reinforge import __version__
from reinforge.cli import build_parser, main, parse_args
from reinforge.model_config import ModelConfig
from reinforge.paths import PROJECT_ROOT
from reinforge.serving.cli import _dtype
from reinforge.training.parallel.model_shape import KNOWN_MODELS
from reinforge.training.parallel.plan_cli import format_plan
from reinforge.training.parallel.planner import Workload, plan


def subcommands(parser: argparse.ArgumentParser, path: str = "reinforge"):
    """(path, parser, its one-line help in its parent's list) for every subcommand, nested ones included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{path} {name}", sub, summaries.get(name)
                yield from subcommands(sub, f"{path} {name}")


ALL = list(subcommands(build_parser()))


def test_every_subcommand_has_a_summary_and_a_description_and_every_flag_a_help():
    # 17 commands (grpo ... convert, serve-tinker), 3 nested ones (env serve, env score, curriculum prefilter)
    assert len(ALL) == 20
    missing = []
    for path, parser, summary in ALL:
        if not summary:
            missing.append(f"{path}: no help in `reinforge --help`'s list")
        if not parser.description:
            missing.append(f"{path}: no description")
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}: no help")
        parser.format_help()  # argparse expands each help's %-formats: a stray `%` is a traceback at --help
    assert not missing, missing


def test_a_flag_for_the_same_thing_has_one_name_and_one_default():
    """The file or directory a command writes is --output; a config file --config; an engine defaults to hf and
    a dtype to the model's own everywhere."""
    seen = {}
    for path, parser, _ in ALL:
        for action in parser._actions:
            for option in action.option_strings:
                seen.setdefault(option, []).append((path, action))
    assert all(action.option_strings[0] == "--output" for _, action in seen["--out"])  # only as the old alias
    assert {"--cfg", "--config-file", "--output-dir", "--out-dir"}.isdisjoint(seen)
    assert {action.default for _, action in seen["--backend"]} == {"hf"}
    assert {action.default for _, action in seen["--dtype"]} == {"auto"}
    assert len(seen["--config"]) >= 7 and len(seen["--output"]) >= 4


def test_version():
    result = subprocess.run(
        [sys.executable, "-m", "reinforge.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == f"reinforge {__version__}"


def test_the_old_out_flag_still_works_and_says_its_new_name(capsys):
    assert parse_args(["convert", "ckpt", "--output", "d"]).output == "d"
    assert capsys.readouterr().err == ""
    args = parse_args(["curriculum", "prefilter", "--config", "c.yaml", "--out", "o.jsonl", "a=1"])
    assert (args.output, args.overrides) == ("o.jsonl", ["a=1"])
    assert capsys.readouterr().err.strip() == "reinforge: warning: --out is deprecated; use --output"
    with pytest.raises(SystemExit):
        parse_args(["convert", "ckpt"])  # one of the two is required
    assert "--output" in capsys.readouterr().err


def test_serve_dtype_auto_is_the_dtype_the_model_was_saved_in(tmp_path):
    shutil.copy(PROJECT_ROOT / "models" / "demo" / "config.json", tmp_path / "config.json")
    assert _dtype("auto", ModelConfig(name_or_path=str(tmp_path))) == "float32"
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert _dtype("auto", ModelConfig(name_or_path=str(tmp_path))) == "bfloat16"
    assert _dtype("float16", ModelConfig(name_or_path=str(tmp_path))) == "float16"


def test_serve_rm_refuses_a_device_it_cannot_name_and_a_remote_host_without_allow_remote(capsys):
    assert main(["serve-rm", "models/demo", "--device", "gpu"]) == 2
    assert main(["serve-rm", "models/demo", "--host", "0.0.0.0"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors[0] == "reinforge: error: --device gpu: choose auto, cpu, cuda or cuda:N"
    assert errors[1].startswith("reinforge: error: --host 0.0.0.0 is not a loopback address")


def test_the_old_reward_model_server_module_names_the_subcommand():
    result = subprocess.run(
        [sys.executable, "-m", "reinforge.envs.reward_model_server", "x"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "reinforge serve-rm MODEL_DIR" in result.stderr


def test_the_plan_table_columns_are_as_wide_as_their_cells_and_the_engine_fits_the_machine():
    """A 72B row's totals (three digits each side) ran into the runtime column; one GPU showed an engine @tp8."""
    text = format_plan("Qwen2.5-72B", plan(KNOWN_MODELS["Qwen2.5-72B"], 64, 80, Workload(8192, kl=True)))
    table = [line for line in text.splitlines()[1:] if line[:1] in "l0123456789"]
    header, rows = table[0], table[1:]
    assert len(rows) > 10
    for row in rows:  # every number ends where its header ends, two spaces at least between columns
        for column in ("params", "runtime", "total"):
            end = header.index(column) + len(column)
            assert row[end - 1] != " " and row[end : end + 2] == "  ", (column, row)
    one_gpu = plan(KNOWN_MODELS["Qwen2.5-7B"], 1, 80, Workload(4096))
    assert {e.engine_tp for e in one_gpu.estimates} == {1}
    assert "@tp1" in format_plan("Qwen2.5-7B", one_gpu) and "@tp8" not in format_plan("Qwen2.5-7B", one_gpu)
    two_gpus = plan(KNOWN_MODELS["Qwen2.5-72B"], 2, 80, Workload(4096))
    assert max(e.engine_tp for e in two_gpus.estimates) == 2
    argv = ["plan", "--model", "Qwen2.5-7B", "--gpus", "1", "--gpu-memory", "80", "--seq-len", "64"]
    assert main([*argv, "--generation-tp", "2"]) == 2
