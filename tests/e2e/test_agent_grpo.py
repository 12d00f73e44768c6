"""GRPO with agent rollouts (`rollout.driver=agent`): your own Python agents call the policy through the run's
real endpoint with the real `openai` client; the trajectories come from what the endpoint recorded.

Agents that fail, hang, rewrite their history, make no call or flag their episode are masked and
counted, and the run goes on; an agent that can never succeed, or a Gym agent server that is down,
stops the run with one line, leaving a run directory that holds only what finished.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reinforge import loops
from reinforge.algorithms.grpo_config import load_config
from reinforge.network import free_port

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SMALL = [
    "rollout.num_prompts_per_step=8",
    "rollout.num_generations_per_prompt=4",
    "training.global_batch_size=32",
    "training.micro_batch_size=32",
    "data.max_val_prompts=16",
    "checkpoint.save_final=false",
]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_agent_demo_learns_to_call_its_calculator(tmp_path):
    """configs/grpo_agent_demo.yaml, shortened: reinforge's simple agent drives every episode through the
    endpoint, the calculator is the tool_use environment served the NeMo Gym way; greedy, the tool demo
    model never calls its tool at first."""
    config = load_config(
        ROOT / "configs" / "grpo_agent_demo.yaml",
        [
            "loop.max_steps=6",
            "loop.val_every=0",
            "data.max_val_prompts=32",
            "checkpoint.save_final=false",
            f"logging.run_dir={tmp_path / 'run'}",
        ],
    )
    result = loops.train(config)
    first, *steps = rows(result.run_dir)
    last = steps[-1]
    assert result.last_val_accuracy >= result.first_val_accuracy + 0.15, (
        result.first_val_accuracy,
        result.last_val_accuracy,
    )
    assert first["val/tool_use/tool_result_correct_mean"] == 0 and last["val/tool_use/tool_result_correct_mean"] >= 0.5
    early = sum(r["train/tool_use/tool_result_correct_mean"] for r in steps[:2]) / 2
    late = sum(r["train/tool_use/tool_result_correct_mean"] for r in steps[-2:]) / 2
    assert late > early, (early, late)
    for row in steps:
        assert row["rollout/agent_ok_fraction"] == 1 and row["rollout/agent_contiguous_fraction"] == 1
        assert row["train/token_mult_prob_error"] <= 1.05 and row["rollout/agent_model_calls_mean"] > 1
        assert not [name for name in row if name.startswith(("env/", "val/env/"))], row  # the agents scored, no env


def test_episodes_an_agent_cannot_vouch_for_are_masked_and_counted_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    config = load_config(
        ROOT / "configs" / "grpo_demo.yaml",
        [
            *SMALL,
            "loop.max_steps=2",
            "loop.val_every=0",
            "rollout.driver=agent",
            "agent.python.unruly=_agents:unruly",
            "agent.timeout_s=3",
            f"logging.run_dir={tmp_path / 'run'}",
        ],
    )
    result = loops.train(config)
    steps = rows(result.run_dir)[1:]
    assert len(steps) == 2
    for row in steps:
        fractions = {
            kind: row[f"rollout/agent_{kind}_fraction"] for kind in ("ok", "failed", "noncontiguous", "no_calls")
        }
        assert all(value > 0 for value in fractions.values()), fractions
        # a hung agent is an infrastructure failure: run again as a new episode (which may then be of any kind)
        assert row["rollout/infra_timeout"] > 0
        assert row["rollout/infra_retried"] == row["rollout/infra_timeout"] - row["rollout/infra_masked"]
        assert row["rollout/agent_mask_sample_fraction"] > 0
        masked = 1 - fractions["ok"] + row["rollout/agent_mask_sample_fraction"]
        assert row["rollout/agent_masked_fraction"] == pytest.approx(masked)
        assert row["rollout/agent_contiguous_fraction"] < 1  # the history rewriters
        assert row["train/token_mult_prob_error"] < 1.001  # what is trained on is what the engine sampled
        assert row["rollout/agent_episode_s_max"] < 10  # the hung agents were abandoned at agent.timeout_s=3
    val = rows(result.run_dir)[0]
    assert val["val/agent_episodes"] == 16 and "val/accuracy" in val
    errors = [json.loads(line) for line in (result.run_dir / "agent_errors.jsonl").read_text().splitlines()]
    assert {"failed", "timeout", "noncontiguous", "no_calls"} <= {e["status"] for e in errors}
    assert any("ValueError: this agent fails on purpose" in e["error"] for e in errors)


def run_cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "reinforge.cli",
        "grpo",
        "--config",
        str(ROOT / "configs" / "grpo_demo.yaml"),
        *SMALL,
        "loop.max_steps=2",
        "loop.val_every=0",
        "data.val_path=null",
        "rollout.driver=agent",
        f"logging.run_dir={tmp_path / 'run'}",
        "checkpoint.save_every=1",
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def assert_one_line_and_an_untouched_run_dir(
    process: subprocess.CompletedProcess, run_dir: Path, *needles: str
) -> None:
    assert process.returncode == 2, process.stderr
    errors = [line for line in process.stderr.splitlines() if line.startswith("reinforge: error:")]
    assert len(errors) == 1 and "Traceback" not in process.stderr, process.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert (
        (run_dir / "config.yaml").is_file()
        and not (run_dir / "checkpoints").exists()
        and not (run_dir / "final").exists()
    )
    assert not (run_dir / "metrics.jsonl").exists() or not rows(run_dir)  # no step half logged


def test_an_agent_that_can_never_succeed_stops_the_run_with_the_endpoints_one_line(tmp_path):
    process = run_cli(tmp_path, "agent.python.cold=_agents:cold")
    assert_one_line_and_an_untouched_run_dir(
        process,
        tmp_path / "run",
        "none of the rollout's 32 agent episodes",
        "temperature=0.5 differs from the run's temperature=1.0",
    )


def test_a_gym_agent_server_that_cannot_be_reached_at_start_up_is_one_line_before_any_run_directory(tmp_path):
    """Nothing listens at the agent's URL when the run starts: a configuration error (loops/probes.py), one line and
    exit 2 before the run directory exists, never restarted as infrastructure (cluster.max_restarts=1 left unused). An
    agent server that goes down during the run is retried, then infrastructure (tests/unit/test_outside_failures.py)."""
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    process = run_cli(
        tmp_path, f"agent.gym.weather.url={url}", "agent.max_retries=2", "agent.backoff_s=0.1", "cluster.max_restarts=1"
    )
    assert process.returncode == 2 and "Traceback" not in process.stderr, process.stderr
    [line] = process.stderr.strip().splitlines()
    assert line == (
        f"reinforge: error: agent.gym.weather.url: {url}/openapi.json cannot be reached at start-up ([Errno 111] "
        "Connection refused); start the server, or correct the URL"
    ), line
    assert not (tmp_path / "run").exists()
