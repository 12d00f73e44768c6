"""A judge that fails is infrastructure, not the policy's (rollout/infra.py, docs/reliability.md), on real
components: the demo model generating with the HF engine, and a real chat-completions judge (FastAPI under uvicorn,
on 127.0.0.1) that answers HTTP 503 to its first calls. The other infrastructure failures: test_infra_failures.py."""

import pytest
from test_infra_failures import DEMO, RECORDS, prompts_for, served_app

from reinforge.generation.base import SamplingParams
from reinforge.generation.hf import HFGenerationBackend
from reinforge.modeling import load_model, load_tokenizer
from reinforge.rollout.infra import InfraLimits
from reinforge.rollout.rollout import ReinforgeRollout, RolloutOptions


@pytest.fixture(scope="module")
def demo():
    tokenizer = load_tokenizer(DEMO)
    return tokenizer, HFGenerationBackend(load_model(DEMO), tokenizer, max_batch_size=64)


def counting_judge_app(failures: int):
    """A chat-completions judge whose first `failures` requests get HTTP 503; every later one says [[10]]."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app, seen = FastAPI(), []

    @app.post("/v1/chat/completions")
    def chat(body: dict):
        seen.append(body)
        if len(seen) <= failures:
            return JSONResponse({"error": "overloaded"}, status_code=503)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "[[10]]"}}]}

    return app


def test_a_judge_answering_503_leaves_the_rollout_going_with_its_samples_retried_masked_and_counted(demo):
    """8 episodes; the judge fails its first 10 calls (no retries of its own): the 8 first verdicts are infrastructure
    failures, run again; 2 of the re-runs fail again and are masked. Every sample kept scores the judge's real 1.0;
    none scores 0."""
    from reinforge.envs.judge import JudgeEnv, JudgeEnvConfig

    tokenizer, engine = demo
    with served_app(counting_judge_app(failures=10)) as url:
        judge = JudgeEnv(
            JudgeEnvConfig(
                mode="chat", url=f"{url}/v1", model="judge", prompt_template="{response}", max_retries=0, deadline_s=5
            )
        )
        limits = InfraLimits(max_retries=1, min_valid_per_group=2, max_failure_fraction=0.5)
        episodes = ReinforgeRollout(engine, tokenizer, {"math": judge}, RolloutOptions(default_task="math"), limits)
        params = SamplingParams(max_new_tokens=8, temperature=1.0, num_samples=4, seed=3)
        trajectories = episodes(prompts_for(tokenizer, RECORDS[:2]), params)
        metrics = episodes.metrics()
        judge_metrics = judge.metrics()
        judge.close()
    assert (metrics["rollout/infra_judge"], metrics["rollout/infra_retried"], metrics["rollout/infra_masked"]) == (
        10.0,
        8.0,
        2.0,
    )
    assert judge_metrics["judge_errors"] == 10.0
    kept = [t for t in trajectories if not t.excluded]
    assert len(kept) == 6 and all(t.reward == 1.0 and t.infra_failure is None for t in kept)
    for trajectory in trajectories:
        if trajectory.excluded:
            assert trajectory.infra_failure == "judge" and "HTTP 503" in trajectory.infra_error
