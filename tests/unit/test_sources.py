"""The one data loader (data/sources.py) on files written by the real `datasets` library: every format gives the
same records in the same order, streamed or not; columns are renamed; bad rows and missing columns are one line
naming where."""

import json
import os
import subprocess
import sys

import datasets
import pytest
from PIL import Image

from reinforge.data.images import load_image
from reinforge.data.preference import read_preference_records
from reinforge.data.sources import ColumnsConfig, Source, SourceConfig
from reinforge.errors import DataError, ReinforgeError
from reinforge.evaluation.benchmarks import load_benchmark
from reinforge.paths import PROJECT_ROOT

RECORDS = [
    {"question": "What is 2 + 3?", "solution": "5", "task": "math"},
    {"question": "What is 7 * 6?", "solution": "42", "task": "math"},
    {"question": "Café: 10 - 4?", "solution": "6", "task": "math"},
]


def write_every_format(root):
    """The same three records as JSONL, JSON, parquet, arrow, a saved Dataset and a saved DatasetDict."""
    (root / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    (root / "set.json").write_text(json.dumps(RECORDS), encoding="utf-8")
    dataset = datasets.Dataset.from_list(RECORDS)
    dataset.to_parquet(str(root / "set.parquet"))
    dataset.save_to_disk(str(root / "saved"))
    (root / "set.arrow").write_bytes((root / "saved" / "data-00000-of-00001.arrow").read_bytes())
    empty = datasets.Dataset.from_list([{"question": "unused", "solution": "0", "task": "math"}])
    datasets.DatasetDict({"train": dataset, "test": empty}).save_to_disk(str(root / "saved_dict"))
    return ["set.jsonl", "set.json", "set.parquet", "set.arrow", "saved", "saved_dict"]


def source(path, streaming=False, **columns):
    config = SourceConfig(columns=ColumnsConfig(**columns), streaming=streaming)
    return Source.train(config, str(path))


@pytest.mark.parametrize("streaming", [False, True])
def test_every_format_gives_the_same_records_in_order(tmp_path, streaming):
    for name in write_every_format(tmp_path):
        records = [row.record for row in source(tmp_path / name, streaming).rows()]
        assert records == RECORDS, name


def test_columns_rename_the_users_fields_and_keep_the_others(tmp_path):
    write_every_format(tmp_path)
    for name in ("set.jsonl", "set.parquet", "saved"):
        rows = list(source(tmp_path / name, prompt="question", answer="solution").rows())
        assert [row.record for row in rows] == [
            {"prompt": r["question"], "answer": r["solution"], "task": "math"} for r in RECORDS
        ]
        assert rows[0].columns == ("question", "solution", "task")


def test_columns_may_swap_two_names(tmp_path):
    (tmp_path / "swap.jsonl").write_text(json.dumps({"prompt": "the answer", "answer": "the prompt"}) + "\n")
    (row,) = source(tmp_path / "swap.jsonl", prompt="answer", answer="prompt").rows()
    assert row.record == {"prompt": "the prompt", "answer": "the answer"}


def test_rows_are_named_by_jsonl_line_and_by_row_index_elsewhere(tmp_path):
    write_every_format(tmp_path)
    (tmp_path / "gaps.jsonl").write_text(json.dumps(RECORDS[0]) + "\n\n" + json.dumps(RECORDS[1]) + "\n")
    assert [r.where for r in source(tmp_path / "gaps.jsonl").rows()] == [f"{tmp_path}/gaps.jsonl:{n}" for n in (1, 3)]
    assert [r.where for r in source(tmp_path / "set.parquet").rows()][2] == f"{tmp_path}/set.parquet: row 2"
    assert [r.where for r in source(tmp_path / "saved_dict").rows()][1] == f"{tmp_path}/saved_dict: row 1"


def test_a_saved_dataset_dict_gives_the_split_asked_for_and_names_the_others(tmp_path):
    write_every_format(tmp_path)
    config = SourceConfig()  # split train, val_split test
    assert [r.record["question"] for r in Source.val(config, str(tmp_path / "saved_dict")).rows()] == ["unused"]
    with pytest.raises(DataError, match=r"saved_dict: no split 'dev' \(data.split\); its splits are train, test$"):
        list(Source.train(SourceConfig(split="dev"), str(tmp_path / "saved_dict")).rows())


def test_a_missing_column_names_the_column_the_setting_and_the_columns_present(tmp_path):
    write_every_format(tmp_path)
    src = source(tmp_path / "set.parquet", prompt="problem")
    row = next(src.rows())
    assert "prompt" not in row.record and row.record["task"] == "math"
    assert str(src.missing_error(row, "prompt")) == (
        f"{tmp_path}/set.parquet: row 0: no column 'problem' (data.columns.prompt); "
        "its columns are question, solution, task"
    )


def test_malformed_records_and_missing_or_unknown_files_are_one_line_errors(tmp_path):
    (tmp_path / "broken.jsonl").write_text(json.dumps(RECORDS[0]) + "\n{oops\n")
    (tmp_path / "array.json").write_text('[{"prompt": "a"}, 3]')
    (tmp_path / "set.csv").write_text("prompt\na\n")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "empty.jsonl").write_text("\n")
    cases = {
        "broken.jsonl": r"broken.jsonl:2: malformed JSON",
        "array.json": r"array.json: row 1: expected a JSON object, got int",
        "set.csv": r"set.csv \(data.train_path\): unknown file type .csv",
        "bad.parquet": r"bad.parquet as parquet: could not be read \(",
        "empty.jsonl": r"dataset .*empty.jsonl \(data.train_path\) holds no records",
        "missing.parquet": r"dataset file .*missing.parquet does not exist; check the path \(data.train_path\)",
    }
    for name, pattern in cases.items():
        with pytest.raises(DataError, match=pattern) as caught:
            list(source(tmp_path / name).rows())
        assert "\n" not in str(caught.value), name


def test_the_shipped_jsonl_data_reads_as_before():
    path = PROJECT_ROOT / "data" / "demo" / "train.jsonl"
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert [row.record for row in Source.train(SourceConfig(), "data/demo/train.jsonl").rows()] == lines


def test_a_hub_name_offline_is_one_line_saying_it_could_not_be_reached(tmp_path):
    script = (
        "from reinforge.data.sources import Source, SourceConfig\n"
        "from reinforge.errors import DataError\n"
        "try:\n"
        "    list(Source.train(SourceConfig(subset='main'), 'openai/gsm8k').rows())\n"
        "except DataError as exc:\n"
        "    print('ERROR', exc)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "PYTHONPATH": str(PROJECT_ROOT)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("ERROR")]
    assert line.startswith("ERROR data.train_path=openai/gsm8k: could not reach the Hugging Face Hub (")
    assert "connect this machine to the network" in line and result.stderr == ""


def test_eval_questions_of_ones_own_come_from_any_source_with_columns_and_a_limit(tmp_path):
    write_every_format(tmp_path)
    data = SourceConfig(split="train", columns=ColumnsConfig(prompt="question", answer="solution"))
    for name in ("set.jsonl", "set.parquet", "saved_dict"):
        items = load_benchmark(str(tmp_path / name), limit=2, data=data)
        assert [(i.prompt, i.record) for i in items] == [
            (r["question"], {"task": "math", "answer": r["solution"]}) for r in RECORDS[:2]
        ], name
    with pytest.raises(DataError, match=r"set.parquet: row 0: needs a `question` \(or `prompt`\) string and an"):
        load_benchmark(str(tmp_path / "set.parquet"), data=SourceConfig(columns=ColumnsConfig(prompt="question")))
    with pytest.raises(ReinforgeError, match="unknown benchmark 'gsm9k'; choose one of gsm8k"):
        load_benchmark("gsm9k")


def test_an_image_column_becomes_data_urls_that_load_as_the_same_pixels(tmp_path):
    picture = Image.new("RGB", (4, 3), (200, 10, 30))
    picture.putpixel((1, 2), (0, 255, 0))
    features = datasets.Features({"question": datasets.Value("string"), "img": datasets.Image()})
    dataset = datasets.Dataset.from_dict({"question": ["what colour?"], "img": [picture]}, features=features)
    dataset.save_to_disk(str(tmp_path / "pictures"))
    for streaming in (False, True):
        (row,) = source(tmp_path / "pictures", streaming, images="img").rows()
        assert row.record["images"].startswith("data:image")
        assert load_image(row.record["images"], tmp_path).tobytes() == picture.tobytes()


def test_preference_pairs_come_from_a_parquet_with_their_own_column_names(tmp_path):
    pairs = [{"question": "2 + 2?", "good": "4", "bad": "5"}, {"question": "3 + 3?", "good": "6", "bad": "7"}]
    datasets.Dataset.from_list(pairs).to_parquet(str(tmp_path / "pairs.parquet"))
    data = SourceConfig(columns=ColumnsConfig(prompt="question", chosen="good", rejected="bad"))
    records = read_preference_records(str(tmp_path / "pairs.parquet"), "Be brief.", data)
    assert [(r.messages, r.chosen, r.rejected) for r in records] == [
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": p["question"]}], p["good"], p["bad"])
        for p in pairs
    ]
    with pytest.raises(DataError, match=r"pairs.parquet: row 0: no column 'chosen' \(set data.columns.chosen"):
        read_preference_records(str(tmp_path / "pairs.parquet"), None, SourceConfig())
