"""Refit verification (weight_digest.py, refit.py) on the real HF engine and torch trainer: a correct refit
passes, a refit that silently skips one parameter stops the run with one line naming it."""

from contextlib import ExitStack

import pytest
import torch

from reinforge.algorithms.grpo_config import load_config
from reinforge.data.batch import Trajectory, collate
from reinforge.errors import ConfigError
from reinforge.generation.hf import HFGenerationBackend
from reinforge.generation.weight_digest import RefitMismatch, WeightDigests, report, tensor_digest, verify
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

    def worker(rank, o_proj=None):
        q, k, v = (sent[f"m.attn.{p}_proj.weight"].chunk(2)[rank] for p in "qkv")
        columns = sent["m.attn.o_proj.weight"][:, 2 * rank : 2 * rank + 2]
        held = {
            "m.attn.qkv_proj.weight": torch.cat([q, k, v]),
            "m.attn.o_proj.weight": columns if o_proj is None else o_proj,
            "m.embed.weight": padded_vocab[4 * rank : 4 * rank + 4],
            "m.norm.weight": sent["m.norm.weight"],
        }
        return report(f"vllm engine (tensor-parallel worker {rank} of 2)", held.items(), packed, rank, 2)

    verify([worker(0), worker(1)], sent)
    wrong = sent["m.attn.o_proj.weight"][:, :2]  # worker 1 holding worker 0's columns
    with pytest.raises(RefitMismatch, match=r"worker 1 of 2\) does not serve the weights just sent: m.attn.o_proj"):
        verify([worker(0), worker(1, o_proj=wrong)], sent)
