"""The custom environment of docs/environments.md, exactly as printed there, works as documented."""

import json
import os
import re
import subprocess
import sys

from reinforge.paths import PROJECT_ROOT


def doc_example(tmp_path):
    text = (PROJECT_ROOT / "docs" / "environments.md").read_text()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if "class WordLimitEnv" in block]
    (tmp_path / "word_limit_env.py").write_text(code)
    return dict(os.environ, PYTHONPATH=str(tmp_path))


def test_the_documented_environment_scores_a_file_through_env_score(tmp_path):
    env = doc_example(tmp_path)
    records = [
        {"response": "short answer", "max_words": 3},
        {"response": "a much too long answer here", "max_words": 3},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "reinforge.cli",
            "env",
            "score",
            "--env",
            "word_limit_env:WordLimitEnv",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out.jsonl"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    scored = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in scored] == [1.0, 0.0]
    assert "0.5" in result.stdout


def test_a_custom_task_is_built_from_env_custom_and_a_bad_path_is_one_line(tmp_path):
    env = doc_example(tmp_path)
    script = (
        "from reinforge.algorithms.grpo_config import load_config\n"
        "from reinforge.envs.registry import build_envs, check_tasks\n"
        "config = load_config(None, ['env.custom.brief=word_limit_env:WordLimitEnv'])\n"
        "check_tasks({'brief', 'math'}, config.env)\n"
        "envs = build_envs(config.env, {'brief'})\n"
        "print(type(envs['brief']).__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "WordLimitEnv", result.stderr
    (tmp_path / "one.jsonl").write_text(json.dumps({"response": "x", "max_words": 1}) + "\n")
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "reinforge.cli",
            "env",
            "score",
            "--env",
            "word_limit_env:Nope",
            "--input",
            str(tmp_path / "one.jsonl"),
            "--output",
            str(tmp_path / "o.jsonl"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "word_limit_env:Nope" in bad.stderr, bad.stderr
