"""The refit's wire: the trainer's weights from one sender (the training ranks' rank 0) to every engine worker, in
buckets, with no process ever holding more than its own weights plus two buckets.

This is the data plane of vLLM's weight-transfer protocol (`init_weight_transfer_engine`, `start_weight_update`,
`update_weights`, `finish_weight_update`) for a backend of reinforge's own, `reinforge_gloo`
(generation/vllm_transfer.py registers it with vLLM; the HF engine uses the same receiver): a gloo process group
over a TCP store the sender hosts, rank 0 the sender, the engines' workers ranks 1.. (each engine's workers in
order, `rank_offset` + the worker's tensor-parallel rank). It runs wherever torch runs, on CPU and across nodes; on
GPUs vLLM's own `nccl` (or `ipc` for a colocated engine) moves the bytes.

The stream is a sequence of buckets, each a header and a payload broadcast from rank 0:
- the header: the bucket's names, dtypes and shapes, and whether it ends a group (one decoder layer, or what is
  outside the layers), as JSON; an empty header ends the stream;
- the payload: the bucket's tensors' bytes, one flat buffer.
Every engine worker receives every bucket (a tensor-parallel worker takes its own slice as it loads, as it does
from a checkpoint). The sender holds at most two buckets, one on the wire while the next layer is gathered and its
bucket built, and sends floating weights in the engine's dtype (`WireLayout`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Iterator

import torch

Named = list[tuple[str, torch.Tensor]]


@dataclass
class TransferInfo:
    """Where the transfer group meets: the sender's address and port, this member's rank offset (its first rank:
    0 for the sender, 1 + the workers of the engines before it for an engine) and the group's size."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


def _store(info: TransferInfo, is_master: bool):
    return torch.distributed.TCPStore(
        info.master_address,
        info.master_port,
        info.world_size,
        is_master=is_master,
        timeout=timedelta(seconds=info.timeout_s),
        wait_for_workers=False,
    )


def open_group(info: TransferInfo, rank: int, store=None):
    """Join the transfer group as `rank` (0: the sender, who hosts the store; `store` if it made it already): a gloo
    group of its own, apart from any torch.distributed group the process is in (the training ranks' FSDP group,
    vLLM's tensor-parallel group). Returns once every member has joined."""
    store = store or _store(info, is_master=rank == 0)
    prefixed = torch.distributed.PrefixStore("reinforge-refit", store)
    group = torch.distributed.ProcessGroupGloo(prefixed, rank, info.world_size, timedelta(seconds=info.timeout_s))
    return group, store


class Sender:
    """The sender's side: `host` the store (a free port of this machine), then `join` while the receivers join,
    then `send` each refit."""

    def __init__(self):
        self.info, self.store, self.group = None, None, None

    def host(self, world_size: int, timeout_s: float) -> int:
        """Listen for the group's members on a free port (returned)."""
        self.info = TransferInfo("0.0.0.0", 0, 0, world_size, timeout_s)
        self.store = _store(self.info, is_master=True)
        return self.store.port

    def join(self) -> None:
        self.group, self.store = open_group(self.info, 0, self.store)

    def send(
        self, parts: Iterable[Named], layout: "WireLayout", bucket_bytes: int,
        on_group: Callable[[dict], None] | None = None,
    ) -> SendStats:  # fmt: skip
        """`parts` (the trainer's weights, a decoder layer at a time) as the engines load them (`in_layout`), each
        also handed to `on_group` (the refit check's expected side) while the one before is on the wire."""

        def laid_out():
            for part in parts:
                group = in_layout(part, layout)
                if on_group is not None:
                    on_group(dict(group))
                yield group

        return send(self.group, laid_out(), bucket_bytes)


@dataclass(frozen=True)
class WireLayout:
    """What the sender makes of the trainer's weights for an engine (its `refit_layout()`): the model whose
    checkpoint layout it loads (vLLM; None: the trainer's own names, the HF engine), the tied names it has no
    parameter of, and the dtype it computes in (floating weights are sent in it: fp32 master weights to a bf16
    engine cross the wire at half the bytes; None: as they are)."""

    checkpoint_model: str | None = None
    drop: tuple[str, ...] = ()
    dtype: str | None = None


def in_layout(part: Named, layout: WireLayout) -> Named:
    """One part of the trainer's weights as an engine loads them (`WireLayout`)."""
    if layout.checkpoint_model is None:
        named = [(name, tensor) for name, tensor in part if name not in layout.drop]
    else:
        from reinforge.generation.checkpoint_layout import checkpoint_layout

        named = list(checkpoint_layout(layout.checkpoint_model, part, layout.drop).items())
    dtype = getattr(torch, layout.dtype) if layout.dtype else None
    return [(n, t.to(dtype) if dtype is not None and t.is_floating_point() else t) for n, t in named]


def _broadcast(group, tensor: torch.Tensor):
    """Start broadcasting `tensor` from rank 0 (in place on the others); the returned work is waited on later."""
    return group.broadcast([tensor], torch.distributed.BroadcastOptions())


def _start(group, header: dict | None, flat: torch.Tensor | None = None) -> tuple[list, tuple]:
    """Start broadcasting a header (None: the end of the stream) and its payload: the works, and the buffers they
    read, to be kept alive until the works are done (gloo reads them on threads of its own)."""
    raw = json.dumps(header).encode() if header is not None else b""
    size = torch.tensor([len(raw)], dtype=torch.int64)
    works = [_broadcast(group, size)]
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else None
    if data is not None:
        works.append(_broadcast(group, data))
    if flat is not None and flat.numel():
        works.append(_broadcast(group, flat))
    return works, (size, data, flat)


def _receive_header(group) -> dict | None:
    size = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, size).wait()
    if not size.item():
        return None
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    _broadcast(group, data).wait()
    return json.loads(data.numpy().tobytes())


def buckets(groups: Iterable[Named], bucket_bytes: int) -> Iterator[tuple[Named, bool]]:
    """Each group's tensors in buckets of at most `bucket_bytes` (a larger tensor alone), with whether a bucket
    ends its group."""
    for group in groups:
        bucket, size = [], 0
        for name, tensor in group:
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket, False
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += nbytes
        yield bucket, True


@dataclass
class SendStats:
    """What one `send` moved: bytes of weights, buckets, and the largest bucket in bytes."""

    bytes: int = 0
    buckets: int = 0
    largest_bucket: int = 0


def send(group, groups: Iterable[Named], bucket_bytes: int) -> SendStats:
    """Broadcast `groups` (lists of (name, tensor), one decoder layer each) to every receiver, then the end header.
    At most two buckets exist at once: the next group is produced (gathered) and its bucket built while the last one is
    on the wire."""
    stats, in_flight = SendStats(), []
    for bucket, group_end in buckets(groups, bucket_bytes):
        tensors = [t.detach().contiguous() for _, t in bucket]
        header = dict(
            names=[n for n, _ in bucket],
            dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            group_end=group_end,
        )
        # on the host: gloo's wire (a GPU sender's bucket is copied down once)
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]).cpu() if tensors else None
        while in_flight:  # this bucket built, the last one still on the wire: two buckets at most
            for work in in_flight.pop(0)[0]:
                work.wait()
        in_flight.append(_start(group, header, flat))
        size = 0 if flat is None else flat.numel()
        stats.bytes, stats.buckets = stats.bytes + size, stats.buckets + 1
        stats.largest_bucket = max(stats.largest_bucket, size)
    in_flight.append(_start(group, None))
    for works, _ in in_flight:
        for work in works:
            work.wait()
    return stats


def receive(group, load: Callable[[Named, bool], None]) -> int:
    """Receive buckets until the end header, handing each to `load(named_tensors, group_end)`; the bytes received.
    A tensor is a view of its bucket's buffer, valid until `load` returns."""
    total = 0
    while True:
        header = _receive_header(group)
        if header is None:
            return total
        sizes = [
            torch.Size(shape).numel() * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
            for dtype, shape in zip(header["dtypes"], header["shapes"])
        ]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        if flat.numel():
            _broadcast(group, flat).wait()
        named, start = [], 0
        for name, dtype, shape, size in zip(header["names"], header["dtypes"], header["shapes"], sizes):
            named.append((name, flat[start : start + size].view(getattr(torch, dtype)).view(shape)))
            start += size
        total += flat.numel()
        load(named, header["group_end"])
