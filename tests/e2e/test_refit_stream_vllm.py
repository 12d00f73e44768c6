"""The refit check as a refit streams it, on the real vLLM engine (each in a fresh process: vLLM sets up
process-wide state): the engine's layout fetched once without hashing, the expected digests built decoder layer by
decoder layer from the checkpoint-layout tensors, a sample of each weight's columns on both sides. It agrees with the
whole-dict check on a correct refit and on a planted skipped weight (the same line), and with two tensor-parallel
workers it names the second worker when only its shard is stale."""

import os

import pytest

from reinforge.algorithms.grpo_config import load_config
from reinforge.paths import PROJECT_ROOT
from tests.e2e._fresh import run_in_fresh_process
from tests.e2e.test_refit_verify_vllm import SMALL, VLLM, attempt, one_step

DEMO = PROJECT_ROOT / "configs" / "grpo_demo.yaml"


def streamed(engine, trainer, layouts, step: int) -> str:
    """The check of a refit that sends the trainer's weights one decoder layer at a time (checkpoint layout)."""
    from reinforge.generation.checkpoint_layout import checkpoint_layout
    from reinforge.generation.weight_digest import Expectation, check

    expectation = Expectation(layouts, columns=32, step=step)
    for part in range(len(trainer.weight_parts())):
        expectation.add(checkpoint_layout(engine.model_path, trainer.named_weights(part), drop=engine.untied_names))
    return attempt(lambda: check(engine.weight_digests(32, step), expectation))


def whole(engine, trainer) -> str:
    from reinforge.generation.weight_digest import verify

    return attempt(lambda: verify(engine.weight_digests(), dict(trainer.named_weights())))


def keep_stale_embedding(worker, stash: bool) -> None:
    """Run in each engine worker: worker 1 keeps (stash) and puts back its shard of the embedding, as a refit that
    skipped that shard would leave it."""
    from vllm.distributed import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != 1:
        return
    param = dict(worker.model_runner.get_model().named_parameters())["model.embed_tokens.weight"]
    if stash:
        worker.stale_embedding = param.detach().clone()
    else:
        param.data.copy_(worker.stale_embedding)


def stream_refits(tp: int, out) -> None:
    import json
    from contextlib import ExitStack

    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    from reinforge.generation.vllm_backend import VLLMGenerationBackend
    from reinforge.loops.builders import build_trainer, vllm_engine_kwargs

    config = load_config(DEMO, [*SMALL, *VLLM, f"generation.vllm.tensor_parallel_size={tp}"])
    outcomes = {}
    with ExitStack() as cleanup:
        trainer = build_trainer(config, cleanup)
        engine = VLLMGenerationBackend(**vllm_engine_kwargs(config))
        layouts = engine.weight_layout()
        outcomes["layout digests"] = sum(len(layout.digests) for layout in layouts)
        one_step(trainer, seed=1)
        engine.update_weights(trainer.named_weights())
        outcomes["correct"] = [streamed(engine, trainer, layouts, step=1), whole(engine, trainer)]
        one_step(trainer, seed=2)
        if tp == 1:  # the refit silently drops one tensor
            engine.update_weights((n, t) for n, t in trainer.named_weights() if "layers.1.self_attn.k_proj.w" not in n)
        else:  # worker 1 keeps its old shard of the embedding
            engine.llm.collective_rpc(keep_stale_embedding, args=(True,))
            engine.update_weights(trainer.named_weights())
            engine.llm.collective_rpc(keep_stale_embedding, args=(False,))
        outcomes["planted"] = [streamed(engine, trainer, layouts, step=2), whole(engine, trainer)]
        engine.shutdown()
    out.write_text(json.dumps(outcomes))


@pytest.mark.xdist_group("ray")
def test_the_streamed_check_agrees_with_the_whole_dict_check_on_vllm(tmp_path):
    outcomes = run_in_fresh_process(stream_refits, 1, out=tmp_path / "outcomes.json")
    assert outcomes["layout digests"] == 0 and outcomes["correct"] == ["ok", "ok"]
    assert (
        outcomes["planted"]
        == [
            "refit check: vllm engine does not serve the weights just sent: model.layers.1.self_attn.qkv_proj.weight "
            "(fused from q_proj, k_proj, v_proj) differs (stale or wrongly loaded); the run stops rather than train "
            "off-policy"
        ]
        * 2
    )


@pytest.mark.xdist_group("ray")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two tensor-parallel CPU workers need two cores")
def test_a_stale_shard_of_the_second_tensor_parallel_worker_is_named(tmp_path):
    outcomes = run_in_fresh_process(stream_refits, 2, out=tmp_path / "outcomes.json")
    assert outcomes["correct"] == ["ok", "ok"]
    assert (
        outcomes["planted"]
        == [
            "refit check: vllm engine (tensor-parallel worker 1 of 2) does not serve the weights just sent: "
            "model.embed_tokens.weight differs (stale or wrongly loaded); the run stops rather than train off-policy"
        ]
        * 2
    )
