"""rollout.version_check: each trained token compared with the weights of the policy version that sampled it."""

import math
from dataclasses import replace

import torch

from reinforge.algorithms.consistency import mismatch_metrics, version_matched_mismatch
from reinforge.data.batch import Trajectory, collate, sampled_by
from tests.unit.test_torch_backend import make_backend, make_batch


def test_sampled_by_marks_the_response_tokens_of_one_version():
    mixed = Trajectory([5, 6], [7, 8, 9], [0.0] * 3, False, 0.0, 0, "math", policy_version=3, token_versions=[3, 3, 4])
    whole = Trajectory([5], [7, 8], [0.0] * 2, False, 0.0, 0, "math", policy_version=4)
    assert sampled_by([mixed, whole], 4, 6).tolist() == [[0, 0, 0, 0, 1, 0], [0, 1, 1, 0, 0, 0]]
    assert sampled_by([mixed, whole], 3, 6).tolist() == [[0, 0, 1, 1, 0, 0], [0] * 6]


def test_a_kept_versions_logprobs_are_that_versions_and_the_current_weights_come_back(tiny_model_dir):
    backend = make_backend(tiny_model_dir, micro_batch_size=4)
    batch = make_batch()
    before = backend.logprobs(batch)
    assert backend.keep_version(0, depth=2) == [0]
    backend.train_step(replace(batch, old_logprobs=before), _sum_of_logprobs)
    after = backend.logprobs(batch)
    assert (after - before).abs().max() > 1e-3  # the step moved the policy
    assert torch.allclose(backend.logprobs(batch, version=0), before, atol=1e-6)
    assert torch.equal(backend.logprobs(batch), after)  # restored exactly
    assert backend.keep_version(1, depth=2) == [0, 1]
    assert backend.keep_version(2, depth=2) == [1, 2]  # only the last `depth`


def test_each_token_is_compared_with_the_version_that_sampled_it(tiny_model_dir):
    """Rows whose tokens two versions sampled, their engine logprobs each version's own but for one token off by
    log 2: the version-matched error is exactly that token's (the current-policy one counts the drift as well)."""
    backend = make_backend(tiny_model_dir, micro_batch_size=4)
    trajectories = [_trajectory(row) for row in range(4)]
    batch = collate(trajectories, [1.0, -1.0, 0.5, -0.5], pad_token_id=0)
    v0 = backend.logprobs(batch)
    backend.keep_version(0, depth=2)
    backend.train_step(replace(batch, old_logprobs=v0), _sum_of_logprobs)
    v1 = backend.logprobs(batch)
    versions_BT = sampled_by(trajectories, 1, batch.loss_mask.shape[1])
    gen_BT = torch.where(versions_BT > 0, v1, v0) * batch.loss_mask
    first = int(batch.loss_mask[0].nonzero()[0])
    gen_BT[0, first] += math.log(2.0)
    for row, trajectory in enumerate(trajectories):
        start = len(trajectory.prompt_ids)
        trajectory.gen_logprobs = gen_BT[row, start : start + len(trajectory.response_ids)].tolist()
    batch = replace(collate(trajectories, [0.0] * 4, pad_token_id=0), old_logprobs=v1)
    kept = backend.keep_version(1, depth=2)
    metrics = version_matched_mismatch(batch, trajectories, 1, backend, kept)
    num_tokens = batch.num_valid_tokens()
    assert metrics["train/version_matched/token_share"] == 1.0
    expected = (num_tokens - 1 + 2.0) / num_tokens  # exp|0| everywhere but exp|log 2| on one token
    assert abs(metrics["train/version_matched/token_mult_prob_error"] - expected) < 1e-5
    assert mismatch_metrics(batch)["train/token_mult_prob_error"] > expected + 1e-3
    current_only = version_matched_mismatch(batch, trajectories, 1)  # no kept versions: version 1's tokens only
    assert (
        current_only["train/version_matched/token_share"] == float((versions_BT * batch.loss_mask).sum()) / num_tokens
    )
    assert abs(current_only["train/version_matched/token_mult_prob_error"] - 1.0) < 1e-5


def _trajectory(row: int) -> Trajectory:
    """A prompt and a response whose first tokens version 0 sampled and the rest version 1 (row 3: all version 1)."""
    gen = torch.Generator().manual_seed(row)
    num_prompt, num_response = 3 + row, 4 + 2 * row
    ids = torch.randint(2, 64, (num_prompt + num_response,), generator=gen).tolist()
    switch = 0 if row == 3 else 1 + row
    versions = [0] * switch + [1] * (num_response - switch)
    return Trajectory(
        ids[:num_prompt], ids[num_prompt:], [0.0] * num_response, False, 0.0, row // 2, "math", token_versions=versions
    )


def _sum_of_logprobs(logprobs, micro, norm):
    loss = -(logprobs * micro.advantages * micro.loss_mask).sum() / norm.num_tokens
    return loss, {}
