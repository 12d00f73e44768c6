"""The refit's wire (generation/weight_transfer.py) between real gloo group members: one sender and two receivers
on threads of this process, as a training rank and two engine workers would be."""

import threading

import torch

from reinforge.generation.weight_transfer import Sender, TransferInfo, buckets, open_group, receive


def test_buckets_hold_at_most_their_size_a_larger_tensor_alone_and_end_each_group():
    a, b, c = torch.zeros(10), torch.zeros(10), torch.zeros(100)  # 40, 40 and 400 bytes
    out = [([n for n, _ in bucket], end) for bucket, end in buckets([[("a", a), ("b", b), ("c", c)], [("d", a)]], 80)]
    assert out == [(["a", "b"], False), (["c"], True), (["d"], True)]


def test_every_receiver_gets_every_tensor_bit_for_bit_refit_after_refit():
    gen = torch.Generator().manual_seed(0)
    parts = [
        [("embed", torch.randn(50, 8, generator=gen)), ("norm", torch.randn(8, generator=gen).bfloat16())],
        [("layers.0.w", torch.randn(64, 64, generator=gen)), ("layers.0.i", torch.arange(6).view(2, 3))],
        [("layers.1.w", torch.randn(8, 8, generator=gen).t())],  # not contiguous: sent as its values
    ]
    sender = Sender()
    port = sender.host(world_size=3, timeout_s=60)
    received = {1: [], 2: []}

    def engine_worker(rank: int) -> None:
        group, _ = open_group(TransferInfo("127.0.0.1", port, rank, 3, 60), rank)
        for _ in range(2):  # two refits
            loaded = {}
            receive(group, lambda named, end: loaded.update({n: (t.clone(), end) for n, t in named}))
            received[rank].append(loaded)

    workers = [threading.Thread(target=engine_worker, args=(rank,)) for rank in (1, 2)]
    for worker in workers:
        worker.start()
    sender.join()
    stats = [sender.send(parts, None, drop=["norm"], bucket_bytes=4096) for _ in range(2)]
    for worker in workers:
        worker.join(timeout=60)
    sent = {name: t for part in parts for name, t in part if name != "norm"}
    assert stats[0].bytes == sum(t.numel() * t.element_size() for t in sent.values())
    assert stats[0].buckets == 4  # the embedding's group, the 16 KiB weight alone, the small one, layer 1
    for rank in (1, 2):
        for loaded in received[rank]:
            assert set(loaded) == set(sent)
            for name, tensor in sent.items():
                assert torch.equal(loaded[name][0], tensor) and loaded[name][0].dtype == tensor.dtype, name
            assert [loaded[n][1] for n in ("embed", "layers.0.i", "layers.1.w")] == [True, True, True]
            assert loaded["layers.0.w"][1] is False
