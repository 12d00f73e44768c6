"""DAPO's dynamic sampling (`grpo.fill_with_informative_groups`) on rewards from the real math verifier:
fixed answers stand in for the policy's, so every expectation is exact."""

import json

import pytest

from reinforge.algorithms.dynamic_sampling import fill_with_informative_groups
from reinforge.data.batch import Trajectory
from reinforge.envs.base import EnvRequest
from reinforge.envs.math_env import MathEnv
from reinforge.loops.checkpointing import log_trained_prompts


@pytest.fixture(scope="module")
def math_env():
    env = MathEnv()
    yield env
    env.close()


def scored_rounds(math_env, rounds):
    """A `rollout_round` over `rounds`: each round is a list of (gold answer, [answers of the group]).
    Returns the function and the list of round indices it was called with."""
    calls = []

    def rollout_round(round_index):
        calls.append(round_index)
        trajectories = []
        for group, (gold, answers) in enumerate(rounds[round_index]):
            requests = [
                EnvRequest(
                    messages=[
                        {"role": "user", "content": "?"},
                        {"role": "assistant", "content": f"The answer is {a}."},
                    ],
                    record={"answer": gold},
                )
                for a in answers
            ]
            for answer, response in zip(answers, math_env.step(requests)):
                trajectories.append(
                    Trajectory(
                        prompt_ids=[1],
                        response_ids=[2],
                        gen_logprobs=[0.0],
                        truncated=False,
                        reward=response.reward,
                        group=group,
                        task="math",
                        response_text=answer,
                    )
                )
        return trajectories

    return rollout_round, calls


def test_groups_with_equal_rewards_are_dropped_and_more_prompts_are_sampled_until_the_batch_is_full(math_env):
    """3 groups of 2 wanted. Round 0: [48, 48] vs 48 -> rewards [1, 1], dropped; [78, 12] vs 78 -> [1, 0], kept;
    [0, 1] vs 43 -> [0, 0], dropped. Round 1: [10, 9] vs 10 kept; [11, 11] vs 11 dropped; [3, 12] vs 12 kept.
    3 kept after 2 rounds, so round 2 is never rolled out; 3 of the 6 generated groups were dropped."""
    rounds = [
        [("48", ["48", "48"]), ("78", ["78", "12"]), ("43", ["0", "1"])],
        [("10", ["10", "9"]), ("11", ["11", "11"]), ("12", ["3", "12"])],
        [("5", ["5", "4"])] * 3,
    ]
    rollout_round, calls = scored_rounds(math_env, rounds)
    trajectories, metrics = fill_with_informative_groups(rollout_round, num_groups=3, group_size=2, max_extra_rounds=4)
    assert calls == [0, 1]
    assert [t.response_text for t in trajectories] == ["78", "12", "10", "9", "3", "12"]
    assert [t.reward for t in trajectories] == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert [t.group for t in trajectories] == [0, 0, 1, 1, 2, 2]  # renumbered across rounds
    assert metrics == {
        "rollout/dynamic_sampling_rounds": 2,
        "rollout/num_dropped_groups": 3,
        "rollout/dropped_group_fraction": 0.5,
        "rollout/num_trained_groups": 3,
    }


def test_the_surplus_of_the_last_round_is_discarded(math_env):
    """2 groups wanted, round 0 yields 3 informative ones: the first 2 are kept."""
    rollout_round, calls = scored_rounds(math_env, [[("1", ["1", "2"]), ("2", ["2", "3"]), ("3", ["3", "4"])]])
    trajectories, metrics = fill_with_informative_groups(rollout_round, num_groups=2, group_size=2, max_extra_rounds=4)
    assert calls == [0]
    assert [t.response_text for t in trajectories] == ["1", "2", "2", "3"]
    assert metrics["rollout/num_dropped_groups"] == 0 and metrics["rollout/num_trained_groups"] == 2


def test_when_the_extra_rounds_run_out_the_step_trains_on_the_groups_it_has(math_env):
    """2 groups wanted, 1 extra round allowed: round 0 keeps 1 ([7, 8] vs 7), round 1 keeps none; stop with 1 group."""
    rounds = [[("7", ["7", "8"]), ("9", ["9", "9"])], [("1", ["0", "0"]), ("2", ["2", "2"])], [("3", ["3", "0"])] * 2]
    rollout_round, calls = scored_rounds(math_env, rounds)
    trajectories, metrics = fill_with_informative_groups(rollout_round, num_groups=2, group_size=2, max_extra_rounds=1)
    assert calls == [0, 1]
    assert [t.response_text for t in trajectories] == ["7", "8"]
    assert metrics == {
        "rollout/dynamic_sampling_rounds": 2,
        "rollout/num_dropped_groups": 3,
        "rollout/dropped_group_fraction": 0.75,
        "rollout/num_trained_groups": 1,
    }


def test_without_any_informative_group_nothing_is_trained(math_env):
    rollout_round, calls = scored_rounds(math_env, [[("1", ["1", "1"])]])
    trajectories, metrics = fill_with_informative_groups(rollout_round, num_groups=1, group_size=2, max_extra_rounds=0)
    assert calls == [0] and trajectories == [] and metrics["rollout/num_trained_groups"] == 0


def test_every_drawn_prompt_is_in_the_prompts_ledger_trained_or_discarded_with_its_reason(math_env, tmp_path):
    """2 groups wanted. Round 0 (ordinals 0-2): [5, 5] vs 5 equal; [6, 7] vs 6 kept; the third group's scoring failed
    (both samples excluded, rollout/infra.py). Round 1 (3-5): [1, 2] vs 1 kept, the batch is full; [2, 3] vs 2 and
    [4, 4] vs 3 come with it: a surplus (informative) and one with equal rewards. Every ordinal is in the step's row
    once: trained, or discarded with the reason (the loop's accounting, loops/rollouts.py's `generate_batch`)."""
    rounds = [
        [("5", ["5", "5"]), ("6", ["6", "7"]), ("8", ["8", "9"])],
        [("1", ["1", "2"]), ("2", ["2", "3"]), ("3", ["4", "4"])],
    ]
    rollout_round, _ = scored_rounds(math_env, rounds)
    drawn = []

    def numbered_round(round_index):
        trajectories = rollout_round(round_index)
        for trajectory in trajectories:
            trajectory.prompt_ordinal = 3 * round_index + trajectory.group
            trajectory.excluded = trajectory.prompt_ordinal == 2  # its environment failed: no reward
        drawn.extend(trajectories)
        return trajectories

    trajectories, _ = fill_with_informative_groups(numbered_round, num_groups=2, group_size=2, max_extra_rounds=3)
    discarded = {t.prompt_ordinal: t.discarded for t in drawn if t.discarded}
    metrics = log_trained_prompts(tmp_path, 1, trajectories, discarded)
    (row,) = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert row["ordinals"] == [1, 3] and row["dropped"] == []
    assert row["discarded"] == {"equal_rewards": [0, 5], "infra_failures": [2], "surplus": [4]}
    assert metrics["data/prompts_trained"] == 2 and metrics["data/prompts_discarded"] == 4
