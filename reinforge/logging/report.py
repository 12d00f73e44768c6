"""`reinforge report RUN_DIR`: plots and a summary of a run, from RUN_DIR/metrics.jsonl and config.yaml.

Writes RUN_DIR/report/*.png (one figure per group of metrics; a figure whose metrics the run did not log
is skipped) and RUN_DIR/report/summary.md (config highlights, first/last/best of the key metrics, wall
time per phase, the plots). Works on a finished run or one still being written.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import yaml

from reinforge.config.tree import flatten
from reinforge.data.jsonl import read_jsonl
from reinforge.errors import DataError

Rows = list[dict[str, float | None]]
NONFINITE = ("nan", "inf", "-inf")


@dataclass(frozen=True)
class LinePlot:
    filename: str
    title: str
    ylabel: str
    metrics: tuple[str, ...]  # one line each; the first one drawn boldest
    reference: tuple[float, str] | None = None  # a dotted horizontal line and its legend label
    unit_range: bool = False  # a fraction: show at least [0, 1] so that noise does not look like a trend


LINE_PLOTS = [
    LinePlot("val_accuracy.png", "Validation accuracy (greedy)", "accuracy", ("val/accuracy",), unit_range=True),
    LinePlot("loss.png", "Loss", "loss", ("train/loss", "val/loss")),
    LinePlot("kl.png", "KL divergence to the reference policy (k3)", "KL (nats per token)", ("train/kl",)),
    LinePlot("entropy.png", "Policy entropy", "entropy (nats per token)", ("train/entropy",)),
    LinePlot(
        "gen_length.png",
        "Generation length",
        "tokens",
        ("rollout/gen_len_mean", "rollout/gen_len_max", "val/gen_len_mean"),
    ),
    LinePlot(
        "token_mult_prob_error.png",
        "Train/inference mismatch",
        "token_mult_prob_error",
        ("train/token_mult_prob_error",),
        reference=(1.0, "1 = engine and trainer agree"),
    ),
    LinePlot(
        "moe_load.png",
        "Expert load balance (mixture of experts)",
        "load CV, hottest expert's share",
        ("train/moe/load_cv", "train/moe/max_expert_share"),
    ),
    LinePlot(
        "moe_routing.png",
        "Router choices, trainer vs generation engine",
        "share of (token, layer) pairs",
        ("train/moe/router_disagreement", "train/moe/replayed_share"),
        unit_range=True,
    ),
    LinePlot("tokens_per_s.png", "Throughput", "tokens per second", ("perf/tokens_per_s",)),
    LinePlot("memory.png", "Peak memory", "GiB", ("perf/peak_rss_gb", "perf/gpu_peak_memory_gb")),
]

# (metric, which value is best or None, format) in the summary's table
KEY_METRICS = [
    ("val/accuracy", max, ".4g"),
    ("train/reward_mean", max, ".4g"),
    ("val/loss", min, ".4g"),
    ("train/loss", None, ".4g"),
    ("train/kl", None, ".4g"),
    ("train/entropy", None, ".4g"),
    ("rollout/gen_len_mean", None, ".4g"),
    ("train/zero_advantage_fraction", None, ".3g"),
    ("train/token_mult_prob_error", None, ".7f"),
    ("train/moe/load_cv", min, ".3g"),
    ("train/moe/max_expert_share", None, ".3g"),
    ("train/moe/router_entropy", None, ".4g"),
    ("train/moe/aux_loss", None, ".4g"),
    ("train/moe/router_disagreement", None, ".3g"),
    ("train/moe/replayed_share", None, ".4g"),
    ("perf/tokens_per_s", max, ".4g"),
    ("perf/peak_rss_gb", None, ".3g"),
    ("perf/gpu_peak_memory_gb", None, ".3g"),
]

CONFIG_HIGHLIGHTS = [
    "model.name_or_path",
    "model.dtype",
    "generation.backend",
    "generation.max_new_tokens",
    "generation.temperature",
    "loop.max_steps",
    "rollout.num_prompts_per_step",
    "rollout.num_generations_per_prompt",
    "training.backend",
    "training.num_workers",
    "training.global_batch_size",
    "training.micro_batch_size",
    "optimizer.lr",
    "scheduler.lr_schedule",
    "scheduler.warmup_steps",
    "loss.kl_coef",
    "loss.clip_eps_low",
    "loss.clip_eps_high",
    "loss.aggregation",
    "loss.ratio_level",
]
ALGORITHMS = ("grpo", "ppo", "distill", "sft", "dpo", "rm")  # the algorithm's own section is shown whole

# Phases in the order a step runs them; `other` is the step's time outside the named phases.
PHASE_ORDER = [
    "generate",
    "reward",
    "rollout_wait",
    "logprobs",
    "reference",
    "train",
    "engine_wait",
    "refit",
    "other",
    "val",
]
OUTSIDE_STEP = {"val"}  # timed apart from timing/step_s (see docs/metrics.md)
NESTED = {"refit_verify"}  # timed inside another phase (the refit's verification, inside timing/refit_s)
OVERLAPPED = {
    "generate",
    "reward",
}  # under async rollouts: the producer's time, hidden behind the step's (not wall time)

FIGSIZE, DPI = (8.0, 4.5), 150
SMOOTH_ABOVE = 100  # points in a line beyond which it is drawn smoothed
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
STYLE = {
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linestyle": "-",
    "axes.titlesize": 13,
    "axes.titleweight": "bold",
    "axes.labelsize": 11,
    "legend.fontsize": 9,
    "legend.frameon": False,
    "font.size": 10,
    "axes.axisbelow": True,
}


def read_metrics(run_dir: Path) -> Rows:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"{path} does not exist; give the run directory of a reinforge run")
    if not path.read_bytes().strip():
        raise DataError(f"{path} is empty: the run has not finished a step yet")
    rows = read_jsonl(path, required_keys=("step",))  # malformed or non-UTF-8 lines: one line naming them
    # a non-finite value is the string "nan", "inf" or "-inf" (logging/metrics.py), null in runs before
    return [{name: float(v) if v in NONFINITE else v for name, v in row.items()} for row in rows]


def series(rows: Rows, name: str) -> tuple[list[int], list[float]]:
    """The steps and values of one metric, skipping the steps that did not log it (or logged a non-finite value)."""
    points = [(row["step"], row[name]) for row in rows if row.get(name) is not None and math.isfinite(row[name])]
    return [s for s, _ in points], [v for _, v in points]


def write_report(run_dir: Path) -> list[Path]:
    """Write RUN_DIR/report/: the plots and summary.md. Returns the files written."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    config_path = run_dir / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    plots = write_plots(rows, out)
    summary = out / "summary.md"
    summary.write_text(summary_markdown(run_dir, rows, config, [p.name for p in plots]))
    return [*plots, summary]


def write_plots(rows: Rows, out: Path) -> list[Path]:
    import matplotlib
    from cycler import cycler

    figures = [
        ("reward.png", plot_reward),
        *[(p.filename, partial(plot_lines, plot=p)) for p in LINE_PLOTS],
        ("step_time.png", plot_step_time),
    ]
    steps = [row["step"] for row in rows]
    pad = max(0.5, 0.02 * (max(steps) - min(steps)))
    x_range = (min(steps) - pad, max(steps) + pad)  # every figure on the same step axis
    written = []
    with matplotlib.rc_context({**STYLE, "axes.prop_cycle": cycler(color=COLORS)}):
        for filename, draw in figures:
            fig = draw(rows)
            if fig is not None:
                fig.axes[0].set_xlim(*x_range)
                fig.savefig(out / filename, dpi=DPI)
                written.append(out / filename)
    return written


def new_figure(title: str, ylabel: str):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=FIGSIZE, layout="constrained")  # no pyplot: no global state, no GUI backend
    ax = fig.add_subplot()
    ax.set_title(title, loc="left")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10]))
    return fig, ax


def draw_line(ax, steps: list[int], values: list[float], label: str, rank: int) -> None:
    """Markers while the points are few enough to tell apart; past SMOOTH_ABOVE points, the raw values faint
    and an exponential moving average over them. The first line solid, the others dashed."""
    style = {"linewidth": 2.0 if rank == 0 else 1.4, "linestyle": "-" if rank == 0 else "--"}
    if len(steps) <= SMOOTH_ABOVE:
        ax.plot(steps, values, label=label, marker="o" if len(steps) <= 40 else None, markersize=4, **style)
        return
    (raw,) = ax.plot(steps, values, alpha=0.25, linewidth=0.8)
    ax.plot(
        steps,
        moving_average(values, span=len(values) // 20),
        label=f"{label} (smoothed)",
        color=raw.get_color(),
        **style,
    )


def moving_average(values: list[float], span: int) -> list[float]:
    """Exponential moving average with weight 2 / (span + 1) on each new value, started at the first value."""
    weight, average, out = 2 / (span + 1), values[0], []
    for value in values:
        average = weight * value + (1 - weight) * average
        out.append(average)
    return out


def plot_lines(rows: Rows, plot: LinePlot):
    metrics = [*plot.metrics, *per_task(rows, plot.metrics[0])]
    drawn = [(name, *series(rows, name)) for name in metrics]
    drawn = [(name, steps, values) for name, steps, values in drawn if steps]
    if not drawn:
        return None
    fig, ax = new_figure(plot.title, plot.ylabel)
    for rank, (name, steps, values) in enumerate(drawn):
        draw_line(ax, steps, values, name, rank)
    if plot.reference is not None:
        value, label = plot.reference
        ax.axhline(value, color="black", linewidth=0.8, linestyle=":", label=label)
        ax.ticklabel_format(axis="y", useOffset=False)  # 1.0000002 reads as itself, not as 1 + 2e-7
    if plot.unit_range:
        include_unit_range(ax)
    ax.legend(loc="best")
    return fig


def include_unit_range(ax) -> None:
    low, high = ax.get_ylim()
    ax.set_ylim(min(low, -0.02), max(high, 1.02))


def per_task(rows: Rows, metric: str) -> list[str]:
    """`val/<task>/accuracy` for `val/accuracy` (and so on), when the run has more than one task."""
    prefix, _, name = metric.partition("/")
    names = sorted(
        {
            key
            for row in rows
            for key in row
            if key.startswith(prefix + "/") and key.count("/") == 2 and key.endswith("/" + name)
        }
    )
    return names if len(names) > 1 else []


def plot_reward(rows: Rows):
    steps, means = series(rows, "train/reward_mean")
    if not steps:
        return None
    fig, ax = new_figure("Training reward", "reward")
    draw_line(ax, steps, means, "train/reward_mean", 0)
    std = dict(zip(*series(rows, "train/reward_std")))
    if std:
        low = [m - std.get(s, 0.0) for s, m in zip(steps, means)]
        high = [m + std.get(s, 0.0) for s, m in zip(steps, means)]
        if len(steps) > SMOOTH_ABOVE:  # the band around the smoothed line
            low, high = moving_average(low, len(low) // 20), moving_average(high, len(high) // 20)
        ax.fill_between(steps, low, high, alpha=0.2, linewidth=0, label="± train/reward_std")
    for rank, name in enumerate(per_task(rows, "train/reward_mean"), start=1):
        draw_line(ax, *series(rows, name), name, rank)
    include_unit_range(ax)
    ax.legend(loc="best")
    return fig


def phase_seconds(rows: Rows) -> dict[str, list[tuple[int, float]]]:
    """Seconds per phase per step, `other` included; phases in PHASE_ORDER, then any others by name."""
    phases: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        named = {
            key[len("timing/") : -2]: value
            for key, value in row.items()
            if key.startswith("timing/") and key.endswith("_s") and value is not None
        }
        step_total = named.pop("step", None)
        named = {name: value for name, value in named.items() if name not in NESTED}
        if "rollout_wait" in named:  # async: the step waited `rollout_wait` for generation that ran alongside it
            named = {name: value for name, value in named.items() if name not in OVERLAPPED}
        if step_total is not None:
            inside = sum(v for name, v in named.items() if name not in OUTSIDE_STEP)
            named["other"] = max(step_total - inside, 0.0)
        for name, value in named.items():
            phases.setdefault(name, []).append((row["step"], value))
    order = {name: i for i, name in enumerate(PHASE_ORDER)}
    return dict(sorted(phases.items(), key=lambda item: (order.get(item[0], len(order)), item[0])))


def plot_step_time(rows: Rows):
    phases = phase_seconds(rows)
    if not phases:
        return None
    steps = sorted({s for points in phases.values() for s, _ in points})
    fig, ax = new_figure("Wall time per step, by phase", "seconds")
    bottom = [0.0] * len(steps)
    index = {s: i for i, s in enumerate(steps)}
    for color, (name, points) in zip(COLORS * 2, phases.items()):
        heights = [0.0] * len(steps)
        for s, value in points:
            heights[index[s]] = value
        ax.bar(
            steps, heights, bottom=bottom, width=0.8 if len(steps) <= 60 else 1.0, color=color, label=name, linewidth=0
        )
        bottom = [b + h for b, h in zip(bottom, heights)]
    # below the axes, so that they line up with the other figures
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=min(len(phases), 8),
        title="timing/<phase>_s",
        title_fontsize=9,
    )
    return fig


def summary_markdown(run_dir: Path, rows: Rows, config: dict, plots: list[str]) -> str:
    train_steps = [row["step"] for row in rows if row["step"] > 0]
    per_step = phase_seconds(rows)
    phases = {name: sum(v for _, v in points) for name, points in per_step.items()}
    total = sum(phases.values())
    lines = [f"# Run report: {run_dir.name}", ""]
    lines += [
        f"{len(train_steps)} training steps (last step {max(train_steps, default=0)}); "
        f"{format_duration(total)} in timed phases (start-up is not timed).",
        "",
    ]
    lines += ["## Config", "", "| setting | value |", "|---|---|"]
    lines += [f"| `{key}` | {json.dumps(value)} |" for key, value in config_highlights(config).items()]
    lines += ["", "## Metrics", "", "| metric | first | last | best | best at step |", "|---|---:|---:|---:|---:|"]
    for name, best, fmt in KEY_METRICS:
        steps, values = series(rows, name)
        if not steps:
            continue
        best_cells = "| |"
        if best is not None:
            best_value = best(values)
            best_cells = f"{best_value:{fmt}} | {steps[values.index(best_value)]} |"
        lines.append(f"| `{name}` | {values[0]:{fmt}} | {values[-1]:{fmt}} | {best_cells}")
    if total > 0:
        lines += [
            "",
            "## Time per phase",
            "",
            "Sums of `timing/<phase>_s` over the steps; `other` is step time outside the named phases.",
            "",
            "| phase | total | share | mean per timed step |",
            "|---|---:|---:|---:|",
        ]
        for name, seconds in phases.items():
            lines.append(
                f"| {name} | {seconds:.1f} s | {100 * seconds / total:.1f}% | {seconds / len(per_step[name]):.2f} s |"
            )
        lines.append(f"| **total** | **{total:.1f} s** | 100% | |")
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(name).stem}]({name})" for name in plots]
    return "\n".join(lines) + "\n"


def config_highlights(config: dict) -> dict[str, object]:
    flat = flatten(config)
    picked = {key: flat[key] for key in CONFIG_HIGHLIGHTS if key in flat}
    for algorithm in ALGORITHMS:
        picked.update({key: value for key, value in flat.items() if key.startswith(algorithm + ".")})
    return picked


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"
