"""Where each step's metrics go: RUN_DIR/metrics.jsonl always, and TensorBoard, Weights & Biases and
MLflow when `logging.loggers` enables them.

`MetricLogger` is the one object the training loops talk to: `log(step, metrics)` each step,
`log_config(config)` once, `close()` at the end (or use it as a context manager, which marks a run
that raised as failed in W&B and MLflow). Each backend's package is imported only when it is
enabled, and a missing one is a one-line error that says what to install.
"""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from reinforge.config.section import Section
from reinforge.config.tree import flatten
from reinforge.errors import ConfigError
from reinforge.logging.metrics import JsonlWriter


class TensorBoardConfig(Section):
    enabled: bool = False
    """Write the metrics as TensorBoard event files to RUN_DIR/tensorboard
    (`tensorboard --logdir RUN_DIR/tensorboard`)."""


class WandbConfig(Section):
    enabled: bool = False
    """Log to Weights & Biases (package `wandb`); its local files go to RUN_DIR/wandb."""
    project: str = "reinforge"
    """W&B project."""
    entity: str | None = None
    """W&B team or user; null: the default entity of the logged-in account."""
    name: str | None = None
    """W&B run name; null: the run directory's name."""
    tags: list[str] = []
    """W&B run tags."""
    offline: bool = False
    """Write the run to RUN_DIR/wandb only, without network or account; `wandb sync
    RUN_DIR/wandb/offline-run-*` uploads it later. WANDB_MODE=offline does the same."""


class MlflowConfig(Section):
    enabled: bool = False
    """Log to MLflow (package `mlflow` or `mlflow-skinny`): metrics, the config as parameters and as
    the artifact config.yaml."""
    tracking_uri: str | None = None
    """MLflow tracking server or store, e.g. http://host:5000 or sqlite:///mlflow.db; null: a file store
    in RUN_DIR/mlruns (`mlflow ui --backend-store-uri RUN_DIR/mlruns`)."""
    experiment: str = "reinforge"
    """MLflow experiment, created if it does not exist."""
    run_name: str | None = None
    """MLflow run name; null: the run directory's name."""


class LoggersConfig(Section):
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    """TensorBoard event files."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases."""
    mlflow: MlflowConfig = MlflowConfig()
    """MLflow."""


class MetricLogger:
    """Writes each step's metrics to RUN_DIR/metrics.jsonl and to every enabled backend."""

    def __init__(self, run_dir: Path, config: LoggersConfig):
        self.jsonl = JsonlWriter(run_dir / "metrics.jsonl")
        self.backends: list[Any] = []
        try:
            if config.tensorboard.enabled:
                self.backends.append(TensorBoardLogger(run_dir))
            if config.wandb.enabled:
                self.backends.append(WandbLogger(run_dir, config.wandb))
            if config.mlflow.enabled:
                self.backends.append(MlflowLogger(run_dir, config.mlflow))
        except BaseException:
            self.close(ok=False)
            raise

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Every value, a non-finite one too (a skipped step's NaN loss): metrics.jsonl writes it as "nan", "inf" or
        "-inf", and TensorBoard, W&B and MLflow each take NaN and the infinities as they are."""
        self.jsonl.write(step, metrics)
        values = {name: float(value) for name, value in metrics.items()}
        for backend in self.backends:
            backend.log(step, values)

    def log_config(self, config: dict[str, Any]) -> None:
        """The run's resolved config (e.g. `config.model_dump(mode="json")`); JSONL has it as config.yaml."""
        for backend in self.backends:
            backend.log_config(config)

    def close(self, ok: bool = True) -> None:
        """Flush and finish every backend; `ok=False` marks the run as failed where the backend has a status."""
        backends, self.backends = self.backends, []
        for backend in backends:
            backend.close(ok)

    def __enter__(self) -> "MetricLogger":
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        self.close(ok=exc_type is None)


def check_backends(config: LoggersConfig) -> None:
    """Fail at once, before a long start-up, when an enabled backend's package is missing."""
    for enabled, module, package, key in (
        (config.tensorboard.enabled, "torch.utils.tensorboard", "tensorboard", "tensorboard"),
        (config.wandb.enabled, "wandb", "wandb", "wandb"),
        (config.mlflow.enabled, "mlflow", "mlflow", "mlflow"),
    ):
        if enabled:
            _require(module, package, key)


def _require(module: str, package: str, key: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"logging.loggers.{key}.enabled=true needs the {package} package, which does not import here ({exc}); "
            f"pip install {package}"
        ) from None


class TensorBoardLogger:
    """Scalars under their metric names (so `train/`, `val/`, ... become TensorBoard's sections), the
    config as the text `config`."""

    def __init__(self, run_dir: Path):
        tensorboard = _require("torch.utils.tensorboard", "tensorboard", "tensorboard")
        self.writer = tensorboard.SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a step takes seconds; flushing each one keeps a crashed run's curves

    def log_config(self, config: dict[str, Any]) -> None:
        text = yaml.safe_dump(config, sort_keys=False)
        self.writer.add_text(
            "config", "".join(f"    {line}\n" for line in text.splitlines()), 0
        )  # a Markdown code block
        self.writer.flush()

    def close(self, ok: bool) -> None:
        self.writer.close()


class WandbLogger:
    """One W&B run whose local files live in RUN_DIR/wandb. W&B's console wrapping and banner are off:
    the terminal belongs to the progress bar."""

    def __init__(self, run_dir: Path, config: WandbConfig):
        # W&B's Weave advert fires whenever an LLM client library (openai, which vLLM imports) is loaded
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
        self.wandb = _require("wandb", "wandb", "wandb")
        try:
            self.run = self.wandb.init(
                project=config.project,
                entity=config.entity,
                name=config.name or run_dir.name,
                tags=config.tags,
                dir=str(run_dir),
                mode="offline" if config.offline else None,  # None: WANDB_MODE, else online
                settings=self.wandb.Settings(console="off", silent=True),
            )
        except self.wandb.errors.Error as exc:  # no API key, a wrong entity, no network
            raise ConfigError(
                f"logging.loggers.wandb: W&B could not start a run: {exc} Or set "
                "logging.loggers.wandb.offline=true to write it to RUN_DIR/wandb only."
            ) from None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)
        # finish() may return before W&B's service process has written the run file (seen with wandb
        # 0.31 offline); teardown waits for the service to exit, so the run directory is complete.
        self.wandb.teardown()


class MlflowLogger:
    """One MLflow run, through `MlflowClient` (no process-global active run): metrics with their step,
    the config as dotted parameters and as the artifact config.yaml."""

    def __init__(self, run_dir: Path, config: MlflowConfig):
        _require("mlflow", "mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        if config.tracking_uri is None:
            # MLflow 3 keeps the file store in maintenance mode and refuses it unless asked: a run
            # directory that holds everything, with no database, is worth that.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=config.tracking_uri or (run_dir / "mlruns").resolve().as_uri())
        experiment = self.client.get_experiment_by_name(config.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(config.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=config.run_name or run_dir.name).info.run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        timestamp_ms = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(name, value, timestamp_ms, step) for name, value in metrics.items()]
        )

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(key, str(value)) for key, value in flatten(config).items()]
        self.client.log_batch(self.run_id, params=params)
        self.client.log_text(self.run_id, yaml.safe_dump(config, sort_keys=False), "config.yaml")

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


class LoggingConfig(Section):
    run_dir: str = "runs/grpo"
    """Run directory: config.yaml, metrics.jsonl, final/. If it already holds a run, a suffix -1, -2, ...
    is added."""
    console_every: int = 1
    """Print a compact metrics line every this many steps."""
    loggers: LoggersConfig = LoggersConfig()
    """Where the metrics go besides RUN_DIR/metrics.jsonl (always written): TensorBoard, Weights & Biases, MLflow."""
    capture_dependency_logs: bool = True
    """Send the logs of vLLM, Ray, transformers and other dependencies, and anything written to stderr
    during the run, to RUN_DIR/logs/dependencies.log instead of the console."""
