"""`reinforge env score`: real GSM8K and MATH-500 answers scored offline by the math environment."""

import json
import subprocess
import sys
from pathlib import Path

from reinforge.data.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "data" / "benchmarks"


def reinforge(*args):
    return subprocess.run(
        [sys.executable, "-m", "reinforge.cli", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def assert_one_line_error(result, pattern):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reinforge: error: "), result.stderr
    assert pattern in lines[0]


def scoring_records() -> tuple[list[dict], list[float]]:
    """Records with gold and wrong responses, and the reward each must get.

    GSM8K: the published worked solution (ends in `#### 18`) scores 1; "... 19 dollars" scores 0;
    the question goes in `prompt`. MATH-500: the published solution (ends in `\\boxed{answer}`)
    scores 1; boxing the next record's answer scores 0; the problem goes in `messages`.
    """
    records, expected = [], []
    for record in read_jsonl(BENCHMARKS / "gsm8k" / "test.jsonl")[:3]:
        answer = record["answer"].split("####")[-1].strip()
        records.append({"prompt": record["question"], "response": record["answer"], "answer": answer})
        records.append(
            {"prompt": record["question"], "response": f"So she makes {int(answer) + 1} dollars.", "answer": answer}
        )
        expected += [1.0, 0.0]
    math500 = read_jsonl(BENCHMARKS / "math500" / "test.jsonl")[:3]
    for record, following in zip(math500, math500[1:]):
        messages = [{"role": "user", "content": record["problem"]}]
        records.append(
            {
                "messages": messages,
                "response": record["solution"],
                "answer": record["answer"],
                "id": record["unique_id"],
            }
        )
        records.append(
            {"messages": messages, "response": f"\\boxed{{{following['answer']}}}", "answer": record["answer"]}
        )
        expected += [1.0, 0.0]
    return records, expected


def test_score_writes_each_record_back_with_its_reward_and_prints_the_mean(tmp_path):
    records, expected = scoring_records()
    source, scored = tmp_path / "answers.jsonl", tmp_path / "out" / "scored.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in records))

    result = reinforge(
        "env", "score", "--env", "math", "--input", source, "--output", scored, "--batch-size", 3, "math.timeout_s=3"
    )

    assert result.returncode == 0, result.stderr
    assert f"mean reward 0.5000 over 10 records; wrote {scored}" in result.stdout
    written = read_jsonl(scored)
    assert [r["reward"] for r in written] == expected == [1.0, 0.0] * 5
    assert written == [{**record, "reward": reward, "components": {}} for record, reward in zip(records, expected)]


def test_bad_input_is_a_one_line_error_with_exit_code_2(tmp_path):
    missing = tmp_path / "missing.jsonl"
    assert_one_line_error(
        reinforge("env", "score", "--env", "math", "--input", missing, "--output", tmp_path / "o.jsonl"),
        f"input file {missing} does not exist",
    )

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"response": "4", "answer": "4"}\n{"response": "5", \n')
    assert_one_line_error(
        reinforge("env", "score", "--env", "math", "--input", bad_json, "--output", tmp_path / "o.jsonl"),
        f"{bad_json}:2: malformed JSON",
    )

    no_response = tmp_path / "no_response.jsonl"
    no_response.write_text('{"response": "4", "answer": "4"}\n{"answer": "5"}\n')
    assert_one_line_error(
        reinforge("env", "score", "--env", "math", "--input", no_response, "--output", tmp_path / "o.jsonl"),
        f"{no_response}:2: record has no response field",
    )

    good = tmp_path / "good.jsonl"
    good.write_text('{"response": "4", "answer": "4"}\n')
    assert_one_line_error(
        reinforge("env", "score", "--env", "maths", "--input", good, "--output", tmp_path / "o.jsonl"),
        "unknown environment 'maths'; built-in environments: math",
    )
    assert_one_line_error(
        reinforge("env", "score", "--env", "math", "--input", good, "--output", tmp_path / "o.jsonl", "math.timeout=3"),
        "did you mean env.math.timeout_s?",
    )
    assert not (tmp_path / "o.jsonl").exists()
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text('{"response": "4"}\n')
    assert_one_line_error(
        reinforge("env", "score", "--env", "math", "--input", no_answer, "--output", tmp_path / "o.jsonl"),
        "MathEnv needs an 'answer' in each record",
    )
    assert not (tmp_path / "o.jsonl").exists()


def test_serving_beyond_loopback_needs_an_explicit_flag():
    result = reinforge("env", "serve", "--env", "math", "--host", "0.0.0.0", "--port", 1)
    assert_one_line_error(result, "--host 0.0.0.0 is not a loopback address; pass --allow-remote")
