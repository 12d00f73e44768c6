"""`reinforge report`: plots and summary.md from metrics.jsonl files written by hand (tests/e2e/test_grpo_report.py
runs it on a real GRPO run)."""

import json
import math

import pytest

from reinforge.algorithms.grpo_config import GRPORunConfig
from reinforge.cli import main
from reinforge.config.loader import save_config
from reinforge.logging.report import phase_seconds, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir, rows, config=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if config is not None:
        save_config(config, run_dir / "config.yaml")
    return run_dir


def grpo_rows(num_steps: int, val_every: int) -> list[dict]:
    """A GRPO run's metric names and magnitudes (as in a demo run), with smooth trends and a wiggle."""
    rows = [{"step": 0, "val/accuracy": 0.3, "val/gen_len_mean": 30.0, "val/math/accuracy": 0.3}]
    for step in range(1, num_steps + 1):
        wiggle = 0.05 * math.sin(step)
        row = {
            "step": step,
            "train/reward_mean": 0.3 + 0.4 * step / num_steps + wiggle,
            "train/reward_std": 0.45,
            "train/loss": 0.001 * math.cos(step),
            "train/kl": 0.0005 * step,
            "train/entropy": 0.5 - 0.002 * step,
            "train/token_mult_prob_error": 1.0 + 2e-7 * (1 + math.sin(step)),
            "rollout/gen_len_mean": 30.0 + step / 10,
            "rollout/gen_len_max": 48.0,
            "timing/generate_s": 40.0 + wiggle,
            "timing/reward_s": 0.01,
            "timing/logprobs_s": 15.0,
            "timing/train_s": 25.0,
            "timing/refit_s": 0.3,
            "timing/step_s": 81.0,
            "perf/tokens_per_s": 180.0 + step,
            "perf/peak_rss_gb": 1.5 + min(step, 10) / 100,
        }
        if step % val_every == 0 or step == num_steps:
            row |= {"val/accuracy": 0.3 + 0.5 * step / num_steps, "val/gen_len_mean": 31.0, "timing/val_s": 14.0}
        rows.append(row)
    return rows


def test_a_grpo_run_gets_every_plot_as_a_png_and_a_summary(tmp_path):
    run_dir = write_run(tmp_path / "grpo-run", grpo_rows(120, val_every=20), GRPORunConfig())
    written = write_report(run_dir)
    names = sorted(path.name for path in written)
    assert names == sorted(
        [
            "reward.png",
            "val_accuracy.png",
            "loss.png",
            "kl.png",
            "entropy.png",
            "gen_length.png",
            "token_mult_prob_error.png",
            "tokens_per_s.png",
            "memory.png",
            "step_time.png",
            "summary.md",
        ]
    )
    for path in written:
        assert path.parent == run_dir / "report"
        if path.suffix == ".png":
            data = path.read_bytes()
            assert data[:8] == PNG_SIGNATURE and len(data) > 10_000, path.name
            assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (
                1200,
                675,
            )  # 8x4.5 in at 150 dpi

    summary = (run_dir / "report" / "summary.md").read_text()
    assert summary.startswith(
        "# Run report: grpo-run\n\n120 training steps (last step 120); 2h 43m 24s in timed phases"
    )
    assert '| `model.name_or_path` | "models/demo" |' in summary
    assert "| `rollout.num_generations_per_prompt` | 8 |" in summary
    assert "| `loop.max_steps` | 20 |" in summary
    assert "| `optimizer.lr` | 1e-06 |" in summary
    assert "| `val/accuracy` | 0.3 | 0.8 | 0.8 | 120 |" in summary
    assert "| `perf/tokens_per_s` | 181 | 300 | 300 | 120 |" in summary
    assert "| `perf/peak_rss_gb` | 1.51 | 1.6 | | |" in summary
    assert "![step_time](step_time.png)" in summary


def test_time_per_phase_adds_up_and_the_rest_of_a_step_is_other(tmp_path):
    """Step 1: step 10 s = generate 6 + train 3 + other 1, plus val 2 outside the step; step 2: step 8 s =
    generate 5 + train 2 + other 1. Totals: generate 11, train 5, other 2, val 2 = 20 s: 55%, 25%, 10%, 10%."""
    rows = [
        {"step": 0, "val/accuracy": 0.25},
        {"step": 1, "timing/step_s": 10.0, "timing/generate_s": 6.0, "timing/train_s": 3.0, "timing/val_s": 2.0},
        {"step": 2, "timing/step_s": 8.0, "timing/generate_s": 5.0, "timing/train_s": 2.0},
    ]
    assert phase_seconds(rows) == {
        "generate": [(1, 6.0), (2, 5.0)],
        "train": [(1, 3.0), (2, 2.0)],
        "other": [(1, 1.0), (2, 1.0)],
        "val": [(1, 2.0)],
    }
    write_report(write_run(tmp_path, rows))
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "2 training steps (last step 2); 0m 20s in timed phases" in summary
    for line in [
        "| generate | 11.0 s | 55.0% | 5.50 s |",
        "| train | 5.0 s | 25.0% | 2.50 s |",
        "| other | 2.0 s | 10.0% | 1.00 s |",
        "| val | 2.0 s | 10.0% | 2.00 s |",
        "| **total** | **20.0 s** | 100% | |",
    ]:
        assert line in summary


def test_plots_of_metrics_the_run_did_not_log_are_skipped(tmp_path):
    """An SFT run logs losses, timing and throughput: no reward, KL, entropy or mismatch figures."""
    rows = (
        [{"step": 0, "val/loss": 6.1}]
        + [{"step": s, "train/loss": 6.0 - s, "timing/step_s": 2.0, "perf/tokens_per_s": 2000.0} for s in range(1, 5)]
        + [{"step": 5, "train/loss": None, "val/loss": 1.5, "timing/step_s": 2.0, "perf/tokens_per_s": 2100.0}]
    )
    written = write_report(write_run(tmp_path, rows))
    assert sorted(p.name for p in written) == ["loss.png", "step_time.png", "summary.md", "tokens_per_s.png"]
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "| `val/loss` | 6.1 | 1.5 | 1.5 | 5 |" in summary
    assert "| `train/loss` | 5 | 2 | | |" in summary  # a non-finite value (null) is skipped
    assert "## Config" in summary  # without config.yaml the table is empty, not an error


def test_reinforge_report_prints_what_it_wrote_and_a_missing_run_is_a_one_line_error(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", grpo_rows(5, val_every=5), GRPORunConfig())
    assert main(["report", str(run_dir)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == str(run_dir / "report" / "summary.md")
    assert len(printed) == 11

    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert (
        capsys.readouterr().err == f"reinforge: error: {tmp_path / 'nowhere' / 'metrics.jsonl'} does not exist; "
        "give the run directory of a reinforge run\n"
    )


@pytest.mark.parametrize("content", ["", "\n"])
def test_an_empty_metrics_file_is_a_one_line_error(tmp_path, capsys, content):
    (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["report", str(tmp_path)]) == 2
    assert "the run has not finished a step yet" in capsys.readouterr().err
