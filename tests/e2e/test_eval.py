"""`reinforge eval` as a user runs it: the demo model on GSM8K and HumanEval (in the code sandbox), with
the HF and the vLLM engines; and each benchmark's records scored by the real environments."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reinforge.cli import main
from reinforge.envs.base import EnvRequest
from reinforge.envs.registry import EnvConfig, build_envs
from reinforge.errors import ReinforgeError
from reinforge.evaluation.benchmarks import MATH_SUFFIX, load_benchmark
from reinforge.evaluation.evaluate import evaluate, resolve_model
from reinforge.evaluation.metrics import pass_at_k
from reinforge.model_config import ModelConfig

# One xdist worker runs every test that starts sandboxes in turn: some count the live sandbox processes
# (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("sandbox")

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--max-new-tokens", "16"]  # the demo model never answers these benchmarks right: keep the run short


def reinforge(*args):
    return subprocess.run(
        [sys.executable, "-m", "reinforge.cli", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def here(capsys, *args) -> subprocess.CompletedProcess:
    """`reinforge` through cli.main in this process (no interpreter start-up), as a finished command."""
    status = main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, captured.out, captured.err)


def read_outputs(directory: Path):
    summary = json.loads((directory / "summary.json").read_text())
    samples = [json.loads(line) for line in (directory / "samples.jsonl").read_text().splitlines()]
    return summary, samples


def assert_metrics_match_samples(summary, samples, n, k):
    """pass@1, pass@k and the mean accuracy recomputed from samples.jsonl, n samples per prompt in order."""
    groups = [samples[i : i + n] for i in range(0, len(samples), n)]
    assert [[s["sample_index"] for s in group] for group in groups] == [list(range(n))] * len(groups)
    assert all(len({s["prompt_id"] for s in group}) == 1 for group in groups)
    for name, kk in (("pass@1", 1), (f"pass@{k}", k)):
        expected = sum(pass_at_k(n, sum(s["correct"] for s in group), kk) for group in groups) / len(groups)
        assert summary[name] == pytest.approx(expected)
    assert summary["mean_accuracy"] == pytest.approx(sum(s["reward"] for s in samples) / len(samples))


def test_gsm8k_with_hf_writes_pass_at_1_and_pass_at_4_and_every_sample(tmp_path):
    result = reinforge(
        "eval",
        "--model",
        "models/demo",
        "--benchmark",
        "gsm8k",
        "--k",
        4,
        "--limit",
        20,
        "--backend",
        "hf",
        "--output",
        tmp_path / "gsm8k",
        *SHORT,
    )
    assert result.returncode == 0, result.stderr
    summary, samples = read_outputs(tmp_path / "gsm8k")
    assert summary["benchmark"] == "gsm8k" and summary["num_prompts"] == 20 and summary["num_samples_per_prompt"] == 4
    assert summary["temperature"] == 0.6 and summary["backend"] == "hf"
    assert {"pass@1", "pass@4", "maj@4", "mean_accuracy"} <= set(summary) and summary["maj@4"] is not None
    assert len(samples) == 80 and samples[0]["prompt_id"] == "gsm8k/0" and samples[0]["gold_answer"] == "18"
    assert_metrics_match_samples(summary, samples, n=4, k=4)
    assert summary["timing"]["generate_s"] > 0


def test_humaneval_samples_run_in_the_code_sandbox(tmp_path):
    result = reinforge(
        "eval",
        "--model",
        "models/demo",
        "--benchmark",
        "humaneval",
        "--k",
        1,
        "--n",
        2,
        "--limit",
        2,
        "--backend",
        "hf",
        "--output",
        tmp_path / "humaneval",
        *SHORT,
    )
    assert result.returncode == 0, result.stderr
    summary, samples = read_outputs(tmp_path / "humaneval")
    assert summary["env"]["samples"] == 4 and summary["env"]["sandbox_errors"] == 0  # every sample was run
    assert summary["env"]["run_s_mean"] > 0
    assert summary["maj@1"] is None  # nothing to vote on in code
    assert [s["prompt_id"] for s in samples[::2]] == ["HumanEval/0", "HumanEval/1"]
    assert all("pass_fraction" in s["components"] for s in samples)
    assert_metrics_match_samples(summary, samples, n=2, k=1)


def test_gsm8k_with_vllm_writes_the_same_outputs(tmp_path):
    result = reinforge(
        "eval",
        "--model",
        "models/demo",
        "--benchmark",
        "gsm8k",
        "--k",
        2,
        "--limit",
        4,
        "--backend",
        "vllm",
        "--output",
        tmp_path / "vllm",
        *SHORT,
    )
    assert result.returncode == 0, result.stderr
    summary, samples = read_outputs(tmp_path / "vllm")
    assert summary["backend"] == "vllm" and len(samples) == 8
    assert all(0 < s["num_response_tokens"] <= 16 for s in samples)
    assert_metrics_match_samples(summary, samples, n=2, k=2)


def assert_one_line_error(result, pattern):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reinforge: error: ") and pattern in lines[0], result.stderr


def test_unknown_benchmark_is_a_one_line_error(tmp_path, capsys):
    result = here(
        capsys,
        "eval",
        "--model",
        ROOT / "models" / "demo",
        "--benchmark",
        "gsm9k",
        "--k",
        1,
        "--output",
        tmp_path / "out",
    )
    assert_one_line_error(result, "unknown benchmark 'gsm9k'; choose one of gsm8k, math500")
    assert not (tmp_path / "out").exists()


def test_missing_model_path_is_a_one_line_error(tmp_path, capsys):
    result = here(
        capsys, "eval", "--model", tmp_path / "no_model", "--benchmark", "gsm8k", "--k", 1, "--output", tmp_path / "out"
    )
    assert_one_line_error(result, "no such directory")
    assert not (tmp_path / "out").exists()


def test_fewer_samples_than_k_is_refused_before_loading_anything():
    with pytest.raises(ReinforgeError, match="need 1 <= k <= n, got k=4, n=2"):
        evaluate(ModelConfig(name_or_path="models/demo"), "gsm8k", k=4, num_samples=2)


# ---- the benchmark records, scored by the real environments -------------------------------------------------


@pytest.fixture(scope="module")
def envs():
    envs = build_envs(EnvConfig(), {"math", "code", "ifeval"})
    yield envs
    for env in envs.values():
        env.close()


def rewards(env, items, responses):
    requests = [
        EnvRequest(
            messages=[{"role": "user", "content": item.prompt}, {"role": "assistant", "content": response}],
            record=item.record,
        )
        for item, response in zip(items, responses)
    ]
    return [response.reward for response in env.step(requests)]


@pytest.mark.parametrize("name", ["gsm8k", "math500", "aime2024", "aime2025"])
def test_math_benchmarks_score_their_boxed_gold_answer_one_and_ask_for_a_box(envs, name):
    items = load_benchmark(name, limit=5)
    assert all(item.prompt.endswith(MATH_SUFFIX) for item in items)
    assert (
        rewards(envs["math"], items, [f"So the answer is \\boxed{{{item.record['answer']}}}." for item in items])
        == [1.0] * 5
    )
    assert rewards(envs["math"], items, ["The answer is \\boxed{100001}."] * 5) == [0.0] * 5


def test_humaneval_canonical_solutions_score_one_in_the_sandbox(envs):
    rows = [
        json.loads(line) for line in (ROOT / "data/benchmarks/humaneval/HumanEval.jsonl").read_text().splitlines()[:4]
    ]
    items = load_benchmark("humaneval", limit=4)
    assert all(row["prompt"].rstrip() in item.prompt and "```python" in item.prompt for row, item in zip(rows, items))
    whole_function = [f"```python\n{row['prompt']}{row['canonical_solution']}```" for row in rows]
    assert rewards(envs["code"], items, whole_function) == [1.0] * 4
    assert rewards(envs["code"], items, ["```python\n    return None\n```"] * 4) == [0.0] * 4


def test_mbpp_reference_code_scores_one_and_the_prompt_shows_only_the_first_test(envs):
    rows = json.loads((ROOT / "data/benchmarks/mbpp/sanitized-mbpp.json").read_text())[:4]
    items = load_benchmark("mbpp", limit=4)
    assert all(
        row["test_list"][0] in item.prompt and row["test_list"][1] not in item.prompt for row, item in zip(rows, items)
    )
    assert rewards(envs["code"], items, [f"```python\n{row['code']}\n```" for row in rows]) == [1.0] * 4


def test_ifeval_records_are_scored_by_their_instructions(envs):
    item = next(
        item
        for item in load_benchmark("ifeval", limit=5)
        if item.record["instruction_id_list"] == ["punctuation:no_comma"]
    )
    assert rewards(
        envs["ifeval"], [item, item], ["Hark a journey to Kyoto awaits thee.", "Hark, a journey awaits."]
    ) == [1.0, 0.0]


def test_a_run_directory_is_evaluated_through_its_final_model(tmp_path):
    (tmp_path / "run" / "final").mkdir(parents=True)
    (tmp_path / "run" / "final" / "config.json").write_text("{}")
    assert resolve_model(ModelConfig(name_or_path=str(tmp_path / "run"))).name_or_path == str(
        tmp_path / "run" / "final"
    )
    assert (
        Path(resolve_model(ModelConfig(name_or_path="models/demo")).name_or_path).resolve() == ROOT / "models" / "demo"
    )


def test_a_training_checkpoint_is_refused_with_a_pointer_to_final(tmp_path):
    (tmp_path / "step_00000010").mkdir()
    (tmp_path / "step_00000010" / "COMPLETE").write_text("{}")
    with pytest.raises(ReinforgeError, match="evaluate the run's final/ directory"):
        resolve_model(ModelConfig(name_or_path=str(tmp_path / "step_00000010")))
