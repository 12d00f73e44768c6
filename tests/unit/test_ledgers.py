"""The ledgers (metrics.jsonl, prompts.jsonl) across crashes and restarts, and the training data pinned in each
checkpoint (loops/checkpointing.py, logging/metrics.py, data/pin.py)."""

import json
import os

import pytest
import torch

from reinforge.algorithms.grpo_config import GRPORunConfig
from reinforge.data import pin
from reinforge.data.curriculum import ProgressiveSampler
from reinforge.data.prompts import PromptSampler
from reinforge.errors import DataError
from reinforge.logging.metrics import JsonlWriter, read_ledger
from reinforge.loops.checkpointing import data_changed, load_resume_state, open_run_dir, truncate_metrics

METRICS_ROWS = [{"step": step, "train/loss": 0.5 / (step + 1), "val/accuracy": None} for step in range(5)]
PROMPTS_ROWS = [{"step": step, "ordinals": [2 * step, 2 * step + 1], "dropped": []} for step in range(1, 5)]
TAILS = {
    "torn": b'{"step": 5, "train/loss": 0.0',  # the process died mid-write
    "NUL-filled": b"\0" * 4096,  # the file grew, its block never written (power loss)
    "torn, then NUL-filled": b'{"step": 5, "tr' + b"\0" * 512,
    "torn mid-line, NUL bytes inside it": b'{"step": 5, "ordi\0\0\0\0',
}


def write(path, rows, tail=b""):
    path.write_bytes(b"".join(json.dumps(row).encode() + b"\n" for row in rows) + tail)


@pytest.mark.parametrize("tail", TAILS, ids=list(TAILS))
@pytest.mark.parametrize("name, rows", [("metrics.jsonl", METRICS_ROWS), ("prompts.jsonl", PROMPTS_ROWS)])
def test_a_torn_or_nul_filled_tail_is_cut_at_resume_and_the_checkpoints_rows_are_kept(
    tmp_path, capsys, name, rows, tail
):
    """The checkpoint is at step 3: the rows up to it stay exactly, step 4's (redone after the resume) moves to the
    attempt file, the unreadable tail goes with one line; the next row appends cleanly."""
    path = tmp_path / name
    write(path, rows, TAILS[tail])
    truncate_metrics(path, 3, attempt=1)
    kept = [row for row in rows if row["step"] <= 3]
    assert read_ledger(path) == (kept, 0)
    assert read_ledger(tmp_path / f"{name}.attempt-1") == ([rows[-1]], 0)
    (line,) = capsys.readouterr().out.splitlines()
    assert str(path) in line and "at resume" in line and "up to step 3" in line and "whole" in line
    JsonlWriter(path).write(4, {"train/loss": 0.25})
    assert [row["step"] for row in read_ledger(path)[0]] == [row["step"] for row in kept] + [4]


def test_a_last_row_without_its_newline_is_kept_and_the_next_row_does_not_join_it(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    write(path, METRICS_ROWS[:3])
    path.write_bytes(path.read_bytes()[:-1])  # the crash came between the row and its newline
    truncate_metrics(path, 2, attempt=1)
    JsonlWriter(path).write(3, {"train/loss": 0.25})
    assert [row["step"] for row in read_ledger(path)[0]] == [0, 1, 2, 3]
    assert capsys.readouterr().out == ""  # nothing was lost, nothing to say
    assert not (tmp_path / "metrics.jsonl.attempt-1").exists()


def run_config(run_dir, **checkpoint):
    return GRPORunConfig(logging={"run_dir": str(run_dir)}, checkpoint={"resume": "auto", **checkpoint})


def test_a_restart_with_no_checkpoint_starts_over_and_keeps_every_earlier_attempts_rows(tmp_path):
    """checkpoint.save_every=0: each restart of the supervisor (checkpoint.resume=auto) starts over; the ledgers of
    the attempts before are kept beside, numbered, and the ledgers proper hold the final attempt's rows alone."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    notices = []
    for attempt in (1, 2):
        write(run_dir / "metrics.jsonl", METRICS_ROWS[: attempt + 1])
        write(run_dir / "prompts.jsonl", PROMPTS_ROWS[:attempt], b"\0" * 16)
        assert open_run_dir(run_config(run_dir), warn=notices.append) == (run_dir, None)
        assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "prompts.jsonl").exists()
    for attempt in (1, 2):
        assert read_ledger(run_dir / f"metrics.jsonl.attempt-{attempt}")[0] == METRICS_ROWS[: attempt + 1]
        assert read_ledger(run_dir / f"prompts.jsonl.attempt-{attempt}") == (PROMPTS_ROWS[:attempt], 16)
    assert len(notices) == 4 and all("starting over" in notice for notice in notices)


def test_the_pin_tells_an_edit_from_a_copy_or_a_touch(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n' * 50)
    pinned = pin.pin(str(data))
    assert pin.changed(pinned, str(data)) is None
    os.utime(data, ns=(1, 1))  # touched, or copied elsewhere with its content: the same data
    assert pin.changed(pinned, str(data)) is None
    data.write_text(data.read_text().replace("1+1", "2+2", 1))  # edited in place, the same size
    assert "same size" in pin.changed(pinned, str(data)) or "other content" in pin.changed(pinned, str(data))
    data.write_text(data.read_text() + '{"prompt": "3+3?", "answer": "6"}\n')
    assert "bytes" in pin.changed(pinned, str(data))
    assert pin.changed(pin.pin("openai/gsm8k"), "openai/gsm8k") is None  # a hub name: by name only


def test_a_large_file_is_pinned_by_sampled_blocks(tmp_path, monkeypatch):
    """Above FULL_DIGEST_BYTES the digest reads SAMPLED_BLOCKS blocks (the first and the last among them)."""
    monkeypatch.setattr(pin, "FULL_DIGEST_BYTES", 1000)
    monkeypatch.setattr(pin, "BLOCK_BYTES", 10)
    monkeypatch.setattr(pin, "SAMPLED_BLOCKS", 4)
    data = tmp_path / "train.jsonl"
    data.write_bytes(bytes(range(256)) * 20)
    pinned = pin.pin(str(data))
    assert "sampled" in pinned["digest_kind"]
    data.write_bytes(b"x" + data.read_bytes()[1:])  # the first block is always read
    assert pin.changed(pinned, str(data)) is not None


def test_resuming_on_an_edited_data_file_is_one_line_naming_it_and_the_fix(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    config = run_config(tmp_path / "run")
    config.data.train_path = str(data)
    pinned = {"train": pin.pin(str(data))}
    assert data_changed(pinned, config, tmp_path / "step_00000003") is False
    data.write_text('{"prompt": "1+1?", "answer": "3"}\n{"prompt": "2+2?", "answer": "4"}\n')
    with pytest.raises(DataError) as error:
        data_changed(pinned, config, tmp_path / "step_00000003")
    message = str(error.value)
    assert "\n" not in message and str(data) in message and "checkpoint.on_data_change=restart_order" in message
    assert data_changed({}, config, tmp_path / "step_00000003") is False  # a checkpoint from before pins
    config.checkpoint.on_data_change = "restart_order"
    notices = []
    assert data_changed(pinned, config, tmp_path / "step_00000003", notices.append) is True
    assert len(notices) == 1 and "restart_order" in notices[0]


@pytest.mark.parametrize("kind", ["sampler", "curriculum"])
def test_restart_order_starts_the_new_data_from_its_beginning_with_the_ordinals_going_on(tmp_path, kind):
    """A checkpoint taken after 3 batches of 4 from 10 prompts, resumed on 6 other prompts: the new data's first
    epoch from its first draw, the ordinals from 12 on, and a later resume of that continues exactly."""
    old, new = list(range(10)), list(range(100, 106))

    def make(prompts):
        if kind == "sampler":
            return PromptSampler(prompts, 4, seed=1)
        rates = [(i % 3) / 2 for i in range(len(prompts))]
        return ProgressiveSampler(prompts, rates, 4, 1, 10, 0.9, 0.1, 0.3)

    before = make(old)
    for _ in range(3):
        before.next_batch()
    checkpoint = tmp_path / "step_00000003"
    checkpoint.mkdir()
    data = tmp_path / "train.jsonl"
    data.write_text("old\n")
    torch.save({"step": 3, "sampler": before.state_dict(), "pending_rollouts": [], "rng": {},
                "data": {"train": pin.pin(str(data))}}, checkpoint / "driver.pt")  # fmt: skip
    data.write_text("new, longer\n")
    config = run_config(tmp_path / "run", on_data_change="restart_order")
    config.data.train_path = str(data)
    resumed = make(new)
    resumed.load_state_dict(load_resume_state(checkpoint, config).sampler)
    fresh = make(new)
    fresh.load_state_dict(make(new).state_dict() if kind == "sampler" else {"step": 3, "epoch": 0})
    assert resumed.drawn == 12
    assert resumed.next_batch() == fresh.next_batch()  # the new data's order from its start
    again = make(new)
    again.load_state_dict(resumed.state_dict())
    assert again.drawn == 16 and again.next_batch() == resumed.next_batch()


def test_rows_of_the_checkpoints_steps_that_are_missing_are_named(tmp_path, capsys):
    """A ledger that lost rows its checkpoint covers (a copy, a disk that lied) is not silently accepted."""
    path = tmp_path / "prompts.jsonl"
    write(path, PROMPTS_ROWS[:1], b"\0" * 8)
    truncate_metrics(path, 3, attempt=1)
    (line,) = capsys.readouterr().out.splitlines()
    assert "cut 8 bytes" in line and "steps 2-3" in line and "missing" in line
    truncate_metrics(tmp_path / "absent.jsonl", 3, attempt=1)  # a ledger the run does not keep: nothing to say
    assert capsys.readouterr().out == ""
