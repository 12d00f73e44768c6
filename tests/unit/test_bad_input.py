"""Malformed input as a new user types it: each is one line, exit 2, and no run directory (docs/reliability.md,
"Bad input"). `reinforge plan`'s own arguments, and the layouts the ranks would refuse only once started."""

import subprocess
import sys

import pytest
import torch

from reinforge.cli import main
from reinforge.paths import PROJECT_ROOT

PLAN = ["plan", "--model", "Qwen2.5-0.5B", "--gpus", "8", "--gpu-memory", "80", "--seq-len", "4096"]


def reinforge(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "reinforge.cli", *args]
    return subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)


def assert_one_line(result: subprocess.CompletedProcess, expected: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("reinforge: error: ") and expected in lines[0], lines[0]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["--gpus", "0"], "--gpus 0: give the number of training GPUs, 1 or more"),  # was min() of an empty list
        (["--gpu-memory", "-5"], "--gpu-memory -5: give GiB > 0"),  # was a table of "no", exit 0
        (["--gpu-memory", "nan"], "--gpu-memory nan: give GiB > 0"),
        (["--seq-len", "0"], "--seq-len 0: give the longest sequence"),
        (["--gpus-per-node", "0"], "--gpus-per-node 0: give 1 or more"),
        (["--lora", "-4"], "--lora -4: give the adapters' rank"),
        (["--lora-targets", "q_proj"], "--lora-targets needs --lora RANK"),
        (["--lora", "8", "--lora-targets", "qproj"], "'qproj' is not a linear layer the planner knows"),
        (["--generation-tp", "0"], "--generation-tp 0: give 1 or more"),
        (["--generation", "none", "--generation-tp", "2"], "--generation-tp needs an engine"),
        (["--micro-batch-tokens", "-3"], "--micro-batch-tokens -3"),
        (["--runtime-gb", "-1"], "--runtime-gb -1.0: give GiB >= 0"),
    ],
)
def test_plan_refuses_an_argument_out_of_its_range_in_one_line(overrides, expected):
    assert_one_line(reinforge(*PLAN, *overrides), expected)


def test_plan_refuses_a_model_config_it_cannot_read_in_one_line(tmp_path):
    config = tmp_path / "config.json"
    for text, expected in [
        ("{bad", "config.json is not valid JSON"),
        ("[1]", "config.json is not a model config"),
        ('{"model_type": "llama"}', "config.json has no hidden_size"),
        ('{"hidden_size": 0, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 4, '
         '"vocab_size": 9}', "hidden_size=0 must be a positive integer"),
    ]:  # fmt: skip
        config.write_text(text)
        assert_one_line(reinforge("plan", "--model", str(tmp_path), *PLAN[3:]), expected)


def test_a_layout_the_ranks_would_refuse_is_one_line_before_the_run_directory(tmp_path):
    """training.cpu_offload on ranks without a GPU was refused by each rank, after the run directory existed (Ray's
    ActorDiedError traceback); the ranks' placement (cluster.num_gpus_per_worker=0 on a machine without a GPU) says
    they have none before any starts (a worker's own ConfigError is one line too: tests/unit/test_worker_group.py)."""
    run_dir = tmp_path / "run"
    result = reinforge(
        "grpo", "--config", "configs/grpo_demo.yaml", f"logging.run_dir={run_dir}", "training.backend=fsdp2",
        "training.num_workers=2", "training.cpu_offload=true",
    )  # fmt: skip
    assert_one_line(
        result,
        "training.cpu_offload=true offloads GPU memory to the CPU, and the ranks have no GPU "
        "(cluster.num_gpus_per_worker=0 or training.device=cpu); set it to false",
    )
    assert not run_dir.exists()


PP_VISION = "pipeline parallelism of a vision-language model is not"
CPU_OFFLOAD = "training.cpu_offload=true offloads GPU memory"
FSDP2_HERE = ["training.backend=fsdp2", "training.num_workers=2", "cluster.max_restarts=0"]  # in this process


def refused(capsys, config: str, *args: str) -> str:
    """`reinforge COMMAND --config configs/CONFIG.yaml` on two FSDP2 ranks with `args`: exit status 2 and one line,
    returned."""
    assert main([config.split("_")[0], "--config", f"configs/{config}.yaml", *FSDP2_HERE, *args]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1, errors
    return errors[0]


@pytest.mark.parametrize(
    "config, overrides, expected",
    [
        # a vision-language model in pipeline stages: check_layout from the model's config, before the run directory
        ("grpo_vlm_demo", ["training.parallel.pp=2"], PP_VISION),
        ("sft_vlm_demo", ["training.parallel.pp=2"], PP_VISION),
        ("sft_demo", ["training.cpu_offload=true"], CPU_OFFLOAD),
        # GPUs asked of a Ray started on a machine without one: a placement timeout after the run directory
        pytest.param("grpo_demo", ["cluster.num_gpus_per_worker=1"], "Ray starts on this machine", marks=pytest.mark.
                     skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
        pytest.param("dpo_demo", ["training.parallel=auto", "cluster.num_gpus_per_worker=1"], "which has no GPU",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    ],
)  # fmt: skip
def test_layouts_and_devices_the_ranks_refuse_are_one_line_before_the_run_directory(
    tmp_path, capsys, config, overrides, expected
):
    run_dir = tmp_path / "run"
    assert expected in refused(capsys, config, f"logging.run_dir={run_dir}", *overrides)
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "config, overrides, expected",
    [
        ("grpo_vlm_demo", ["training.parallel.pp=2"], PP_VISION),
        ("grpo_demo", ["training.cpu_offload=true"], CPU_OFFLOAD),
    ],
)
def test_validate_refuses_what_the_run_refuses(capsys, config, overrides, expected):
    assert expected in refused(capsys, config, *overrides, "--validate")
