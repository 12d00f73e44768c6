"""Infrastructure failures in the advantages: a sample masked for one is in no group statistic, a group left
with too few valid samples is dropped, and a step whose infrastructure is down stops the run (rollout/infra.py,
algorithms/advantages.py)."""

import pytest
import torch

from reinforge.algorithms.advantages import (
    batch_whiten,
    group_advantages,
    informative_groups,
    leave_one_out_baseline,
    mean_baseline,
)
from reinforge.algorithms.grpo_config import GRPOConfig
from reinforge.algorithms.grpo_losses import step_advantages
from reinforge.algorithms.step_metrics import rollout_metrics
from reinforge.data.batch import Trajectory, collate
from reinforge.rollout.infra import InfraFailureError, InfraLimits, settle

VALID = torch.tensor([[True, True, True, False]])


def test_a_masked_sample_is_left_out_of_the_group_mean_and_std():
    """Rewards [1, 0, 0 | 5 masked]: the valid mean is 1/3, deviations [2/3, -1/3, -1/3], the unbiased
    variance (4/9 + 1/9 + 1/9) / 2 = 1/3, so A = deviation / sqrt(1/3) = [1.1547, -0.5774, -0.5774] and
    the masked sample's A is 0; the 5 does not move anything."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 5.0]])
    advantages = group_advantages(rewards, mean_baseline, normalize_std=True, valid_PG=VALID)
    expected = torch.tensor([[2 / 3, -1 / 3, -1 / 3, 0.0]]) / (1 / 3) ** 0.5
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)
    without = group_advantages(torch.tensor([[1.0, 0.0, 0.0]]), mean_baseline, normalize_std=True)
    torch.testing.assert_close(advantages[:, :3], without)


def test_leave_one_out_counts_only_the_other_valid_samples():
    """Rewards [1, 0, 1 | 9 masked], n = 3 valid: baselines (2 - r_i) / 2 = [0.5, 1, 0.5], A = [0.5, -1, 0.5, 0]."""
    rewards = torch.tensor([[1.0, 0.0, 1.0, 9.0]])
    torch.testing.assert_close(leave_one_out_baseline(rewards, VALID)[:, :3], torch.tensor([[0.5, 1.0, 0.5]]))
    advantages = group_advantages(rewards, leave_one_out_baseline, normalize_std=False, valid_PG=VALID)
    torch.testing.assert_close(advantages, torch.tensor([[0.5, -1.0, 0.5, 0.0]]))


def test_a_group_with_one_valid_sample_has_no_advantage():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    valid = torch.tensor([[True, False, False, False]])
    assert group_advantages(rewards, mean_baseline, normalize_std=True, valid_PG=valid).abs().sum() == 0


def test_a_masked_zero_does_not_make_a_group_informative():
    rewards = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    valid = torch.tensor([[True, True, False], [True, True, False]])
    assert informative_groups(rewards).tolist() == [True, True]
    assert informative_groups(rewards, valid).tolist() == [False, True]


def test_batch_whitening_gives_a_masked_sample_no_weight():
    """[1, -1 | 7 masked]: mean 0, population std 1 over the two valid ones, so [1, -1] stay as they are."""
    whitened = batch_whiten(torch.tensor([[1.0, -1.0, 7.0]]), valid_PG=torch.tensor([[True, True, False]]))
    torch.testing.assert_close(whitened[:, :2], torch.tensor([[1.0, -1.0]]), atol=1e-5, rtol=0)


def trajectory(reward: float, group: int, infra: str | None = None) -> Trajectory:
    return Trajectory(
        [1, 2], [3, 4], [0.0, 0.0], False, reward, group, "math", infra_failure=infra, infra_error=infra or ""
    )


LIMITS = InfraLimits(max_retries=2, min_valid_per_group=2, max_failure_fraction=0.5)


def test_failed_episodes_are_retried_then_masked_and_thin_groups_dropped():
    """Three groups of 3. Group 0: one env_server failure that succeeds on its first retry. Group 1: one sandbox
    failure that never recovers: masked, 2 valid left, kept. Group 2: two timeouts that never recover: 1 valid,
    fewer than 2, so the group is dropped. Attempts: 4 failures first, then 3, then 3: env_server 1, sandbox 3,
    timeout 6; retried 4 + 3 = 7; masked 3 of 9 (1/3 <= 0.5)."""
    trajectories = [
        trajectory(1.0, 0), trajectory(0.0, 0, "env_server"), trajectory(0.0, 0),
        trajectory(1.0, 1), trajectory(0.0, 1), trajectory(0.0, 1, "sandbox"),
        trajectory(1.0, 2), trajectory(0.0, 2, "timeout"), trajectory(0.0, 2, "timeout"),
    ]  # fmt: skip
    calls = []

    def rerun(indices, retry):
        calls.append((list(indices), retry))
        fresh = {1: trajectory(1.0, 99), 5: trajectory(0.0, 99, "sandbox")}
        return [fresh.get(i, trajectory(0.0, 99, "timeout")) for i in indices]

    settled, metrics = settle(trajectories, 3, rerun, LIMITS)
    assert calls == [([1, 5, 7, 8], 0), ([5, 7, 8], 1)]
    assert [t.group for t in settled] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # a fresh episode keeps its group
    assert [t.excluded for t in settled] == [False] * 3 + [False, False, True] + [True] * 3
    assert [t.masked for t in settled] == [t.excluded for t in settled]
    assert settled[1].reward == 1.0 and settled[1].infra_failure is None
    assert metrics == {
        "rollout/infra_env_server": 1.0,
        "rollout/infra_sandbox": 3.0,
        "rollout/infra_timeout": 6.0,
        "rollout/infra_retried": 7.0,
        "rollout/infra_masked": 3.0,
        "rollout/infra_groups_dropped": 1.0,
    }
    rewards = torch.tensor([t.reward for t in settled]).view(3, 3)
    batch = collate(settled, [0.0] * 9, pad_token_id=0)
    advantages, _ = step_advantages(settled, rewards, [], batch, GRPOConfig(), {})
    # group 0: [1, 1, 0]: mean 2/3, unbiased std sqrt(1/3); group 1: [1, 0 | masked]: mean 1/2, std sqrt(1/2)
    torch.testing.assert_close(
        advantages,
        torch.tensor([[1 / 3, 1 / 3, -2 / 3], [0.5, -0.5, 0.0], [0.0, 0.0, 0.0]])
        / torch.tensor([[1 / 3], [0.5], [1]]).sqrt(),
        atol=1e-4,
        rtol=0,
    )
    assert batch.loss_mask[[5, 6, 7, 8]].sum() == 0 and batch.loss_mask[[0, 1, 2, 3, 4]].sum() == 10
    assert rollout_metrics(settled, rewards)["train/reward_mean"] == pytest.approx(3 / 5)  # the 5 valid ones


def test_a_step_whose_infrastructure_is_down_stops_the_run_with_one_line():
    cause = "environment server http://127.0.0.1:9 failed POST /verify after 1 attempt: HTTP 500: boom"

    def down_trajectory(group):
        failed = trajectory(0.0, group, "env_server")
        failed.infra_error = cause
        return failed

    def down(indices, retry):
        return [down_trajectory(0) for _ in indices]

    failing = [down_trajectory(i // 2) for i in range(3)] + [trajectory(1.0, 1)]
    with pytest.raises(InfraFailureError) as error:
        settle(failing, 2, down, LIMITS)
    message = str(error.value)
    assert "\n" not in message and message.startswith("3 of 4 episodes still failed on infrastructure after 2 retries")
    assert "(env_server;" in message and message.endswith(cause)


def test_a_step_left_with_no_group_stops_the_run_even_under_the_fraction():
    """Groups of 2, one failure in each: 2 of 4 masked (0.5, not over 0.5), but every group is dropped."""
    failing = [trajectory(1.0, 0), trajectory(0.0, 0, "sandbox"), trajectory(1.0, 1), trajectory(0.0, 1, "sandbox")]
    no_retry = InfraLimits(max_retries=0, min_valid_per_group=2, max_failure_fraction=0.5)
    with pytest.raises(InfraFailureError, match=r"^2 of 4 episodes .*\(sandbox;"):
        settle(failing, 2, lambda indices, retry: pytest.fail("no retries"), no_retry)


def test_no_failure_leaves_the_step_untouched():
    trajectories = [trajectory(float(i % 2), i // 2) for i in range(4)]
    settled, metrics = settle(trajectories, 2, lambda indices, retry: pytest.fail("nothing to re-run"), LIMITS)
    assert settled == trajectories and not any(t.excluded for t in settled)
    assert metrics == {"rollout/infra_retried": 0.0, "rollout/infra_masked": 0.0, "rollout/infra_groups_dropped": 0.0}
