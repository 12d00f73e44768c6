"""Malformed inputs to every CLI command, as a new user would give them: each ends with exit status 2, one
`reinforge: error:` line naming what is wrong, no traceback, and no run or output directory left behind.
(Permissions are not exercised: the tests run as root, whom a read-only mode does not stop.)"""

import json

import pytest

from reinforge.cli import main
from reinforge.paths import PROJECT_ROOT

CONFIGS = PROJECT_ROOT / "configs"
BAD_FILES = [
    "latin1.jsonl",
    "empty.jsonl",
    "broken.jsonl",
    "list.jsonl",
    "number_prompt.jsonl",
    "chat_string.jsonl",
    "pair_number.jsonl",
    "pairs_broken.jsonl",
    "latin1.yaml",
    "recipe_latin1.yaml",
    "a_file",
    "run_latin1",
    "answers.jsonl",
    "no_answer.jsonl",
    "no_tokenizer",
    "no_weights",
]
LATIN1 = '{"prompt": "caf\xe9 costs 3 dollars", "answer": "3"}\n'.encode("latin-1")  # not UTF-8


@pytest.fixture
def files(tmp_path):
    """Bad files of each kind, and a regular file where a directory is expected."""
    (tmp_path / "latin1.jsonl").write_bytes(LATIN1)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": \n')
    (tmp_path / "list.jsonl").write_text('["not", "an", "object"]\n')
    (tmp_path / "number_prompt.jsonl").write_text('{"prompt": 123, "answer": "2"}\n')
    (tmp_path / "chat_string.jsonl").write_text('{"messages": "hi"}\n')
    (tmp_path / "pair_number.jsonl").write_text('{"prompt": "hi", "chosen": 1, "rejected": "b"}\n')
    (tmp_path / "pairs_broken.jsonl").write_text('{"prompt": "hi", "chosen": "a"\n')
    (tmp_path / "latin1.yaml").write_bytes(b"seed: 0\n# caf\xe9\n")
    (tmp_path / "recipe_latin1.yaml").write_bytes(b"stages:\n  - name: caf\xe9\n")
    (tmp_path / "a_file").write_text("")
    (tmp_path / "run_latin1").mkdir()
    (tmp_path / "run_latin1" / "metrics.jsonl").write_bytes(b'{"step": 0, "note": "caf\xe9"}\n')
    (tmp_path / "answers.jsonl").write_text(json.dumps({"prompt": "1+1?", "answer": "2", "response": "2"}) + "\n")
    (tmp_path / "no_answer.jsonl").write_text(json.dumps({"prompt": "1+1?"}) + "\n")
    demo = PROJECT_ROOT / "models" / "demo"
    for name, files in (("no_tokenizer", ["config.json"]), ("no_weights", ["config.json", "tokenizer.json"])):
        (tmp_path / name).mkdir()
        for file in files + (["tokenizer_config.json"] if name == "no_weights" else []):
            (tmp_path / name / file).write_bytes((demo / file).read_bytes())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(BAD_FILES)
    return tmp_path


def grpo(*overrides):
    return ["grpo", "--config", str(CONFIGS / "grpo_demo.yaml"), *overrides]


TWO_RANKS_TP = ["training.backend=fsdp2", "training.num_workers=2", "training.parallel.tp=2"]
CASES = {
    "grpo: a prompt file that is not UTF-8": (
        lambda d: grpo(f"data.train_path={d}/latin1.jsonl"),
        "latin1.jsonl:1: not UTF-8 text",
    ),
    "grpo: an empty prompt file": (lambda d: grpo(f"data.train_path={d}/empty.jsonl"), "holds no records"),
    "grpo: a malformed JSONL line": (
        lambda d: grpo(f"data.train_path={d}/broken.jsonl"),
        "broken.jsonl:2: malformed JSON",
    ),
    "grpo: a line that is not an object": (
        lambda d: grpo(f"data.train_path={d}/list.jsonl"),
        "expected a JSON object per line",
    ),
    "grpo: a prompt of the wrong type": (
        lambda d: grpo(f"data.train_path={d}/number_prompt.jsonl"),
        "prompt must be a string",
    ),
    "sft: messages of the wrong type": (
        lambda d: ["sft", "--config", str(CONFIGS / "sft_demo.yaml"), f"data.train_path={d}/chat_string.jsonl"],
        "`messages` must be a list",
    ),
    "dpo: a reply of the wrong type": (
        lambda d: ["dpo", "--config", str(CONFIGS / "dpo_demo.yaml"), f"data.train_path={d}/pair_number.jsonl"],
        "must be strings",
    ),
    "grpo: a run directory below a file": (
        lambda d: grpo(f"logging.run_dir={d}/a_file/run"),
        "cannot create the run directory",
    ),
    "grpo: a config file that is not UTF-8": (
        lambda d: ["grpo", "--config", f"{d}/latin1.yaml"],
        "latin1.yaml is not UTF-8 text",
    ),
    "grpo: a missing config file": (lambda d: ["grpo", "--config", f"{d}/none.yaml"], "none.yaml"),
    "grpo: a value of the wrong type": (lambda d: grpo("loop.max_steps=many"), "loop.max_steps"),
    "grpo: an unknown key": (lambda d: grpo("grpo.max_stepz=3"), "did you mean loop.max_steps"),
    "grpo: an unknown value": (lambda d: grpo("generation.backend=tgi"), "generation.backend"),
    "grpo: prompts longer than the model's context": (
        lambda d: grpo("data.max_prompt_tokens=8192"),
        "exceeds the model's max_position_embeddings=2048",
    ),
    "sft: chats longer than the model's context": (
        lambda d: [
            "sft",
            "--config",
            str(CONFIGS / "sft_demo.yaml"),
            "data.max_seq_len=4096",
            "training.micro_batch_tokens=4096",
        ],
        "data.max_seq_len=4096 exceeds the model's max_position_embeddings=2048",
    ),
    "dpo: pairs longer than the model's context": (
        lambda d: ["dpo", "--config", str(CONFIGS / "dpo_demo.yaml"), "data.max_length=4096"],
        "data.max_length=4096 exceeds the model's max_position_embeddings=2048",
    ),
    "rm: pairs longer than the model's context": (
        lambda d: ["rm", "--config", str(CONFIGS / "rm_demo.yaml"), "data.max_length=4096"],
        "data.max_length=4096 exceeds the model's max_position_embeddings=2048",
    ),
    "grpo: a math record without its answer": (
        lambda d: grpo(f"data.train_path={d}/no_answer.jsonl"),
        "a record of task math has no 'answer'",
    ),
    "grpo: a model directory without a tokenizer": (
        lambda d: grpo(f"model.name_or_path={d}/no_tokenizer"),
        "no_tokenizer has no tokenizer",
    ),
    "grpo: a model directory without weights": (
        lambda d: grpo(f"model.name_or_path={d}/no_weights"),
        "no_weights holds no weights",
    ),
    "eval: a model directory without weights": (
        lambda d: ["eval", "--model", f"{d}/no_weights", "--benchmark", "gsm8k", "--k", "1", "--limit", "1"],
        "no_weights holds no weights",
    ),
    "grpo: an agent whose module does not import": (
        lambda d: ["grpo", "--config", str(CONFIGS / "grpo_agent_demo.yaml"), "agent.python.simple=no_such_mod:run"],
        "agent 'no_such_mod:run': cannot import it (No module named 'no_such_mod')",
    ),
    "grpo: an agent module without that function": (
        lambda d: ["grpo", "--config", str(CONFIGS / "grpo_agent_demo.yaml"), "agent.python.simple=json:no_such"],
        "agent 'json:no_such': cannot import it",
    ),
    "sft: a chat file that is not UTF-8": (
        lambda d: ["sft", "--config", str(CONFIGS / "sft_demo.yaml"), f"data.train_path={d}/latin1.jsonl"],
        "latin1.jsonl:1: not UTF-8 text",
    ),
    "dpo: a pair file that is not UTF-8": (
        lambda d: ["dpo", "--config", str(CONFIGS / "dpo_demo.yaml"), f"data.train_path={d}/latin1.jsonl"],
        "latin1.jsonl:1: not UTF-8 text",
    ),
    "rm: a malformed pair line": (
        lambda d: ["rm", "--config", str(CONFIGS / "rm_demo.yaml"), f"data.train_path={d}/pairs_broken.jsonl"],
        "pairs_broken.jsonl:1: malformed JSON",
    ),
    "recipe: a recipe file that is not UTF-8": (
        lambda d: ["recipe", f"{d}/recipe_latin1.yaml"],
        "recipe_latin1.yaml is not UTF-8 text",
    ),
    "curriculum prefilter: prompts not UTF-8": (
        lambda d: [
            "curriculum",
            "prefilter",
            "--config",
            str(CONFIGS / "grpo_demo.yaml"),
            "--output",
            f"{d}/run",
            f"data.train_path={d}/latin1.jsonl",
        ],
        "not UTF-8 text",
    ),
    "eval: an output directory below a file": (
        lambda d: [
            "eval",
            "--model",
            "models/demo",
            "--benchmark",
            "gsm8k",
            "--k",
            "1",
            "--limit",
            "2",
            "--backend",
            "hf",
            "--output",
            f"{d}/a_file/out",
        ],
        "a_file is a file, not a directory",
    ),
    "eval: a model that does not exist": (
        lambda d: ["eval", "--model", f"{d}/no_model", "--benchmark", "gsm8k", "--k", "1"],
        "no_model",
    ),
    "env score: answers that are not UTF-8": (
        lambda d: ["env", "score", "--env", "math", "--input", f"{d}/latin1.jsonl", "--output", f"{d}/run/out.jsonl"],
        "latin1.jsonl:1: not UTF-8 text",
    ),
    "env score: an output below a file": (
        lambda d: [
            "env",
            "score",
            "--env",
            "math",
            "--input",
            f"{d}/answers.jsonl",
            "--output",
            f"{d}/a_file/out.jsonl",
        ],
        "a_file",
    ),
    "report: metrics that are not UTF-8": (lambda d: ["report", f"{d}/run_latin1"], "metrics.jsonl:1: not UTF-8 text"),
    "report: a directory without a run": (lambda d: ["report", f"{d}/a_file"], "metrics.jsonl does not exist"),
    "grpo: LoRA's dropout under tensor parallelism (the ranks' refusal, before them)": (
        lambda d: grpo(*TWO_RANKS_TP, "model.lora.rank=4", "model.lora.dropout=0.1"),
        "model.lora.dropout=0.1 with training.parallel.tp=2",
    ),
    "convert: a directory that is no checkpoint": (
        lambda d: ["convert", f"{d}/run_latin1", "--output", f"{d}/run"],
        "is not a complete reinforge checkpoint",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_is_one_error_line_and_leaves_no_directory(case, files, capsys):
    make_args, message = CASES[case]
    args = make_args(files)
    if args[0] in ("grpo", "sft", "dpo", "rm") and not any(a.startswith("logging.run_dir=") for a in args):
        args.append(f"logging.run_dir={files}/run")
    if args[0] in ("grpo", "sft", "dpo", "rm"):  # in this process, not a supervised child started per case (the
        args.append("cluster.max_restarts=0")  # supervisor relays the same line: tests/e2e/test_cli.py)
    status = main(args)
    captured = capsys.readouterr()
    assert status == 2, (case, captured.err[-2000:])
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reinforge: error: ") and message in lines[0], (
        case,
        captured.err[-2000:],
    )
    assert "Traceback" not in captured.out + captured.err
    assert not (files / "run").exists(), case
    assert sorted(p.name for p in files.iterdir()) == sorted(BAD_FILES), case  # nothing made beside the bad files
