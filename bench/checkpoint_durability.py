"""What checkpoint durability costs per save: the checksums (SHA-256 of every file, for COMPLETE) and the
fsync of every file and directory before the rename, against the save itself, on one checkpoint of a real
trainer (weights and AdamW state).

    python bench/checkpoint_durability.py --json bench/results/checkpoint_durability.json

The trainer is the torch backend on the ~30M Qwen2 (`_common.build_30m_model`, fp32, after one optimizer
step so AdamW's state exists). Each of `--repeats` rounds times, in a fresh directory each: `save_state`
alone (torch.save, which leaves the data in the page cache), the SHA-256 pass over the files, fsync_tree
(what reaches the disk), and the whole save_checkpoint (all three, plus the driver state, config, COMPLETE
and the renames). Medians are reported; the disk is whatever backs the temporary directory (`--dir`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write the checkpoints (default: a temporary directory)"
    )
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "checkpoint_durability.json")
    args = parser.parse_args()

    import torch
    from _common import build_30m_model, clipped_token_mean_loss, grpo_like_batch, policy_backend, write_result

    from reinforge.model_config import ModelConfig
    from reinforge.run_dir import fsync_tree
    from reinforge.training.base import TrainingConfig
    from reinforge.training.checkpoint import save_checkpoint, sha256

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        model_dir = build_30m_model(tmp / "model")
        training = TrainingConfig(global_batch_size=8, micro_batch_size=8)
        backend = policy_backend(ModelConfig(name_or_path=str(model_dir)), training, lr=1e-5, num_optimizer_steps=2)
        batch = grpo_like_batch(8, (20, 30), (16, 16), backend.model.config.vocab_size)
        batch.old_logprobs = backend.logprobs(batch)
        backend.train_step(batch, clipped_token_mean_loss)
        times = {"save_state": [], "sha256": [], "fsync": [], "save_checkpoint": []}
        for round_index in range(args.repeats):
            target = tmp / f"plain_{round_index}"
            target.mkdir()
            start = time.perf_counter()
            backend.save_state(target / "trainer")
            times["save_state"].append(time.perf_counter() - start)
            files = [p for p in target.rglob("*") if p.is_file()]
            start = time.perf_counter()
            for path in files:
                sha256(path)
            times["sha256"].append(time.perf_counter() - start)
            start = time.perf_counter()
            fsync_tree(target)
            times["fsync"].append(time.perf_counter() - start)
            num_bytes = sum(p.stat().st_size for p in files)
            shutil.rmtree(target)
            start = time.perf_counter()
            save_checkpoint(tmp / "run", round_index + 1, backend, {"step": round_index + 1}, "seed: 0\n")
            times["save_checkpoint"].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "checkpoint_bytes": num_bytes,
        "repeats": args.repeats,
        "median_s": medians,
        "all_s": times,
        "load_average": list(os.getloadavg()),
        "durability_overhead": (medians["sha256"] + medians["fsync"]) / medians["save_state"],
    }
    print(
        f"checkpoint of {num_bytes / 2**20:.0f} MiB: save_state {medians['save_state']:.3f} s, "
        f"sha256 {medians['sha256']:.3f} s, "
        f"fsync {medians['fsync']:.3f} s; whole save_checkpoint {medians['save_checkpoint']:.3f} s "
        f"(checksums + fsync = {100 * result['durability_overhead']:.0f}% of save_state)"
    )
    write_result(args.json, result)


if __name__ == "__main__":
    main()
