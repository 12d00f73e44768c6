"""Start-up has a watchdog of its own (`deadlines.startup_s`, loops/rl_loop.py): a phase of start-up that never
finishes (here the recipe's learner, as a critic whose load never returns would) ends the run at the deadline with one
line naming the phase, and RUN_DIR/hang_report.txt with the main thread's stack where it blocked. A real GRPO start-up
on the demo model (torch backend, in this process) up to the learner."""

import time

import pytest

from reinforge.algorithms.grpo_config import load_config
from reinforge.hang import REPORT_NAME, HangError
from reinforge.loops.rl_loop import run
from reinforge.paths import PROJECT_ROOT

SLACK_S = 5.0  # the watchdog's look (a quarter of the deadline) and the stack dump, on a busy machine


def test_a_start_up_phase_that_never_finishes_ends_at_the_startup_deadline(tmp_path):
    overrides = ["loop.max_steps=1", "checkpoint.save_final=false", "cluster.num_threads=1", "deadlines.startup_s=2",
                 f"logging.run_dir={tmp_path / 'run'}"]  # fmt: skip
    config = load_config(str(PROJECT_ROOT / "configs" / "grpo_demo.yaml"), overrides)
    blocked_at = []

    def learner_that_never_loads(config, parts):
        blocked_at.append(time.monotonic())
        time.sleep(600)  # a critic whose weights never arrive

    with pytest.raises(HangError) as raised:
        run(config, learner_that_never_loads)
    waited = time.monotonic() - blocked_at[0]
    report = tmp_path / "run" / REPORT_NAME
    assert str(raised.value) == (
        "watchdog: waited 2 s for the recipe's learner (its critic's loading) to make progress "
        f"(deadlines.startup_s=2); stacks in {report}"
    )
    assert 2.0 <= waited < 2.0 + SLACK_S
    assert "in learner_that_never_loads" in report.read_text()  # the main thread's stack, where it blocked
