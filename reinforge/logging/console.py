"""The console: a progress bar with ETA and a compact line per step."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# (metric, short label, format) shown in the per-step line
COMPACT = [
    ("train/reward_mean", "reward", "{:.3f}"),
    ("val/accuracy", "val_acc", "{:.3f}"),
    ("train/loss", "loss", "{:+.4f}"),
    ("train/kl", "kl", "{:.4f}"),
    ("train/entropy", "ent", "{:.3f}"),
    ("train/clip_fraction", "clip", "{:.3f}"),
    ("rollout/gen_len_mean", "len", "{:.1f}"),
    ("timing/step_s", "step_s", "{:.2f}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
]


class ConsoleLog:
    def __init__(self, total_steps: int, description: str, completed: int = 0):
        self.console = Console(highlight=False)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
            redirect_stderr=False,  # stderr belongs to the dependency-log capture (RUN_DIR/logs), not the bar
        )
        self.task = self.progress.add_task(description, total=total_steps, completed=completed)

    def __enter__(self) -> "ConsoleLog":
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def step(self, step: int, metrics: dict[str, float], show_line: bool) -> None:
        self.progress.update(self.task, completed=step)
        if show_line:
            parts = [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in COMPACT if key in metrics]
            if metrics.get("train/nonfinite_steps"):  # a NaN loss shows as "nan" above; the skips so far, here
                parts.append(f"nonfinite_steps {metrics['train/nonfinite_steps']:.0f}")
            self.progress.console.print(f"step {step:>4} | " + " | ".join(parts), soft_wrap=True)

    def print(self, text: str) -> None:
        self.progress.console.print(text, soft_wrap=True)
