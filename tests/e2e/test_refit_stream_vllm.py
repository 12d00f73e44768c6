"""The refit check as a refit streams it, on the real vLLM engine (each in a fresh process: vLLM sets up
process-wide state): the engine's layout fetched once without hashing, the expected digests built decoder layer by
decoder layer from the checkpoint-layout tensors, a sample of each weight's columns on both sides. It agrees with the
whole-dict check on a correct refit and on a planted skipped weight (the same line). Two tensor-parallel workers:
tests/e2e/test_weight_wire.py."""

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


def stream_refits(out) -> None:
    import json
    from contextlib import ExitStack

    from reinforge.generation.vllm_backend import VLLMGenerationBackend
    from reinforge.loops.builders import build_trainer, vllm_engine_kwargs

    config = load_config(DEMO, [*SMALL, *VLLM])
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
        # the refit silently drops one tensor
        engine.update_weights((n, t) for n, t in trainer.named_weights() if "layers.1.self_attn.k_proj.w" not in n)
        outcomes["planted"] = [streamed(engine, trainer, layouts, step=2), whole(engine, trainer)]
        engine.shutdown()
    out.write_text(json.dumps(outcomes))


@pytest.mark.xdist_group("ray")
def test_the_streamed_check_agrees_with_the_whole_dict_check_on_vllm(tmp_path):
    outcomes = run_in_fresh_process(stream_refits, out=tmp_path / "outcomes.json")
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
