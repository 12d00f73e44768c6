"""`reinforge_gloo`, a weight-transfer backend of vLLM's RL protocol (`vllm.distributed.weight_transfer`): the engine
side of the refit's wire (generation/weight_transfer.py), registered with vLLM's `WeightTransferEngineFactory`.

`register` runs in every vLLM process: a `vllm.general_plugins` entry point (pyproject.toml) names it, and vLLM
loads its general plugins in each engine and worker process it starts; the engine's own process calls it too before
it builds the engine. vLLM's worker then drives the backend through the protocol's four calls: the engine joins
the sender's transfer group (`init_weight_transfer_engine`), and each refit is `start_weight_update` (vLLM's
layerwise reload: a layer's weights are processed, e.g. repacked for the CPU's kernels, once all of them arrived),
`update_weights` (receive buckets until the sender's end header, each loaded with the model's own `load_weights`,
which takes a tensor-parallel worker's slice as it does from a checkpoint), `finish_weight_update`.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferUpdateInfo

from reinforge.generation.weight_transfer import TransferInfo, open_group, receive

BACKEND = "reinforge_gloo"


@dataclass
class Update(WeightTransferUpdateInfo):
    """A refit's update info: nothing; the stream's own headers say what comes (weight_transfer.py)."""


class GlooWeightTransferEngine(WeightTransferEngine):
    """The worker side of `reinforge_gloo`: this worker joins the transfer group as `rank_offset` + its rank in the
    engine (data-parallel replicas after one another), and loads what the sender broadcasts."""

    init_info_cls = TransferInfo
    update_info_cls = Update
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.store = None
        self.names: list[str] = []  # what the last update loaded, in order
        self.bytes_received = 0

    def init_transfer_engine(self, init_info: TransferInfo) -> None:
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group, self.store = open_group(init_info, rank)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # the base class's update_weights ends with torch.accelerator.synchronize(), which a CPU worker lacks
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: Update) -> None:
        if self.group is None:
            raise RuntimeError("reinforge_gloo: update_weights before init_weight_transfer_engine")
        self.names = []

        def load(named, group_end: bool) -> None:
            self.names += [name for name, _ in named]
            self.model.load_weights(named)

        self.bytes_received = receive(self.group, load)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.group = self.store = None


def register() -> None:
    """Register `reinforge_gloo` with vLLM's factory (idempotent: vLLM may load its plugins more than once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)


def transfer_config():
    """vLLM's `weight_transfer_config` for an engine the refit reaches over the wire (registered here first: the
    engine's own process may have loaded vLLM's plugins before reinforge was importable)."""
    from vllm.config import WeightTransferConfig

    register()
    return WeightTransferConfig(backend=BACKEND)


def received_names(worker) -> list[str]:
    """Run inside vLLM's worker: the names the last update loaded (the refit check's checkpoint names)."""
    return list(worker.weight_transfer_engine.names)
