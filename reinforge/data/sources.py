"""Where every recipe's records come from: one loader for datasets as users keep them.

A data path (`data.train_path`, `data.val_path`, a benchmark file) is, tried in this order:

- a local file: `.jsonl` (one object per line; read here, errors name the line), `.json` (an array of objects,
  or JSON Lines), `.parquet` or `.arrow` (read through the `datasets` library);
- a local directory: one saved by `datasets` (`Dataset.save_to_disk`, or a `DatasetDict`'s, whose split is
  `data.split` / `data.val_split`), or a folder of data files such as a downloaded hub repository;
- otherwise a Hugging Face dataset name (`openai/gsm8k`), with `data.subset` (its configuration, e.g. `main`) and
  the split; it needs the network (or the `datasets` cache of an earlier download).

Records come out as plain dicts keyed by the project's field names: `data.columns` renames the user's columns
(`question` -> `prompt`), and images of a `datasets` Image column become data URLs (data/images.py reads them).
Each comes with where it was read, for the one-line errors of malformed records: `FILE:LINE` for JSONL (lines
count from 1), `SOURCE: row I` for the others (rows count from 0, as `dataset[I]` and pandas do).
`datasets` is imported only when a non-JSONL source is read, so the shipped JSONL data needs nothing more.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator

from reinforge.config.section import Section
from reinforge.data.jsonl import iter_jsonl
from reinforge.errors import DataError
from reinforge.paths import resolve_path

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


class ColumnsConfig(Section):
    """`data.columns`: the dataset's name for each field reinforge reads; each defaults to the field's own name."""

    prompt: str = "prompt"
    """The user message of a prompt (GRPO, PPO, distillation) or of a pair (DPO, RM), a string."""
    system: str = "system"
    """A record's own system message (e.g. "detailed thinking on"); when present (not null) it replaces
    `data.system_prompt` for that record, "" meaning none."""
    answer: str = "answer"
    """The reference answer the environment scores a response against (e.g. GSM8K's `answer`)."""
    messages: str = "messages"
    """A chat: a list of {role, content} (SFT's conversations; a pair's conversation before its replies)."""
    chosen: str = "chosen"
    """A pair's preferred assistant reply (DPO, RM), a string."""
    rejected: str = "rejected"
    """A pair's other reply (DPO, RM), a string."""
    images: str = "images"
    """A record's images: paths (relative to the data file), data URLs, or a `datasets` Image column."""
    task: str = "task"
    """The environment that scores a record (`env.default_task` when absent)."""

    def renames(self) -> dict[str, str]:
        """The user's column -> the project's field, for the columns named otherwise."""
        return {user: field for field, user in self.model_dump().items() if user != field}


class SourceConfig(Section):
    """The settings every recipe's `data:` section shares: how `train_path` and `val_path` are read."""

    moved_keys: ClassVar[dict[str, str]] = {
        "prompt_key": "columns.prompt",
        "system_key": "columns.system",
        "messages_key": "columns.messages",
    }

    split: str = "train"
    """The split of `train_path` when it is a hub dataset or a saved `DatasetDict` (slices such as `train[:1000]`
    work without streaming); a single file has one split and ignores it."""
    val_split: str = "test"
    """The split of `val_path`, as `split` is of `train_path` (e.g. `train_path` and `val_path` both
    `openai/gsm8k`, split `train`, val_split `test`)."""
    subset: str | None = None
    """A hub dataset's configuration (`datasets.load_dataset`'s second argument, e.g. `main` for openai/gsm8k);
    null for a dataset with one."""
    columns: ColumnsConfig = ColumnsConfig()
    """Which of the dataset's columns holds each field reinforge reads (`data.columns.prompt=question`)."""
    streaming: bool = False
    """Read the sets as a stream (datasets' iterable datasets), for sets larger than memory or disk: a hub set is
    read shard by shard as it downloads and a local parquet or arrow file is read in place, never converted into
    the datasets cache first. The RL recipes (grpo, ppo, distill) then render each training prompt as it is drawn
    and shuffle within a buffer (`data.shuffle_buffer`), not across the whole set, and the curriculum is refused;
    sft, dpo and rm read their set once, in order, and hold only the tokenized examples. A hub split cannot be
    sliced (`train[:1000]`) when streamed. JSONL files are read line by line either way."""


@dataclass
class Row:
    """One record, keyed by the project's field names, and where it was read."""

    record: dict[str, Any]
    where: str  # "train.jsonl:3", "train.parquet: row 2", "openai/gsm8k (main, train): row 5"
    columns: tuple[str, ...]  # the record's own column names, for the missing-column error


@dataclass(frozen=True)
class Source:
    """A data path as the recipe reads it: its kind is worked out when its rows are read."""

    path: str  # as the user gave it
    setting: str  # the config key that gave it ("data.train_path"), for errors
    split: str
    subset: str | None
    columns: ColumnsConfig
    streaming: bool = False

    @classmethod
    def train(cls, data: SourceConfig, path: str, setting: str = "data.train_path") -> "Source":
        return cls(path, setting, data.split, data.subset, data.columns, data.streaming)

    @classmethod
    def val(cls, data: SourceConfig, path: str, setting: str = "data.val_path") -> "Source":
        return cls(path, setting, data.val_split, data.subset, data.columns, data.streaming)

    @property
    def base_dir(self) -> Path:
        """Where the records' relative image paths start: a file's directory, a saved dataset's own."""
        local = resolve_path(self.path)
        return local.parent if local.is_file() else local if local.is_dir() else Path(".")

    def rows(self) -> Iterator[Row]:
        """Every record, renamed by `data.columns`, in the source's order; a source with none is an error."""
        renames, empty = self.columns.renames(), True
        for where, raw in self._raw_rows():
            empty = False
            yield Row(_renamed(raw, renames), where, tuple(raw))
        if empty:
            raise DataError(f"dataset {self.path} ({self.setting}) holds no records")

    def missing_error(self, row: Row, field: str, alternative: str = "") -> DataError:
        """The one-line error of a row without `field`'s column: the column, where it is set, the columns present."""
        column = getattr(self.columns, field)
        named = (
            f" (data.columns.{field})" if column != field else f" (set data.columns.{field} to the column holding it)"
        )
        present = ", ".join(row.columns) or "none"
        return DataError(f"{row.where}: no column {column!r}{named}{alternative}; its columns are {present}")

    def _raw_rows(self) -> Iterator[tuple[str, dict[str, Any]]]:
        local = resolve_path(self.path)
        if local.is_file():
            yield from self._file_rows(local)
        elif local.is_dir():
            yield from _dataset_rows(self._directory(local), str(local))
        elif names_a_missing_file(self.path):
            raise DataError(f"dataset file {local} does not exist; check the path ({self.setting})")
        else:
            where = f"{self.path} ({', '.join(filter(None, (self.subset, self.split)))})"
            yield from _dataset_rows(self._hub(), where)

    def _file_rows(self, path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            yield from ((f"{path}:{line}", record) for line, record in iter_jsonl(path))
        elif suffix == ".json":
            yield from _json_rows(path)
        elif suffix in (".parquet", ".arrow"):
            builder = suffix.lstrip(".")
            dataset = _load(
                f"{path} as {builder}",
                lambda ds: ds.load_dataset(builder, data_files=str(path), split="train", streaming=self.streaming),
            )
            yield from _dataset_rows(dataset, str(path))
        else:
            raise DataError(
                f"{path} ({self.setting}): unknown file type {suffix or '(none)'}; give a "
                f"{', '.join(FILE_SUFFIXES)} file, a directory saved by datasets, or a Hugging Face dataset name"
            )

    def _directory(self, path: Path) -> Any:
        if not ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            return _load(  # a folder of data files (e.g. a downloaded hub repository): datasets finds them
                str(path),
                lambda ds: ds.load_dataset(str(path), self.subset, split=self.split, streaming=self.streaming),
            )
        saved = _load(str(path), lambda ds: ds.load_from_disk(str(path)))
        if isinstance(saved, dict):  # a DatasetDict: one dataset per split
            if self.split not in saved:
                key = (
                    "--split"
                    if self.setting.startswith("--")
                    else "data." + ("val_" * self.setting.endswith("val_path")) + "split"
                )
                raise DataError(f"{path}: no split {self.split!r} ({key}); its splits are {', '.join(saved)}")
            saved = saved[self.split]
        return saved.to_iterable_dataset() if self.streaming else saved

    def _hub(self) -> Any:
        def load(ds: Any) -> Any:
            try:
                return ds.load_dataset(self.path, self.subset, split=self.split, streaming=self.streaming)
            except ConnectionError as exc:
                raise DataError(
                    f"{self.setting}={self.path}: could not reach the Hugging Face Hub ({_first_line(exc)}); connect "
                    "this machine to the network (and unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), or give a local "
                    "file or a directory saved with datasets' save_to_disk"
                ) from None

        print(f"{self.setting}={self.path}: not a local file or directory, so read from the Hugging Face Hub")
        return _load(f"{self.setting}={self.path}", load)


def names_a_missing_file(path: str) -> bool:
    """A path that can only be a local file or directory (a data file's suffix, or ./ / ~ in front), and is
    absent; anything else absent locally is taken for a hub dataset name."""
    local_only = Path(path).suffix in FILE_SUFFIXES or path.startswith((".", "/", "~"))
    return local_only and not resolve_path(path).exists()


def _renamed(record: dict[str, Any], renames: dict[str, str]) -> dict[str, Any]:
    """The record with the user's columns under the project's names; images of an Image column as data URLs."""
    if renames:
        moved = {renames[key]: value for key, value in record.items() if key in renames}
        record = {key: value for key, value in record.items() if key not in renames} | moved
    for key in ("images", "image"):
        if key in record and record[key] is not None:
            record[key] = _image_refs(record[key])
    return record


def _image_refs(value: Any) -> Any:
    """A `datasets` Image value (a PIL image, or {bytes, path} undecoded) as a data URL; paths and URLs as they are."""
    if isinstance(value, list):
        return [_image_refs(item) for item in value]
    if isinstance(value, dict) and value.get("bytes"):
        return "data:image;base64," + base64.b64encode(value["bytes"]).decode("ascii")
    if isinstance(value, dict) and value.get("path"):
        return value["path"]
    if hasattr(value, "save") and hasattr(value, "size"):  # a decoded PIL image
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
    return value


def _json_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """A .json file: one array of objects (read whole), else JSON Lines under a .json name."""
    text = path.read_bytes()
    try:
        document = json.loads(text)
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text; save the file as UTF-8") from None
    except json.JSONDecodeError:
        yield from ((f"{path}:{line}", record) for line, record in iter_jsonl(path))
        return
    if isinstance(document, dict) and len(document) == 1 and isinstance(next(iter(document.values())), list):
        document = next(iter(document.values()))  # {"data": [...]}
    if not isinstance(document, list):
        raise DataError(f"{path}: expected an array of objects (or one object per line), got {type(document).__name__}")
    for index, record in enumerate(document):
        if not isinstance(record, dict):
            raise DataError(f"{path}: row {index}: expected a JSON object, got {type(record).__name__}")
        yield f"{path}: row {index}", record


def _dataset_rows(dataset: Any, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for index, record in enumerate(_guarded(dataset, name)):
        yield f"{name}: row {index}", dict(record)


def _guarded(dataset: Iterable[Any], name: str) -> Iterator[Any]:
    """The dataset's records; a read that fails midway (a damaged shard, a dropped connection) as one line."""
    iterator = iter(dataset)
    while True:
        try:
            yield next(iterator)
        except StopIteration:
            return
        except DataError:
            raise
        except Exception as exc:
            raise DataError(f"{name}: could not be read ({type(exc).__name__}: {_first_line(exc)})") from None


def _load(name: str, load: Any) -> Any:
    """`load(datasets)`, its progress bars off (errors stay one line) and its failures one line naming `name`."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{name}: reading it needs the datasets library; pip install 'datasets>=3'") from None

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        return load(datasets)
    except DataError:
        raise
    except FileNotFoundError as exc:
        raise DataError(f"{name}: not found ({_first_line(exc)})") from None
    except Exception as exc:  # a bad split or subset, a damaged file: datasets says which
        raise DataError(f"{name}: could not be read ({type(exc).__name__}: {_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]
