"""Refit verification (weight_digest.py, refit.py) on the real HF engine and torch trainer: a correct refit
passes, a refit that silently skips one parameter stops the run with one line naming it."""

from contextlib import ExitStack

import pytest
import torch

from reinforge.algorithms.grpo_config import load_config
from reinforge.data.batch import Trajectory, collate
from reinforge.errors import ConfigError
from reinforge.generation.hf import HFGenerationBackend
from reinforge.generation.weight_digest import (
    Expectation,
    RefitMismatch,
    WeightDigests,
    check,
    column_sample,
    report,
    tensor_digest,
    verify,
)
from reinforge.generation.weight_sources import in_engine_layout, source_tensor
from reinforge.logging.metrics import Timers
from reinforge.loops.builders import build_trainer
from reinforge.loops.refit import refit, verify_due
from reinforge.modeling import load_model, load_tokenizer
from reinforge.paths import PROJECT_ROOT

SKIPPED = "model.layers.1.mlp.up_proj.weight"


def one_step(trainer) -> None:
    """A real optimizer step: the loss pushes every trained token's logprob up."""
    gen = torch.Generator().manual_seed(0)
    trajectories = [
        Trajectory(*torch.randint(2, 64, (2, 5), generator=gen).tolist(), [0.0] * 5, False, 0.0, row, "math")
        for row in range(8)
    ]

    def loss_fn(logprobs_BT, micro, norm):
        return -(logprobs_BT * micro.loss_mask).sum() / norm.num_tokens, {}

    trainer.train_step(collate(trajectories, [1.0] * 8, pad_token_id=0), loss_fn)


@pytest.fixture
def setup(tmp_path):
    config = load_config(
        PROJECT_ROOT / "configs" / "grpo_demo.yaml",
        ["loss.kl_coef=0", "training.micro_batch_size=8", "training.global_batch_size=8", "optimizer.lr=1e-2"],
    )
    with ExitStack() as cleanup:
        trainer = build_trainer(config, cleanup)
        engine = HFGenerationBackend(load_model(config.model), load_tokenizer(config.model), max_batch_size=8)
        yield config, trainer, engine, tmp_path


def skip_one_parameter(engine, name: str) -> None:
    """Fault injection: the engine's refit keeps its old `name` and says nothing."""
    load = engine.update_weights
    engine.update_weights = lambda named: load(
        [(n, engine.model.state_dict()[n].clone() if n == name else t) for n, t in named]
    )


def test_a_correct_refit_after_an_optimizer_step_passes_and_is_timed(setup):
    config, trainer, engine, run_dir = setup
    before = engine.weight_digests()[0].digests
    one_step(trainer)
    timers = Timers()
    refit(engine, trainer, config, run_dir, step=1, timers=timers)
    after = engine.weight_digests()[0].digests
    changed = [name for name in after if after[name] != before[name]]
    assert SKIPPED in changed and len(changed) >= len(after) - 1  # the step really moved the weights
    assert timers.seconds["refit_verify"] > 0


def test_a_refit_that_skips_one_parameter_stops_naming_the_engine_and_the_parameter(setup):
    config, trainer, engine, run_dir = setup
    one_step(trainer)
    skip_one_parameter(engine, SKIPPED)
    with pytest.raises(RefitMismatch) as error:
        refit(engine, trainer, config, run_dir, step=1)
    assert str(error.value).startswith(f"refit check: hf engine does not serve the weights just sent: {SKIPPED} ")
    assert "\n" not in str(error.value)


def with_every(config, every: int):
    return config.model_copy(update={"generation": config.generation.model_copy(update={"verify_refit_every": every})})


def test_the_check_runs_every_nth_step_and_at_resume_and_never_with_0(setup):
    config, trainer, engine, run_dir = setup
    one_step(trainer)
    skip_one_parameter(engine, SKIPPED)
    refit(engine, trainer, with_every(config, 0), run_dir, step=1)  # off: the stale engine goes through
    refit(engine, trainer, with_every(config, 2), run_dir, step=3)  # not due
    with pytest.raises(RefitMismatch, match=SKIPPED):
        refit(engine, trainer, with_every(config, 2), run_dir, step=4)
    with pytest.raises(RefitMismatch, match=SKIPPED):
        refit(engine, trainer, with_every(config, 2), run_dir)  # at resume: always
    assert [verify_due(2, step) for step in (1, 2, 3, 4, None)] == [False, True, False, True, True]


def test_fused_and_padded_weights_map_into_the_engines_layout():
    """q (2 rows), k (1), v (1) concatenate to qkv in mapping order; a 3-row vocabulary pads to 4 with zeros."""
    q, k, v = torch.ones(2, 2), torch.full((1, 2), 2.0), torch.full((1, 2), 3.0)
    sent = {"m.attn.q_proj.weight": q, "m.attn.k_proj.weight": k, "m.attn.v_proj.weight": v}
    fused = source_tensor("m.attn.qkv_proj.weight", sent, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    assert fused.tolist() == [[1, 1], [1, 1], [2, 2], [3, 3]]
    padded = in_engine_layout(torch.ones(3, 2), (4, 2), "bfloat16")
    assert padded.dtype == torch.bfloat16 and padded.tolist() == [[1, 1], [1, 1], [1, 1], [0, 0]]
    assert tensor_digest(torch.tensor([-0.0])) == tensor_digest(torch.tensor([0.0]))
    assert tensor_digest(torch.tensor([1.0])) != tensor_digest(torch.tensor([1.0 + 2**-20]))


def test_an_engine_weight_the_refit_cannot_produce_stops_saying_so_and_a_negative_interval_is_refused():
    engine = WeightDigests("vllm engine", {"w": "x"}, {"w": (3,)}, {"w": "float32"})
    with pytest.raises(RefitMismatch, match=r"^refit check: cannot verify vllm engine: its w \[3\] has no counterpart"):
        verify([engine], {"w": torch.zeros(2, 2)})
    with pytest.raises(ConfigError, match="generation.verify_refit_every must be >= 0"):
        load_config(None, ["generation.verify_refit_every=-1"])


def test_each_tensor_parallel_worker_is_checked_against_its_own_shards():
    """Two workers hold vLLM's shards, built here by hand as vLLM lays them out: qkv fused per worker as
    [q_r, k_r, v_r], o_proj split by columns, a 5-row vocabulary padded to 8 and split into 4 + 4, a norm whole."""
    gen = torch.Generator().manual_seed(0)
    sent = {
        name: torch.randn(shape, generator=gen)
        for name, shape in {
            "m.attn.q_proj.weight": (4, 6),
            "m.attn.k_proj.weight": (2, 6),
            "m.attn.v_proj.weight": (2, 6),
            "m.attn.o_proj.weight": (6, 4),
            "m.embed.weight": (5, 6),
            "m.norm.weight": (6,),
        }.items()
    }
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    padded_vocab = torch.cat([sent["m.embed.weight"], torch.zeros(3, 6)])

    def worker(rank, o_proj=None, columns=0):
        q, k, v = (sent[f"m.attn.{p}_proj.weight"].chunk(2)[rank] for p in "qkv")
        own = sent["m.attn.o_proj.weight"][:, 2 * rank : 2 * rank + 2]
        held = {
            "m.attn.qkv_proj.weight": torch.cat([q, k, v]),
            "m.attn.o_proj.weight": own if o_proj is None else o_proj,
            "m.embed.weight": padded_vocab[4 * rank : 4 * rank + 4],
            "m.norm.weight": sent["m.norm.weight"],
        }
        name = f"vllm engine (tensor-parallel worker {rank} of 2)"
        return report(name, held.items(), packed, rank, 2, columns=columns, step=1)

    verify([worker(0), worker(1)], sent)
    wrong = sent["m.attn.o_proj.weight"][:, :2]  # worker 1 holding worker 0's columns
    with pytest.raises(RefitMismatch, match=r"worker 1 of 2\) does not serve the weights just sent: m.attn.o_proj"):
        verify([worker(0), worker(1, o_proj=wrong)], sent)
    # one column each at step 1: column 1 of each worker's qkv, vocabulary and norm (6 wide) and of its o_proj (2
    # wide: worker 1's is the sent column 3); the check takes the same columns of what it builds from the sent tensors
    verify([worker(0, columns=1), worker(1, columns=1)], sent, columns=1, step=1)
    swapped = sent["m.attn.o_proj.weight"][:, [3, 2]]  # the right columns in the wrong order: column 1 differs
    with pytest.raises(RefitMismatch, match=r"worker 1 of 2\) does not serve the weights just sent: m.attn.o_proj"):
        verify([worker(0, columns=1), worker(1, swapped, columns=1)], sent, columns=1, step=1)


def test_the_column_sample_by_hand_rotates_with_the_step_and_leaves_narrow_weights_whole():
    """100 columns, about 32 of them: every 4th (ceil(100 / 32)), from step mod 4; 4 steps cover all 100."""
    assert column_sample((7, 100), 32, 0) == slice(0, None, 4)
    assert list(range(100)[column_sample((7, 100), 32, 5)])[:3] == [1, 5, 9]
    assert len(range(100)[column_sample((100,), 32, 3)]) == 25
    covered = {c for step in range(4) for c in range(100)[column_sample((7, 100), 32, step)]}
    assert covered == set(range(100))
    assert (
        column_sample((7, 32), 32, 1) is None
        and column_sample((7, 100), 0, 1) is None
        and column_sample((), 32, 1) is None
    )
    weight = torch.randn(3, 100)
    touched = weight.clone()
    touched[:, 2] += 1  # column 2: covered at steps 2, 6, ... only
    digests = [
        report("e", [("w", w)], columns=32, step=step).digests["w"] for w in (weight, touched) for step in (1, 2)
    ]
    assert digests[0] == digests[2] and digests[1] != digests[3]
    assert report("e", [("w", weight)], columns=32, step=1).shapes["w"] == (3, 100)


def streamed_check(engine, trainer, columns: int, step: int) -> str:
    """The refit check as a refit streams it: the engine's layout once, the expected digests decoder layer by decoder
    layer (the trainer's `weight_parts`); "ok" or the RefitMismatch's line."""
    expectation = Expectation(engine.weight_layout(), columns, step)
    for part in range(len(trainer.weight_parts())):
        expectation.add(dict(trainer.named_weights(part)))
    try:
        check(engine.weight_digests(columns, step), expectation)
        return "ok"
    except RefitMismatch as error:
        return str(error)


def whole_check(engine, trainer) -> str:
    try:
        verify(engine.weight_digests(), dict(trainer.named_weights()))
        return "ok"
    except RefitMismatch as error:
        return str(error)


def test_the_streamed_sampled_check_agrees_with_the_whole_dict_check_on_the_hf_engine(setup):
    config, trainer, engine, run_dir = setup
    one_step(trainer)
    engine.update_weights(trainer.named_weights())
    assert streamed_check(engine, trainer, 8, step=3) == whole_check(engine, trainer) == "ok"
    skip_one_parameter(engine, SKIPPED)
    one_step(trainer)
    engine.update_weights(trainer.named_weights())
    message = whole_check(engine, trainer)
    assert message.startswith(f"refit check: hf engine does not serve the weights just sent: {SKIPPED} ")
    assert streamed_check(engine, trainer, 8, step=4) == message
    without_layer_1 = Expectation(engine.weight_layout(), 8, 4)
    without_layer_1.add({n: t for n, t in trainer.named_weights() if ".layers.1." not in n})
    with pytest.raises(RefitMismatch, match=r"cannot verify hf engine: its model.layers.1.\S+ \[\d+(, \d+)*\] has no"):
        check(engine.weight_digests(8, 4), without_layer_1)
