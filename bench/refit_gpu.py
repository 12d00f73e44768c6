"""The refit's wire on a GPU (bench/gpu_checks.sh; needs vLLM's CUDA build): Qwen2.5-1.5B's architecture (random
weights, the demo vocabulary, bf16) in a vLLM engine on the GPU, its weights sent from the same process's model on
the same GPU through the wire (generation/weight_transfer.py: `reinforge_gloo`, each bucket copied to the host),
then the run's refit check (sampled columns).

    python bench/refit_gpu.py --json /tmp/gpu_checks/refit_gpu.json

Prints seconds per refit (median of 3 after a warm-up), GB/s of weights, the check's seconds, and whether the check
passed. Target on the H200: the check passes every time, and a 1.5B refit takes at most 5 s (>= 0.6 GB/s of bf16
weights; vLLM's own `ipc`/`nccl` transports, not wired in yet, would move them in well under a second).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import QWEN25_1_5B, build_random_qwen2, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument(
        "--demo", action="store_true", help="the demo model, on the CPU where there is no GPU: a dry run"
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from reinforge.generation.vllm_backend import VLLMGenerationBackend
    from reinforge.generation.weight_digest import Expectation, check
    from reinforge.generation.weight_transfer import Sender
    from reinforge.model_config import ModelConfig
    from reinforge.modeling import load_model

    shape = {k: v for k, v in QWEN25_1_5B.items() if k not in ("vocab_size", "tie_word_embeddings")}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(ROOT / "models" / "demo") if args.demo else str(build_random_qwen2(Path(tmp), shape, torch.bfloat16))
        engine = VLLMGenerationBackend(
            path,
            "bfloat16",
            0,
            1024,
            block_size=None if device == "cuda" else 32,
            gpu_memory_utilization=0.4,
            sleep_mode=False,
        )
        model = load_model(ModelConfig(name_or_path=path, dtype="bfloat16")).to(device)
        sender = Sender()
        port = sender.host(2, timeout_s=300)
        info = dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, timeout_s=300)
        joining = threading.Thread(target=engine.init_weight_transfer, args=(info,))
        joining.start()
        sender.join()
        joining.join()
        layouts, times, checks, outcomes = engine.weight_layout(), [], [], []
        for step in range(4):
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn_like(param) * 1e-3)
            expectation = Expectation(layouts, columns=32, step=step)
            parts = [list(model.state_dict().items())]
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            receiving = threading.Thread(target=engine.receive_weights, args=(step,))
            receiving.start()
            stats = sender.send(parts, engine.refit_layout(), args.bucket_mb << 20, expectation.add)
            receiving.join()
            times.append(time.perf_counter() - start)
            start = time.perf_counter()
            try:
                check(engine.weight_digests(32, step), expectation)
                outcomes.append("ok")
            except Exception as error:  # recorded: the script reports, the target says it must be ok
                outcomes.append(str(error)[:200])
            checks.append(time.perf_counter() - start)
    refit_s = statistics.median(times[1:])
    result = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        parameters=sum(p.numel() for p in model.parameters()),
        bytes=stats.bytes,
        refit_s=refit_s,
        gb_per_s=stats.bytes / refit_s / 1e9,
        check_s=statistics.median(checks[1:]),
        outcomes=outcomes,
        targets={"check passes": all(o == "ok" for o in outcomes), "refit <= 5 s": refit_s <= 5},
    )
    print(result, flush=True)
    write_result(args.json, result)


if __name__ == "__main__":
    main()
