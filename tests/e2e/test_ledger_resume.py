"""A GRPO run whose ledgers a crash left torn (metrics.jsonl) and NUL-filled (prompts.jsonl) resumes, with nothing
its checkpoint covered lost and no step twice; on an edited data file the resume is one line (docs/reliability.md,
"Ledgers")."""

from _kill import cli_command, json_rows, run_here

from reinforge.paths import PROJECT_ROOT

ARGS = [
    "checkpoint.save_every=1",
    "checkpoint.resume=auto",
    "rollout.num_prompts_per_step=4",
    "training.global_batch_size=32",
    "training.micro_batch_size=32",
    "generation.max_new_tokens=16",
    "data.max_val_prompts=4",
    "loop.val_every=0",
    "checkpoint.save_final=false",
    "cluster.num_threads=1",
    "cluster.max_restarts=0",
]


def run(run_dir, data, max_steps):
    config = PROJECT_ROOT / "configs" / "grpo_demo.yaml"
    args = [*ARGS, f"loop.max_steps={max_steps}", f"data.train_path={data}", f"logging.run_dir={run_dir}"]
    return run_here(cli_command("grpo", config, *args))  # in this process: no interpreter start-up per run


def test_a_run_resumes_after_torn_ledgers_and_refuses_an_edited_data_file(tmp_path):
    data, run_dir = tmp_path / "train.jsonl", tmp_path / "run"
    data.write_text((PROJECT_ROOT / "data" / "demo" / "train.jsonl").read_text())
    first = run(run_dir, data, 2)
    assert first.returncode == 0, first.stderr[-2000:]
    metrics, prompts = run_dir / "metrics.jsonl", run_dir / "prompts.jsonl"
    covered = {path: path.read_bytes() for path in (metrics, prompts)}  # checkpoint step 2 covers every row
    with metrics.open("ab") as handle:
        handle.write(b'{"step": 3, "train/loss": 0.1')  # killed mid-write
    with prompts.open("ab") as handle:
        handle.write(b"\0" * 4096)  # power loss: the file grew, its block never written

    resumed = run(run_dir, data, 3)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    notices = [line for line in resumed.stdout.splitlines() if "not a JSON row" in line]
    assert len(notices) == 2, resumed.stdout
    for path, before in covered.items():
        assert path.read_bytes().startswith(before)  # nothing the checkpoint covered lost
    assert [row["step"] for row in json_rows(metrics)] == [0, 1, 2, 3]
    assert [o for row in json_rows(prompts) for o in row["ordinals"]] == list(range(12))  # none missing, none twice

    data.write_text(data.read_text() + '{"prompt": "What is 2 + 2?", "answer": "4"}\n')
    refused = run(run_dir, data, 4)
    assert refused.returncode == 2
    error = refused.stderr.strip().splitlines()[-1]
    assert str(data) in error and "checkpoint.on_data_change=restart_order" in error, refused.stderr
    assert [row["step"] for row in json_rows(metrics)] == [0, 1, 2, 3]
