"""Each KL estimator's expected gradient against the exact KL gradient, computed by enumerating a small
vocabulary (docs/algorithms.md derives them). A one-token "sequence" y ~ pi_theta = softmax(theta) over V
tokens, a fixed reference q = softmax(phi); every expectation E_{y ~ pi}[f(y)] is the exact sum
sum_y pi(y) f(y), with pi(y) held constant where a sampled token's weight is (the sample is not
differentiated, only the loss computed on it).
- As a loss term, L(y) = k(log pi(y), log q(y)) differentiated:  g = sum_y pi(y) grad_theta k(y).
- As a reward penalty (`loss.kl_in_reward`), the score-function gradient of E[k]:  g = sum_y pi(y) k(y) grad log pi(y).
"""

import pytest
import torch

from reinforge.algorithms.losses import KL_ESTIMATORS, clipped_policy_loss, token_mean
from reinforge.data.batch import Normalisers

V = 6


def distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    theta = (torch.randn(V, generator=generator, dtype=torch.float64) * 1.5).requires_grad_()
    log_q = torch.log_softmax(torch.randn(V, generator=generator, dtype=torch.float64) * 1.5, -1)
    return theta, log_q


def gradient(objective, theta: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(objective, theta)
    return grad


def exact_kl_gradients(theta, log_q):
    """grad KL(pi || q) = grad sum pi (log pi - log q);  grad KL(q || pi) = grad sum q (log q - log pi)."""

    def log_pi():
        return torch.log_softmax(theta, -1)

    reverse = gradient((log_pi().exp() * (log_pi() - log_q)).sum(), theta)
    forward = gradient((log_q.exp() * (log_q - log_pi())).sum(), theta)
    return reverse, forward


def loss_term_gradient(estimator, theta, log_q):
    log_pi = torch.log_softmax(theta, -1)
    return gradient((log_pi.exp().detach() * estimator(log_pi, log_q)).sum(), theta)


def reward_penalty_gradient(estimator, theta, log_q):
    log_pi = torch.log_softmax(theta, -1)
    return gradient((log_pi.exp().detach() * estimator(log_pi, log_q).detach() * log_pi).sum(), theta)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_in_the_loss_k1_has_no_expected_gradient_k2_that_of_reverse_kl_k3_that_of_forward_kl(seed):
    """k1 = log pi - log q: grad = grad log pi, and E_pi[grad log pi] = sum grad pi = 0.
    k2 = (log pi - log q)^2 / 2: grad = (log pi - log q) grad log pi, whose expectation is grad KL(pi || q).
    k3 = q/pi - 1 - log(q/pi): grad = (1 - q/pi) grad log pi, whose expectation is -sum q grad log pi
    = grad KL(q || pi)."""
    theta, log_q = distributions(seed)
    reverse, forward = exact_kl_gradients(theta, log_q)
    assert reverse.abs().max() > 1e-2 and (reverse - forward).abs().max() > 1e-2  # the two KLs' gradients differ here
    torch.testing.assert_close(
        loss_term_gradient(KL_ESTIMATORS["k1"], theta, log_q), torch.zeros(V, dtype=torch.float64), atol=1e-12, rtol=0
    )
    torch.testing.assert_close(loss_term_gradient(KL_ESTIMATORS["k2"], theta, log_q), reverse, atol=1e-12, rtol=0)
    torch.testing.assert_close(loss_term_gradient(KL_ESTIMATORS["k3"], theta, log_q), forward, atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_in_the_reward_k1_gives_the_gradient_of_reverse_kl_and_k3_does_not(seed):
    """E_pi[k1 grad log pi] = sum pi (log pi - log q) grad log pi = grad KL(pi || q) (the sum pi grad log pi term is 0);
    k3 as a reward weights grad log pi by q/pi - 1 - log(q/pi) instead, which is neither KL's gradient."""
    theta, log_q = distributions(seed)
    reverse, forward = exact_kl_gradients(theta, log_q)
    torch.testing.assert_close(reward_penalty_gradient(KL_ESTIMATORS["k1"], theta, log_q), reverse, atol=1e-12, rtol=0)
    k3 = reward_penalty_gradient(KL_ESTIMATORS["k3"], theta, log_q)
    assert (k3 - reverse).abs().max() > 1e-3 and (k3 - forward).abs().max() > 1e-3


@pytest.mark.parametrize("seed", [0, 1])
def test_k1_and_k3_estimate_reverse_kl_without_bias_and_k2_with(seed):
    theta, log_q = distributions(seed)
    log_pi = torch.log_softmax(theta, -1).detach()
    exact = (log_pi.exp() * (log_pi - log_q)).sum()
    means = {name: (log_pi.exp() * estimator(log_pi, log_q)).sum() for name, estimator in KL_ESTIMATORS.items()}
    torch.testing.assert_close(means["k1"], exact, atol=1e-12, rtol=0)
    torch.testing.assert_close(means["k3"], exact, atol=1e-12, rtol=0)
    assert abs(means["k2"] - exact) > 1e-4


def test_grpo_loss_adds_the_chosen_estimator_and_measures_it_without_training_on_it_at_kl_coef_0():
    """One token, A = 0, logp = -1, logp_ref = -2 (log r = logp_ref - logp = -1): k1 = 1, k2 = 0.5,
    k3 = e^-1 - 1 + 1 = 0.367879. With kl_coef 0.5 the loss is 0.5 k; with kl_coef 0 it is 0 and `kl` still reads k."""
    logp = torch.tensor([[-1.0]], requires_grad=True)
    common = dict(aggregate=token_mean, eps_low=0.2, eps_high=0.2, ref_logprobs_BT=torch.tensor([[-2.0]]))
    for name, expected in {"k1": 1.0, "k2": 0.5, "k3": 0.367879}.items():
        loss, metrics = clipped_policy_loss(
            logp,
            logp.detach(),
            torch.zeros(1),
            torch.ones(1, 1),
            Normalisers(1, 1),
            kl_coef=0.5,
            kl_estimator=KL_ESTIMATORS[name],
            **common,
        )
        assert abs(loss.item() - 0.5 * expected) < 1e-5 and abs(metrics["kl"].item() - expected) < 1e-5
        loss, metrics = clipped_policy_loss(
            logp,
            logp.detach(),
            torch.zeros(1),
            torch.ones(1, 1),
            Normalisers(1, 1),
            kl_coef=0.0,
            kl_estimator=KL_ESTIMATORS[name],
            **common,
        )
        assert loss.item() == 0.0 and abs(metrics["kl"].item() - expected) < 1e-5
        (grad,) = torch.autograd.grad(loss, logp, allow_unused=True, materialize_grads=True)
        assert grad.abs().max() == 0.0
