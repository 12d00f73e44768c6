"""Which environments' counters a step logs (`env/{task}/*`): those that scored something in it."""

from reinforge.algorithms.step_metrics import env_metrics, scored_tasks
from reinforge.envs.base import EnvRequest
from reinforge.envs.registry import EnvConfig, build_envs


def test_only_the_environments_that_scored_log_their_counters_and_every_counter_is_reset():
    """math scores one answerless reply (no_answer 1); format scores nothing and logs nothing; under agents,
    which score their own episodes, no environment scored."""
    envs = build_envs(EnvConfig(), {"math", "format"})
    try:
        envs["math"].step([EnvRequest([{"role": "assistant", "content": "no idea"}], {"answer": "3"})])
        scored = scored_tasks({"math"}, "reinforge", {})
        assert scored == {"math"} and scored_tasks({"math"}, "agent", {}) == set()
        assert scored_tasks({"math"}, "reinforge", {"format": 0.5}) == {"math", "format"}
        metrics = env_metrics(envs, scored)
        assert metrics["env/math/no_answer"] == 1 and not any(name.startswith("env/format/") for name in metrics)
        assert env_metrics(envs, {"math"})["env/math/no_answer"] == 0  # read once, then reset
        assert env_metrics(envs, set()) == {}
    finally:
        for env in envs.values():
            env.close()
