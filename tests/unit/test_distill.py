"""On-policy distillation's math (algorithms/distill_losses.py), the student's logprobs at the teacher's top-k ids
through the backends' chunked head (micro_batching), and the teacher's scores (training/teacher.py), each against
a hand-computed value or a direct full-vocabulary computation."""

import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from reinforge.algorithms.distill import DistillBatch, make_loss_fn
from reinforge.algorithms.distill_config import DistillRunConfig
from reinforge.algorithms.distill_losses import reverse_kl_advantages, topk_kl
from reinforge.algorithms.losses import token_mean
from reinforge.data.batch import Normalisers, Trajectory, collate
from reinforge.model_config import ModelConfig
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.heads import LogprobHead, LogprobsAt, with_outputs
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig
from reinforge.training.teacher import Teacher

TEMPERATURE = 0.8
K = 5

LN2 = math.log(2.0)


def test_the_reverse_kl_advantage_is_teacher_minus_student_logprob_on_trained_tokens_only():
    """teacher [0, -0.5, -1.0], student [-3, -1.0, -0.25], mask [0, 1, 1]:
    A = [0 (off the mask), -0.5 - (-1.0) = 0.5, -1.0 - (-0.25) = -0.75]; no gradient flows to the student."""
    student = torch.tensor([[-3.0, -1.0, -0.25]], requires_grad=True)
    advantages = reverse_kl_advantages(torch.tensor([[0.0, -0.5, -1.0]]), student, torch.tensor([[0.0, 1.0, 1.0]]))
    assert advantages.tolist() == [[0.0, 0.5, -0.75]]
    assert not advantages.requires_grad


def test_topk_kl_without_renormalising_uses_the_full_vocabulary_probabilities_by_hand():
    """Top-2 of the teacher p = (1/2, 1/4), the student q = (1/4, 1/4) at the same ids:
    forward = 1/2 ln(1/2 / 1/4) + 1/4 ln 1 = ln2 / 2 = 0.34657
    reverse = 1/4 ln(1/4 / 1/2) + 1/4 ln 1 = -ln2 / 4 = -0.17329 (mass outside the top-k is ignored, so it may be < 0)
    mixed, w = 0.75: 0.75 * ln2 / 2 - 0.25 * ln2 / 4 = 5 ln2 / 16 = 0.21661"""
    teacher = torch.log(torch.tensor([[[0.5, 0.25]]]))
    student = torch.log(torch.tensor([[[0.25, 0.25]]]))
    assert topk_kl(student, teacher, "forward", renormalize=False).item() == pytest.approx(LN2 / 2)
    assert topk_kl(student, teacher, "reverse", renormalize=False).item() == pytest.approx(-LN2 / 4)
    assert topk_kl(student, teacher, "mixed", 0.75, renormalize=False).item() == pytest.approx(5 * LN2 / 16)


def test_topk_kl_renormalised_over_the_top_k_by_hand():
    """The same top-2, renormalised over the two ids (NeMo-RL's default): the teacher p = (1/2, 1/4) / (3/4)
    = (2/3, 1/3), the student q = (1/4, 1/4) / (1/2) = (1/2, 1/2):
    forward = 2/3 ln((2/3) / (1/2)) + 1/3 ln((1/3) / (1/2)) = 2/3 ln(4/3) + 1/3 ln(2/3) = 5/3 ln2 - ln3 = 0.056633
    reverse = 1/2 ln((1/2) / (2/3)) + 1/2 ln((1/2) / (1/3)) = 1/2 ln(3/4) + 1/2 ln(3/2) = ln3 - 3/2 ln2 = 0.058892
    mixed, w = 0.75: 0.75 * 0.056633 + 0.25 * 0.058892 = 0.057198 (true KLs on two tokens: never negative)"""
    teacher = torch.log(torch.tensor([[[0.5, 0.25]]]))
    student = torch.log(torch.tensor([[[0.25, 0.25]]]))
    forward, reverse = 5 / 3 * LN2 - math.log(3.0), math.log(3.0) - 1.5 * LN2
    assert topk_kl(student, teacher, "forward", renormalize=True).item() == pytest.approx(forward)
    assert topk_kl(student, teacher, "reverse", renormalize=True).item() == pytest.approx(reverse)
    assert topk_kl(student, teacher, "mixed", 0.75, renormalize=True).item() == pytest.approx(
        0.75 * forward + 0.25 * reverse
    )


@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_kl_over_the_whole_vocabulary_is_the_exact_kl_and_its_gradient_is_q_minus_p(renormalize):
    """With k = V the forward top-k KL is KL(p || q) exactly, and d KL(p || softmax(z)) / dz = q - p; the
    reverse one is KL(q || p). Renormalising over all V ids changes nothing."""
    gen = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(torch.randn(1, 1, 6, generator=gen), dim=-1)
    logits = torch.randn(1, 1, 6, generator=gen, requires_grad=True)
    student = torch.log_softmax(logits, dim=-1)
    p, q = teacher.exp(), student.exp()
    forward = topk_kl(student, teacher, "forward", renormalize=renormalize)
    assert forward.item() == pytest.approx((p * (teacher - student)).sum().item(), abs=1e-6)
    assert forward.item() == pytest.approx(
        torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="sum").item(), abs=1e-6
    )
    forward.sum().backward()
    torch.testing.assert_close(logits.grad, (q - p).detach(), atol=1e-6, rtol=0)
    assert topk_kl(student, teacher, "reverse", renormalize=renormalize).item() == pytest.approx(
        (q * (student - teacher)).sum().item(), abs=1e-6
    )


@pytest.mark.parametrize("renormalize, token_kl", [(False, LN2 / 2), (True, 5 / 3 * LN2 - math.log(3.0))])
def test_the_topk_loss_is_kl_coef_times_the_token_mean_of_the_kl_and_nothing_else_without_reward_weight(
    renormalize, token_kl
):
    """Two trained tokens, each with top-2 teacher (1/2, 1/4) and student (1/4, 1/4): forward KL ln2 / 2 each
    (5/3 ln2 - ln3 with `distill.topk_renormalize`, the two tests above); normaliser 4 tokens (the global
    batch's); kl_coef 2: loss = 2 * (2 * KL) / 4 = KL, the metric 2 * KL / 4 = KL / 2."""
    config = DistillRunConfig.model_validate(
        {"distill": {"loss": "topk_kl", "kl_coef": 2.0, "topk_renormalize": renormalize}, "loss": {"kl_coef": 0.0}}
    )
    batch = DistillBatch(
        **vars(collate([Trajectory([5, 6], [7, 8], [0.0, 0.0], False, 1.0, 0, "math")], [0.0], pad_token_id=0))
    )
    batch.old_logprobs = torch.zeros(1, 4)
    batch.teacher_topk_logprobs = torch.log(torch.tensor([0.5, 0.25])).expand(1, 4, 2)
    batch.topk_logprobs = torch.log(torch.tensor([0.25, 0.25])).expand(1, 4, 2)
    loss, metrics = make_loss_fn(config)(torch.zeros(1, 4), batch, Normalisers(num_tokens=4, num_sequences=2))
    assert loss.item() == pytest.approx(token_kl, abs=1e-6)
    assert metrics["distill_topk_kl"].item() == pytest.approx(token_kl / 2, abs=1e-6)  # 2 of 4 tokens here
    assert metrics["pg_loss"].item() == 0.0


def ragged(num_rows=8, vocab=64, seed=0):
    """Prompts of 2-6 tokens (the samples of a prompt share it: 2 per prompt), answers of 1-9 tokens, one with an
    environment span masked out, and K random token ids per position for the top-k."""
    gen = torch.Generator().manual_seed(seed)
    trajectories = []
    for row in range(num_rows):
        if row % 2 == 0:
            prompt = torch.randint(2, vocab, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen).tolist()
        answer = torch.randint(2, vocab, (int(torch.randint(1, 10, (1,), generator=gen)),), generator=gen).tolist()
        mask = [1, 0, 0] + [1] * (len(answer) - 3) if row == 3 and len(answer) > 3 else None
        trajectories.append(
            Trajectory(prompt, answer, [0.0] * len(answer), False, 0.0, row // 2, "math", response_mask=mask)
        )
    batch = DistillBatch(**vars(collate(trajectories, [0.0] * num_rows, pad_token_id=0)))
    batch.teacher_topk_ids = torch.randint(0, vocab, (*batch.loss_mask.shape, K), generator=gen)
    batch.teacher_topk_logprobs = torch.log_softmax(torch.randn(*batch.loss_mask.shape, K, generator=gen), dim=-1)
    return batch


def full_vocab_logprobs(model, batch):
    """log softmax(logits / T) [B, T, V] predicting each token (row t from position t - 1), one padded forward."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits.float()
    return torch.nn.functional.pad(torch.log_softmax(logits[:, :-1] / TEMPERATURE, dim=-1), (0, 0, 1, 0))


def topk_kl_loss(logprobs_BT, micro, norm):
    kl_BT = topk_kl(micro.topk_logprobs, micro.teacher_topk_logprobs, "mixed", 0.3, renormalize=True)
    kl = token_mean(kl_BT, micro.loss_mask, norm)
    return kl, {"loss": kl.detach()}


# the loss declares that it reads the student's logprobs at the teacher's ids; the backend fills them in
topk_loss = with_outputs(topk_kl_loss, LogprobsAt(ids="teacher_topk_ids", into="topk_logprobs"))


@pytest.mark.parametrize(
    "training",
    [
        {"sequence_packing": False, "micro_batch_size": 3},
        {"sequence_packing": True, "micro_batch_size": 8},
        {"sequence_packing": True, "share_prompts": True, "micro_batch_tokens": 24},
    ],
)
def test_the_students_logprobs_at_the_teachers_ids_give_the_full_vocabulary_loss_and_gradient(tiny_model_dir, training):
    """Padded, packed and prompt-sharing token-budget micro-batches: the top-k KL's value and gradient through
    the chunked head (logprob_chunk_tokens=4, several chunks) equal those of one padded forward with full logits."""
    batch = ragged()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    logp_BTV = full_vocab_logprobs(model, batch)
    at_ids = logp_BTV.gather(-1, batch.teacher_topk_ids) * batch.loss_mask.unsqueeze(-1)
    norm = Normalisers(num_tokens=batch.num_valid_tokens(), num_sequences=len(batch))
    expected, _ = topk_loss(None, replace(batch, topk_logprobs=at_ids), norm)
    expected.backward()
    expected_gradient = torch.cat([p.grad.flatten() for p in model.parameters()])

    backend = Backend(
        ModelConfig(name_or_path=str(tiny_model_dir)),
        TrainingConfig(global_batch_size=8, logprob_chunk_tokens=4, **training),
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=1,
        head=LogprobHead(TEMPERATURE),
        load_reference=False,
    )
    backend.optimizer.zero_grad(set_to_none=True)
    metrics = backend.accumulate_gradients(batch, topk_loss)
    gradient = torch.cat([p.grad.flatten() for p in backend.model.parameters()])
    assert metrics["loss"] == pytest.approx(expected.item(), abs=1e-5)
    assert gradient.abs().max() > 0
    torch.testing.assert_close(gradient, expected_gradient, atol=1e-5, rtol=0)


@pytest.mark.parametrize("packing", [False, True])
def test_the_teacher_scores_the_sampled_tokens_and_its_top_k_as_a_full_vocabulary_forward(tiny_model_dir, packing):
    batch = ragged()
    teacher = Teacher(
        ModelConfig(name_or_path=str(tiny_model_dir)),
        TrainingConfig(sequence_packing=packing, micro_batch_size=3, logprob_chunk_tokens=5),
        TEMPERATURE,
    )
    logprobs_BT, ids_BTK, topk_BTK = teacher.score(batch, K)
    with torch.no_grad():
        logp_BTV = full_vocab_logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir), batch)
    mask = batch.loss_mask
    sampled = logp_BTV.gather(-1, batch.input_ids.unsqueeze(-1)).squeeze(-1) * mask
    torch.testing.assert_close(logprobs_BT, sampled, atol=1e-5, rtol=0)
    torch.testing.assert_close(topk_BTK, logp_BTV.topk(K, dim=-1).values * mask.unsqueeze(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        topk_BTK, logp_BTV.gather(-1, ids_BTK) * mask.unsqueeze(-1), atol=1e-5, rtol=0
    )  # the ids are theirs
    assert (ids_BTK[mask == 0] == 0).all() and (logprobs_BT[mask == 0] == 0).all()


def test_each_answer_is_scored_by_the_teacher_of_its_task(tiny_model_dir, tmp_path):
    """Teacher A names task `code`; B (another random model) is the default: rows of task code carry A's scores,
    the rest B's, each equal to that teacher's score of the whole batch on that row."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from reinforge.algorithms.distill import score_with_teachers

    torch.manual_seed(1)
    Qwen2ForCausalLM(Qwen2Config.from_pretrained(tiny_model_dir)).save_pretrained(tmp_path / "other")
    a, b = str(tiny_model_dir), str(tmp_path / "other")
    config = DistillRunConfig.model_validate(
        {
            "distill": {
                "loss": "topk_kl",
                "topk": K,
                "teachers": [{"name_or_path": a, "tasks": ["code"]}, {"name_or_path": b}],
            }
        }
    )
    batch = ragged()
    trajectories = [
        Trajectory([], [], [], False, 0.0, 0, "code" if row in (1, 4, 5) else "math") for row in range(len(batch))
    ]
    training = TrainingConfig(micro_batch_size=3)
    teachers = {path: Teacher(ModelConfig(name_or_path=path), training, TEMPERATURE) for path in (a, b)}
    scored = score_with_teachers(batch, trajectories, teachers, config.distill)
    whole = {path: teacher.score(batch, K) for path, teacher in teachers.items()}
    for row, trajectory in enumerate(trajectories):
        expected = whole[a if trajectory.task == "code" else b]
        for got, want in zip(scored, expected):
            torch.testing.assert_close(got[row], want[row], atol=1e-5, rtol=0)
    assert not torch.allclose(whole[a][0], whole[b][0])  # the two teachers do differ


def test_the_reverse_kl_loss_is_grpos_surrogate_on_per_token_advantages_with_gradient_minus_a_over_n():
    """distill.loss=reverse_kl trains GRPO's loss on A_t = log pi_T - log pi_S (kl_coef 1). At the old policy
    (ratio 1, no clip) the token-mean surrogate is -(1/N) sum_t A_t r_t, so d loss / d logp_t = -A_t / N.
    Tokens (mask [0, 1, 1, 1]): teacher [0, -0.5, -2, -0.1], student [0, -1, -0.5, -0.1]: A = [0, 0.5, -1.5, 0];
    N = 3: loss = -(0.5 - 1.5 + 0) / 3 = 1/3, gradient [0, -1/6, 1/2, 0]."""
    config = DistillRunConfig.model_validate({"distill": {"loss": "reverse_kl"}, "loss": {"kl_coef": 0.0}})
    batch = collate([Trajectory([5], [7, 8, 9], [0.0] * 3, False, 1.0, 0, "math")], [0.0], pad_token_id=0)
    student = torch.tensor([[0.0, -1.0, -0.5, -0.1]])
    batch.old_logprobs = student
    batch.advantages = reverse_kl_advantages(torch.tensor([[0.0, -0.5, -2.0, -0.1]]), student, batch.loss_mask)
    logprobs = student.clone().requires_grad_(True)
    loss, metrics = make_loss_fn(config)(logprobs, batch, Normalisers(num_tokens=3, num_sequences=1))
    loss.backward()
    assert loss.item() == pytest.approx(1 / 3)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -1 / 6, 0.5, 0.0]]))
    assert metrics["clip_fraction"].item() == 0.0
