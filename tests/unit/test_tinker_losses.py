"""Tinker's built-in losses (reinforge/tinker/losses.py) on hand-computed cases: the value and the gradient with respect
to the target logprobs, in float64 to 1e-6, with the clipping of ppo, cispo and gspo active on both sides and inactive
on both sides; and the one-line errors of a bad request."""

import math

import numpy as np
import pytest
import torch

from reinforge.tinker.datum import Datum
from reinforge.tinker.errors import TinkerRequestError
from reinforge.tinker.losses import LOSS_NAMES, SAMPLED, check_inputs, datum_loss

LN15, LN05 = 0.4054651081081644, -0.6931471805599453  # log 1.5, log 0.5
# five positions: sampler logprobs q, ratios r = exp(lp - q) of 1.5, 0.5, 1, 1.5, 0.5, advantages A
Q = [-1.0, -2.0, -0.5, -1.5, -0.7]
LP = [-0.5945348918918356, -2.6931471805599454, -0.5, -1.0945348918918356, -1.3931471805599451]
A = [2.0, -1.0, 3.0, -1.0, 2.0]


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def run(loss_fn, lp, inputs, config=None):
    """(the loss, its gradient with respect to lp, the outputs)."""
    lp = t(lp).requires_grad_(True)
    loss, outputs = datum_loss(loss_fn, lp, {name: t(v) for name, v in inputs.items()}, config or {})
    loss.backward()
    return loss.item(), lp.grad.tolist(), outputs


def close(actual, expected):
    assert np.allclose(actual, expected, atol=1e-6, rtol=0), (actual, expected)


def test_cross_entropy_sums_the_weighted_negative_logprobs():
    loss, grad, outputs = run("cross_entropy", [-1.0, -2.0, -0.5], {"weights": [0.0, 1.0, 0.5]})
    close(loss, 2.25)  # 2 + 0.25
    close(grad, [0.0, -1.0, -0.5])
    close(outputs["logprobs"].tolist(), [-1.0, -2.0, -0.5])


def test_cross_entropy_with_k_targets_per_position():
    lp, weights = [[-1.0, -2.0], [-0.5, -3.0]], [[0.5, 0.25], [1.0, 0.0]]
    loss, grad, _ = run("cross_entropy", lp, {"weights": weights})
    close(loss, 1.5)  # 0.5 + 0.5 + 0.5 + 0
    close(grad, [[-0.5, -0.25], [-1.0, 0.0]])


def test_importance_sampling():
    loss, grad, outputs = run("importance_sampling", LP, {"logprobs": Q, "advantages": A})
    close(loss, -5.0)  # -(1.5*2 + 0.5*-1 + 1*3 + 1.5*-1 + 0.5*2)
    close(grad, [-3.0, 0.5, -3.0, 1.5, -1.0])  # -r * A
    close(outputs["logprobs"].tolist(), LP)


def test_ppo_clips_on_both_sides_only_where_the_clipped_term_is_the_smaller():
    loss, grad, _ = run("ppo", LP, {"logprobs": Q, "advantages": A})
    # per position min(r A, clip(r, 0.8, 1.2) A): 2.4 (clipped high), -0.8 (clipped low), 3, -1.5, 1.0 (unclipped)
    close(loss, -4.1)
    close(grad, [0.0, 0.0, -3.0, 1.5, -1.0])
    loss, grad, _ = run(
        "ppo", LP, {"logprobs": Q, "advantages": A}, {"clip_low_threshold": 0.4, "clip_high_threshold": 2}
    )
    close(loss, -5.0)  # nothing clipped: importance sampling's
    close(grad, [-3.0, 0.5, -3.0, 1.5, -1.0])


def test_ppo_takes_thresholds_per_position_from_the_inputs():
    inputs = {"logprobs": Q, "advantages": A, "clip_low_threshold": [0.8] * 5, "clip_high_threshold": [2.0] + [1.2] * 4}
    loss, grad, _ = run("ppo", LP, inputs)
    close(loss, -4.7)  # position 0 unclipped now: 3 instead of 2.4
    close(grad, [-3.0, 0.0, -3.0, 1.5, -1.0])


def test_cispo_weights_the_logprob_by_the_clipped_ratio_without_its_gradient():
    loss, grad, _ = run("cispo", LP, {"logprobs": Q, "advantages": A})
    # clip(r) = 1.2, 0.8, 1, 1.2, 0.8: -sum(c * lp * A)
    close(loss, 1.6879596147181586)
    close(grad, [-2.4, 0.8, -3.0, 1.2, -1.6])  # -c * A


def test_dro_penalises_the_squared_log_ratio():
    loss, grad, _ = run("dro", LP, {"logprobs": Q, "advantages": A})  # beta 0.05
    close(loss, 1.7199248208423488)
    close(grad, [-1.9797267445945919, 0.9653426409720027, -3.0, 1.0202732554054081, -2.0346573590279973])
    loss, grad, _ = run("dro", LP, {"logprobs": Q, "advantages": A}, {"beta": 1.0})
    close(loss, 2.332537040263148)
    close(grad, [-1.5945348918918356, 0.3068528194400547, -3.0, 1.4054651081081644, -2.6931471805599454])


def test_gspo_gives_every_position_the_sequence_ratio():
    # the mask's log-ratios: log 1.5, log 0.5, 0, log 1.5 -> s = exp(0.02944575...) = 1.02988..., unclipped
    inputs = {"logprobs": Q, "advantages": A, "sequence_ratio_mask": [1.0, 1.0, 1.0, 1.0, 0.0]}
    loss, grad, _ = run("gspo", LP, inputs)
    s = 1.0298835719535588
    close(loss, -5 * s)  # -s * sum(A)
    close(grad, [-s * a for a in A])


@pytest.mark.parametrize(
    "log_ratio, loss, grad",
    [
        (LN15, -0.9, [0.0, 1.5]),  # s = 1.5: A > 0 clipped to 1.2 (no gradient), A < 0 keeps -1.5
        (LN05, -0.2, [-1.0, 0.0]),  # s = 0.5: A > 0 keeps 1.0, A < 0 clipped to -0.8 (no gradient)
    ],
)
def test_gspo_clips_the_sequence_ratio_on_both_sides(log_ratio, loss, grad):
    q = [-1.0, -2.0]
    lp = [x + log_ratio for x in q]
    value, gradient, _ = run("gspo", lp, {"logprobs": q, "advantages": [2.0, -1.0], "sequence_ratio_mask": [1.0, 1.0]})
    close(value, loss)
    close(gradient, grad)


def test_gspo_without_a_mask_takes_the_positions_with_an_advantage():
    q, lp = [-1.0, -2.0, -3.0], [-1.0 + LN15, -2.0 + LN15, -1.0]  # position 2: zero advantage, log-ratio 2
    loss, grad, _ = run("gspo", lp, {"logprobs": q, "advantages": [2.0, -1.0, 0.0]})
    close(loss, -0.9)
    close(grad, [0.0, 1.5, 0.0])


def test_stable_reinforce_truncates_the_ratio_and_trains_sampled_positions_only():
    lp = [-0.5945348918918356, -2.6931471805599454, -0.5, -0.4013877113318902, -1.3931471805599451]  # r3 = 3
    inputs = {"logprobs": Q, "advantages": [0.0, -1.0, 3.0, -1.0, 2.0], SAMPLED: [0.0, 1.0, 1.0, 1.0, 1.0]}
    loss, grad, _ = run("stable_reinforce", lp, inputs)
    close(loss, 0.743798167616192)  # -sum(min(r, 2) * lp * A) over positions 1-4
    close(grad, [0.0, 0.5, -3.0, 2.0, -1.0])
    on_policy = {"logprobs": [-1.0, -2.0], "advantages": [2.0, -1.0], SAMPLED: [1.0, 1.0]}
    _, grad, _ = run("stable_reinforce", [-1.0, -2.0], on_policy)
    close(grad, [-2.0, 1.0])  # REINFORCE's: -A


def datum(n=3, **inputs):
    base = {"target_tokens": np.arange(n), "logprobs": np.zeros(n), "advantages": np.ones(n)}
    return Datum(list(range(n)), {**base, **inputs})


@pytest.mark.parametrize(
    "loss_fn, config, datums, message",
    [
        ("ppo2", {}, [datum()], "unknown loss_fn 'ppo2'; the built-in losses are cross_entropy, importance_sampling"),
        ("cross_entropy", {}, [datum()], "datum 0 has no loss_fn_inputs['weights'], which cross_entropy needs"),
        ("ppo", {}, [datum(), datum(advantages=np.ones(4))], "datum 1: loss_fn_inputs['advantages'] has shape [4]"),
        ("ppo", {}, [datum(logprobs=np.array([0, math.nan, 0]))], "'logprobs'] is NaN or infinite at position 1"),
        ("ppo", {"clip_ratio": 0.2}, [datum()], "loss_fn_config key 'clip_ratio' is not one of ppo's"),
        ("dro", {"beta": math.inf}, [datum()], "loss_fn_config['beta']=inf must be a finite number"),
        ("importance_sampling", {}, [Datum([], {})], "datum 0 has an empty model_input"),
        ("ppo", {}, [datum(target_tokens=np.array([0, -1, 2]))], "must hold token ids"),
        ("stable_reinforce", {}, [datum()], "datum 0 has no provenance; stable_reinforce trains the sampled tokens"),
        ("importance_sampling", {}, [], "the request has no datums"),
    ],
)
def test_bad_requests_get_one_line_errors(loss_fn, config, datums, message):
    with pytest.raises(TinkerRequestError) as error:
        check_inputs(loss_fn, config, datums)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_stable_reinforce_refuses_an_advantage_on_a_prompt_position():
    bad = datum()
    bad.sampled = np.array([0.0, 1.0, 1.0])
    with pytest.raises(
        TinkerRequestError, match="nonzero advantage at position 0, which its provenance names a prompt"
    ):
        check_inputs("stable_reinforce", {}, [bad])
    bad.inputs["advantages"] = np.array([0.0, 1.0, 1.0])
    check_inputs("stable_reinforce", {}, [bad])


def test_every_named_loss_accepts_its_inputs():
    for loss_fn in LOSS_NAMES:
        good = datum(weights=np.ones(3))
        good.sampled = np.array([0.0, 1.0, 1.0])
        good.inputs["advantages"] = np.array([0.0, 1.0, 1.0])
        check_inputs(loss_fn, {}, [good])
