"""Each metrics backend, read back from what it wrote: TensorBoard event files, the W&B offline run file,
the MLflow file store, metrics.jsonl."""

import json
import math
import struct
import sys
from contextlib import nullcontext

import pytest

from reinforge.algorithms.grpo_config import GRPORunConfig
from reinforge.config.tree import flatten
from reinforge.errors import ConfigError
from reinforge.logging.loggers import LoggersConfig, MetricLogger, check_backends

STEPS = {
    0: {"val/accuracy": 0.25},
    1: {"train/reward_mean": 0.5, "train/kl": 0.001, "timing/step_s": 2.0, "train/grad_norm": float("nan")},
    2: {"train/reward_mean": 0.75, "train/kl": 0.002, "timing/step_s": 1.5, "val/accuracy": 0.5},
}


def log_run(run_dir, config: LoggersConfig, fail: bool = False) -> None:
    with pytest.raises(RuntimeError) if fail else nullcontext():
        with MetricLogger(run_dir, config) as logger:
            logger.log_config(GRPORunConfig().model_dump(mode="json"))
            for step, metrics in STEPS.items():
                logger.log(step, metrics)
            if fail:
                raise RuntimeError("the run crashed")


def test_jsonl_is_always_written_with_non_finite_values_as_strings(tmp_path):
    log_run(tmp_path, LoggersConfig())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert rows[1]["train/grad_norm"] == "nan"  # visible, never dropped; float() reads it back
    assert rows[2] == {"step": 2, **STEPS[2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no backend: nothing else


def test_tensorboard_event_files_hold_every_scalar_a_non_finite_one_too_and_the_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_run(tmp_path, LoggersConfig(tensorboard={"enabled": True}))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == [
        "timing/step_s",
        "train/grad_norm",
        "train/kl",
        "train/reward_mean",
        "val/accuracy",
    ]
    assert [(e.step, math.isnan(e.value)) for e in events.Scalars("train/grad_norm")] == [(1, True)]
    assert [(e.step, e.value) for e in events.Scalars("val/accuracy")] == [(0, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("train/reward_mean")] == [(1, 0.5), (2, 0.75)]
    config_text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "    model:\n      name_or_path: models/demo\n" in config_text


def read_wandb_records(path):
    """The records of a W&B run file: a 7-byte header (":W&B", magic, version), then LevelDB-log-format
    blocks of 32 KiB whose chunks (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last)
    carry serialised `wandb_internal_pb2.Record` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_file_holds_the_history_config_name_and_tags(tmp_path, capfd):
    run_dir = tmp_path / "grpo-7"
    run_dir.mkdir()
    log_run(run_dir, LoggersConfig(wandb={"enabled": True, "offline": True, "project": "p", "tags": ["demo", "cpu"]}))
    assert capfd.readouterr().err == ""  # W&B's banner and console wrapping are off

    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    records = read_wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, list(run.tags)) == ("p", "grpo-7", ["demo", "cpu"])
    history = [
        {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    logged = [{k: v for k, v in row.items() if not k.startswith("_")} | {"step": row["_step"]} for row in history]
    assert math.isnan(logged[1].pop("train/grad_norm"))  # logged, as the NaN it is
    assert logged == [
        {"step": 0, "val/accuracy": 0.25},
        {"step": 1, "train/reward_mean": 0.5, "train/kl": 0.001, "timing/step_s": 2.0},
        {"step": 2, "train/reward_mean": 0.75, "train/kl": 0.002, "timing/step_s": 1.5, "val/accuracy": 0.5},
    ]
    config = {
        "/".join(item.nested_key) or item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for item in r.config.update
    }
    assert config["model"]["name_or_path"] == "models/demo"
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0


def test_wandb_online_without_an_account_is_a_one_line_error_that_offers_offline(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no saved login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    with pytest.raises(ConfigError) as error:
        MetricLogger(tmp_path, LoggersConfig(wandb={"enabled": True}))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("logging.loggers.wandb: W&B could not start a run: No API key configured.")
    assert message.endswith("Or set logging.loggers.wandb.offline=true to write it to RUN_DIR/wandb only.")


def mlflow_runs(tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient((tmp_path / "mlruns").as_uri())
    return client, client.search_runs([client.get_experiment_by_name("reinforge").experiment_id])


def test_mlflow_file_store_holds_the_metrics_params_config_and_status(tmp_path):
    log_run(tmp_path, LoggersConfig(mlflow={"enabled": True}))
    client, (run,) = mlflow_runs(tmp_path)
    assert (run.info.status, run.info.run_name) == ("FINISHED", tmp_path.name)
    history = client.get_metric_history(run.info.run_id, "train/reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75)]
    assert math.isnan(run.data.metrics["train/grad_norm"])  # NaN is logged, as TensorBoard and W&B log it
    assert run.data.params["rollout.num_generations_per_prompt"] == "8"
    assert run.data.params["model.name_or_path"] == "models/demo"
    assert len(run.data.params) == len(flatten(GRPORunConfig().model_dump(mode="json")))  # >100: MLflow's batch limit
    artifact = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    assert "num_generations_per_prompt: 8" in open(artifact).read()


def test_a_run_that_raises_is_marked_failed(tmp_path):
    log_run(tmp_path, LoggersConfig(mlflow={"enabled": True}), fail=True)
    _, (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # everything before the crash is kept


@pytest.mark.parametrize("backend, package", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_missing_backend_package_is_a_one_line_error_naming_what_to_install(tmp_path, monkeypatch, backend, package):
    monkeypatch.setitem(sys.modules, package, None)  # what Python does for a package that is not installed
    config = LoggersConfig(**{backend: {"enabled": True}})
    with pytest.raises(ConfigError) as error:
        check_backends(config)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"logging.loggers.{backend}.enabled=true needs the {package} package")
    assert message.endswith(f"pip install {package}")
    with pytest.raises(ConfigError):
        MetricLogger(tmp_path, config)


def test_flatten_gives_the_dotted_override_keys():
    assert flatten({"a": {"b": 1, "c": {"d": [2]}}, "e": {}, "f": None}) == {"a.b": 1, "a.c.d": [2], "e": {}, "f": None}
