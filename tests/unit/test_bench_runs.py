"""The training benchmarks run (checks that they run, not measurements: docs/benchmarks.md has those), and the
models they build are what they say."""

import json
import subprocess
import sys
from pathlib import Path

from reinforge.paths import PROJECT_ROOT


def run_bench(script, *args, timeout_s):
    completed = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=PROJECT_ROOT,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(Path(args[args.index("--json") + 1]).read_text())


def test_the_gpu_training_benchmark_runs_on_cpu_with_a_tiny_model(tmp_path):
    """bench/gpu_training_mfu.py is meant for a GPU; --tiny runs the same FSDP2 path on CPU (~7 s)."""
    result = run_bench(
        "gpu_training_mfu.py", "--tiny", "--steps", "1", "--json", str(tmp_path / "out.json"), timeout_s=120
    )
    assert result["median_step_s"] > 0 and result["train_step_flops"] > 0 and result["sequence_packing"]


def test_the_grown_30m_model_computes_the_demo_model_and_trains_every_weight(tmp_path):
    """bench/_common.py's grow_demo_model (the 30M model of bench/async_vs_sync.py): models/demo in MODEL_30M's
    shape; its logits equal the demo's, and after one optimizer step every one of its weights has a gradient."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(PROJECT_ROOT / "bench"))
    from _common import MODEL_30M, grow_demo_model

    grown = AutoModelForCausalLM.from_pretrained(grow_demo_model(tmp_path / "grown"))
    demo = AutoModelForCausalLM.from_pretrained(PROJECT_ROOT / "models" / "demo")
    assert grown.config.hidden_size == MODEL_30M["hidden_size"] > demo.config.hidden_size
    assert grown.config.num_hidden_layers == MODEL_30M["num_hidden_layers"] > demo.config.num_hidden_layers
    ids = torch.randint(3, demo.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(grown(ids).logits, demo(ids).logits, rtol=0, atol=1e-5)
    optimizer = torch.optim.AdamW(grown.parameters(), lr=1e-4)
    for step in range(2):
        optimizer.zero_grad()
        grown(ids, labels=ids).loss.backward()
        without = [name for name, weight in grown.named_parameters() if not weight.grad.abs().max() > 0]
        optimizer.step()
    assert not without, f"no gradient on the second step: {without}"


def test_the_fault_benchmarks_judge_scores_by_the_reference_and_its_proxy_answers_503_only_in_its_window(tmp_path):
    """bench/fault_servers.py: the deterministic judge behind the HTTP fault proxy (bench/faults.py's judge_http)."""
    import time

    import httpx

    sys.path[:0] = [str(PROJECT_ROOT / "bench"), str(PROJECT_ROOT / "tests" / "e2e")]
    from fault_servers import JudgeServer

    from reinforge.envs.judge_config import DEFAULT_PROMPT_TEMPLATE

    judge = JudgeServer(tmp_path)
    try:

        def verdict(response):
            rubric = DEFAULT_PROMPT_TEMPLATE.format(question="How many?", reference="48", response=response)
            body = {"model": "judge", "messages": [{"role": "user", "content": rubric}]}
            answer = httpx.post(f"{judge.proxy.url}/v1/chat/completions", json=body, timeout=10)
            return answer.status_code, answer.json()

        assert verdict("86 - 38 = 48")[1]["choices"][0]["message"]["content"].endswith("[[10]]")
        assert verdict("It is 47.\n\nDone")[1]["choices"][0]["message"]["content"].endswith("[[0]]")
        judge.proxy.fault("503", 0.5)
        assert verdict("48")[0] == 503 and judge.proxy.faulted == 1
        time.sleep(0.6)
        assert verdict("48")[0] == 200
        rows = [json.loads(line) for line in (tmp_path / "judge_train.jsonl").read_text().splitlines()]
        assert {row["task"] for row in rows} == {"judge"}
    finally:
        judge.close()
