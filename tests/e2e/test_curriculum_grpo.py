"""GRPO with Llama-Nemotron's curriculum (configs/grpo_curriculum_demo.yaml: pre-filter, progressive sampler) on
the demo model with the real engine, trainer and verifier: the curriculum's metrics are logged, the pass rates
are stored in the run directory, and a run stopped after step 2 and resumed repeats the uninterrupted metrics
without sampling the pass rates again; `reinforge curriculum prefilter` writes records with a pass_rate field.

The first test needs the RL loop (loops.train) to build its sampler with
reinforge.loops.curriculum_prefilter.build_prompt_sampler (see that module)."""

import json

from reinforge import loops
from reinforge.algorithms.grpo_config import load_config
from reinforge.cli import main
from reinforge.data.jsonl import read_jsonl
from reinforge.data.prompts import Prompt
from reinforge.loops.curriculum_prefilter import build_prompt_sampler
from reinforge.paths import PROJECT_ROOT

CONFIG = PROJECT_ROOT / "configs" / "grpo_curriculum_demo.yaml"
NUM_PROMPTS = 40
ARGS = [
    "rollout.num_prompts_per_step=4",
    "training.global_batch_size=32",
    "training.micro_batch_size=32",
    "generation.max_new_tokens=40",
    "generation.num_probe_prompts=2",
    "data.val_path=null",
    "cluster.num_threads=1",
    "checkpoint.save_final=false",
    "checkpoint.save_every=2",
    "checkpoint.resume=auto",
    "curriculum.num_steps=4",
]  # the schedule must not follow loop.max_steps, which the resumed run raises


def run(train_path, run_dir, max_steps):
    config = load_config(
        CONFIG, [*ARGS, f"data.train_path={train_path}", f"loop.max_steps={max_steps}", f"logging.run_dir={run_dir}"]
    )
    return loops.train(config).run_dir


def rows(run_dir):
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in metrics]


def test_a_curriculum_run_logs_its_schedule_and_resumes_to_the_same_metrics_without_resampling(tmp_path):
    train_path = tmp_path / "train.jsonl"
    train_path.write_text(
        "".join(json.dumps(r) + "\n" for r in read_jsonl(PROJECT_ROOT / "data" / "demo" / "train.jsonl")[:NUM_PROMPTS])
    )
    reference = run(train_path, tmp_path / "uninterrupted", max_steps=4)

    pass_rates = [
        json.loads(line)["pass_rate"]
        for line in (reference / "curriculum" / "pass_rates.jsonl").read_text().splitlines()
    ]
    assert len(pass_rates) == NUM_PROMPTS
    expected = rows(reference)
    assert [row["step"] for row in expected] == [1, 2, 3, 4]
    assert [row["curriculum/target_pass_rate"] for row in expected] == [0.75, 0.5, 0.25, 0.0]
    for row in expected:
        assert row["curriculum/num_prompts_kept"] == sum(rate < 0.75 for rate in pass_rates)
        assert 0 <= row["curriculum/batch_pass_rate_mean"] < 0.75
    assert (
        expected[0]["curriculum/batch_pass_rate_mean"] > expected[-1]["curriculum/batch_pass_rate_mean"]
    )  # easy to hard

    split = run(train_path, tmp_path / "stopped", max_steps=2)
    stored = split / "curriculum" / "pass_rates.jsonl"
    written = stored.stat().st_mtime_ns
    assert run(train_path, split, max_steps=4) == split  # resumed from its step-2 checkpoint
    assert stored.stat().st_mtime_ns == written  # read back, not sampled again
    assert rows(split) == expected


def test_offline_prefilter_writes_records_whose_pass_rates_a_progressive_run_uses_as_they_are(tmp_path, capsys):
    records = read_jsonl(PROJECT_ROOT / "data" / "demo" / "train.jsonl")[:8]
    source, out = tmp_path / "train.jsonl", tmp_path / "rated.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    # cli.main in this process: no interpreter start-up (the real command line's entry is tests/e2e/test_cli.py's)
    status = main(
        [
            "curriculum",
            "prefilter",
            "--config",
            str(CONFIG),
            "--output",
            str(out),
            "--keep-all",
            f"data.train_path={source}",
            "cluster.num_threads=1",
        ]
    )
    assert status == 0, capsys.readouterr().err[-2000:]
    rated = read_jsonl(out)
    assert [{k: v for k, v in r.items() if k != "pass_rate"} for r in rated] == records
    assert all(r["pass_rate"] * 8 == round(r["pass_rate"] * 8) for r in rated)  # multiples of 1/8

    config = load_config(CONFIG, [*ARGS, f"data.train_path={out}"])
    prompts = [Prompt(record=r, messages=[], token_ids=[]) for r in rated]
    sampler, metrics = build_prompt_sampler(
        config, prompts, None, None, {}, tmp_path / "run"
    )  # no engine: nothing sampled
    assert metrics["curriculum/num_prompts_kept"] == sum(r["pass_rate"] < 0.75 for r in rated) == len(sampler.prompts)
