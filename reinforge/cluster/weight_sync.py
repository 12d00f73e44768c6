"""The refit of engines in Ray: the trainer's weights go from the training ranks straight to every engine worker
through the refit's wire (generation/weight_transfer.py; vLLM's weight-transfer protocol with reinforge's
`reinforge_gloo` backend, generation/vllm_transfer.py). The driver only starts the two sides: it never holds a
weight tensor.

The first refit opens the wire: the trainer's main rank hosts the transfer group (a free port on its node), and
every engine's workers join it, engine after engine (`rank_offset`). Each refit then runs both sides at once: the
engines `receive_weights` (vLLM: `start_weight_update`, `update_weights` until the sender's end header,
`finish_weight_update(version)`), while the ranks `send_weights` (every rank gathers a decoder layer, the main
rank sends it in buckets of `generation.refit_bucket_mb` while the next is gathered). A side that fails raises
here; the other, left waiting on the wire, gives up after the group's timeout (`cluster.worker_timeout_s`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


def at_once(first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
    """Run both (each a blocking call to the other processes, under its group's deadline) at the same time; their
    results. When `second` raises, its error is raised at once, not after `first` gave up too: the run's cleanup kills
    the workers `first` waits for, which ends it."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reinforge-refit")
    try:
        future = pool.submit(first)
        result = second()
        return future.result(), result
    finally:
        pool.shutdown(wait=False)


class WeightWire:
    """The wire between one trainer (FSDP2 ranks in Ray, or a backend in the driver's process) and a group of
    engines (cluster/generation_group.py)."""

    def __init__(self, engines, timeout_s: float):
        self.engines, self.timeout_s = engines, timeout_s
        self.layout = None  # the engines' WireLayout (generation/weight_transfer.py), known once the wire is open
        self.weight_layouts: list | None = None

    def open(self, trainer) -> None:
        """The trainer's main rank hosts the group; every engine worker joins it."""
        counts = self.engines.transfer_ranks()
        world_size = 1 + sum(counts)
        host = trainer.transfer_host() if hasattr(trainer, "transfer_host") else self.engines.driver_host()
        port = trainer.host_weight_transfer(world_size, self.timeout_s)
        offsets = [1 + sum(counts[:i]) for i in range(len(counts))]
        infos = [
            dict(master_address=host, master_port=port, rank_offset=o, world_size=world_size, timeout_s=self.timeout_s)
            for o in offsets
        ]
        at_once(lambda: self.engines.init_weight_transfer(infos), trainer.join_weight_transfer)
        self.layout = self.engines.refit_layout()

    def refit(self, trainer, bucket_bytes: int, version: int | None = None, expect=None) -> dict:
        """Every engine takes the trainer's current weights (labelled `version` where it labels tokens); what the
        sender moved (`SendStats` as a dict) and, given `expect` (a refit check's `Expectation` of the engines'
        `layouts()`), it back with the digests the engines must report, computed by the sender as it sent."""
        if self.layout is None:
            self.open(trainer)
        _, stats = at_once(
            lambda: self.engines.receive_weights(version),
            lambda: trainer.send_weights(self.layout, bucket_bytes, expect),
        )
        return stats

    def layouts(self) -> list:
        """Every engine worker's weight layout (names, shapes, dtypes, shards), fetched once: a refit check's."""
        if self.weight_layouts is None:
            self.weight_layouts = self.engines.weight_layouts()
        return self.weight_layouts
