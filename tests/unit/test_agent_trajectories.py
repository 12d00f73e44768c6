"""Agent episodes rebuilt into trajectories from what the endpoint recorded (rollout/agent.py, serving/recorder.py)."""

import pytest

from reinforge.generation.base import SamplingParams
from reinforge.rollout.agent import Episode, claim_gym_calls, episode_status, join_calls
from reinforge.rollout.agent_runners import EpisodeResult, parse_result, stamped_row
from reinforge.serving.recorder import CallRecorder, RecordedCall
from reinforge.serving.server import RolloutSession


def call(prompt, generation, truncated=False):
    return RecordedCall(prompt, generation, [-0.1 * (i + 1) for i in range(len(generation))], truncated)


def test_two_contiguous_calls_join_into_one_sequence_trained_on_the_generated_tokens_only():
    """Call 1: prompt [1, 2], generated [3, 4]. Call 2's prompt is [1, 2, 3, 4] + the tool result [7, 8];
    it generated [5]. Response = [3, 4, 7, 8, 5], mask [1, 1, 0, 0, 1], logprobs 0 between the calls."""
    tokens = join_calls([call([1, 2], [3, 4]), call([1, 2, 3, 4, 7, 8], [5], truncated=True)])
    assert (tokens.prompt_ids, tokens.response_ids, tokens.response_mask) == ([1, 2], [3, 4, 7, 8, 5], [1, 1, 0, 0, 1])
    assert tokens.gen_logprobs == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.1])
    assert tokens.contiguous and tokens.truncated


def test_an_episode_across_an_update_keeps_each_tokens_version():
    """In flight, call 1 was sampled by versions 3 then 4 (an update landed inside it), call 2 by 4; the tool
    result between them takes the version of the token before it. A call that does not say: no versions."""
    first = RecordedCall([1, 2], [3, 4], [-0.1, -0.2], False, token_versions=[3, 4])
    second = RecordedCall([1, 2, 3, 4, 7, 8], [5, 6], [-0.3, -0.4], False, token_versions=[4, 5])
    assert join_calls([first, second]).token_versions == [3, 4, 4, 4, 4, 5]
    assert join_calls([first, call([1, 2, 3, 4, 7], [5])]).token_versions is None


def test_a_call_whose_prompt_rewrites_the_history_breaks_the_episode_there():
    tokens = join_calls([call([1, 2], [3, 4]), call([1, 2, 9, 7], [5]), call([1, 2, 3, 4, 6], [8])])
    assert not tokens.contiguous
    assert (tokens.prompt_ids, tokens.response_ids, tokens.response_mask) == ([1, 2], [3, 4], [1, 1])


def test_an_episode_is_trained_on_only_when_the_agent_succeeded_and_its_calls_join():
    good = join_calls([call([1], [2])])
    broken = join_calls([call([1], [2]), call([5], [6])])
    ok = EpisodeResult("ok", reward=1.0)
    assert episode_status(Episode(ok, [call([1], [2])], 0.1), good) == "ok"
    assert episode_status(Episode(ok, [call([1], [2]), call([5], [6])], 0.1), broken) == "noncontiguous"
    assert episode_status(Episode(ok, [], 0.1), None) == "no_calls"
    assert episode_status(Episode(ok, None, 0.1), None) == "unrecorded"
    assert episode_status(Episode(EpisodeResult("timeout"), [call([1], [2])], 0.1), good) == "timeout"


def test_the_recorder_files_calls_by_episode_and_by_tokens_and_forgets_what_it_hands_out():
    recorder = CallRecorder()
    recorder.record(call([1], [2]), "ep-a")
    recorder.record(call([1, 2, 3], [4]), "ep-a")
    recorder.record(call([1], [9]), None)
    recorder.record(call([1], [9]), None)  # two identical samples: interchangeable
    assert [c.generation_ids for c in recorder.take_episode("ep-a")] == [[2], [4]]
    assert recorder.take_episode("ep-a") == []
    assert recorder.claim([1], [9]).generation_ids == [9]
    assert recorder.claim([1, 9], []) is None  # same tokens in all, other split: another call
    assert recorder.clear() == 1


def test_a_gym_episode_is_trusted_only_if_every_call_it_reports_was_made_by_the_endpoint():
    session = RolloutSession(sampling=SamplingParams(max_new_tokens=8))
    session.recorder.record(call([1, 2], [3, 4]), None)
    session.recorder.record(call([1, 2, 3, 4, 7], [5]), None)
    output = [
        {
            "type": "function_call",
            "prompt_token_ids": [1, 2],
            "generation_token_ids": [3, 4],
            "generation_log_probs": [0.0, 0.0],
        },
        {"type": "function_call_output", "output": "7"},
        {
            "type": "message",
            "prompt_token_ids": [1, 2, 3, 4, 7],
            "generation_token_ids": [5],
            "generation_log_probs": [-9.0],
        },
    ]
    calls = claim_gym_calls(session, output)
    assert [c.generation_ids for c in calls] == [[3, 4], [5]]
    assert calls[1].logprobs == pytest.approx([-0.1])  # the endpoint's, not what the agent reported
    session.recorder.record(call([1, 2], [3, 4]), None)
    forged = [output[0], {**output[2], "generation_token_ids": [6]}]
    assert claim_gym_calls(session, forged) is None


def test_an_agents_return_value_is_a_reward_or_a_dict_with_one():
    assert parse_result(1, "a").reward == 1.0
    full = parse_result({"reward": 2.0, "reward_components": {"correct": 1.0, "format": 1.0}, "mask_sample": True}, "a")
    assert (full.status, full.components, full.mask_sample) == ("ok", {"correct": 1.0, "format": 1.0}, True)
    for bad in (
        None,
        "1",
        {"score": 1},
        {"reward": True},
        {"reward": float("nan")},
        {"reward": 1, "reward_components": {"a": "x"}},
    ):
        assert parse_result(bad, "agent x").status == "failed"
    assert "agent x returned" in parse_result(None, "agent x").error


def test_the_numbers_a_verifier_adds_to_the_row_are_components_and_the_rows_own_are_not():
    """Gym's multi-reward servers give each component as a field too; a row field (e.g. a count the
    verifier compares against) is not a component; flags and texts are not either."""
    row = {"responses_create_params": {"input": "hi"}, "expected_count": 3, "answer": "42"}
    verdict = {
        **row,
        "reward": 1.0,
        "num_tool_calls": 1,
        "tool_result_correct": 1.0,
        "mask_sample": False,
        "failure_kind": None,
        "reward_components": {"correct": 1.0},
    }
    assert parse_result(verdict, "gym", sent=row).components == {
        "num_tool_calls": 1.0,
        "tool_result_correct": 1.0,
        "correct": 1.0,
    }


def test_a_gym_row_is_stamped_with_the_rollouts_sampling_and_left_unchanged():
    row = {"responses_create_params": {"input": "hi", "temperature": 0.3}, "answer": "1"}
    stamped = stamped_row(row, temperature=1.0, top_p=1.0, max_tokens=48)
    assert stamped["responses_create_params"] == {
        "input": "hi",
        "temperature": 1.0,
        "top_p": 1.0,
        "max_output_tokens": 48,
    }
    assert row["responses_create_params"]["temperature"] == 0.3
