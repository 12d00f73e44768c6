"""The Tinker service's device queue: a model's requests run in seq_id order whatever order they arrive in, sessions
take turns, a refused number does not stall the next ones, the queue is bounded, failures become failed futures."""

import asyncio
import threading

import pytest

from reinforge.tinker.errors import QueueFull, TinkerRequestError
from reinforge.tinker.futures import FutureStore, Job, Payload, Scheduler


@pytest.fixture
def queue():
    futures = FutureStore(result_ttl_s=60)
    scheduler = Scheduler(futures, max_queued=8)
    gate = threading.Event()
    ran: list[str] = []
    scheduler.submit(Job(futures.create("gate"), "gate", lambda: (gate.wait(10), Payload({}))[1]))
    scheduler.start()
    yield futures, scheduler, gate, ran
    gate.set()
    scheduler.stop()


def job(futures, ran, session, name, model=None, seq=None):
    def run():
        ran.append(name)
        return Payload({"name": name})

    return Job(futures.create(session), session, run, model, seq, name)


def wait_all(futures, ids):
    async def waited():
        return [await futures.wait(i, 10) for i in ids]

    return asyncio.run(waited())


def test_a_models_requests_run_in_seq_order_and_sessions_take_turns(queue):
    futures, scheduler, gate, ran = queue
    scheduler.register_model("m", 1)
    jobs = [job(futures, ran, "a", f"a{seq}", "m", seq) for seq in (3, 1, 2)]
    jobs += [job(futures, ran, "b", f"b{i}") for i in range(3)]
    for j in jobs:
        scheduler.submit(j)
    gate.set()
    wait_all(futures, [j.request_id for j in jobs])
    assert ran == ["a1", "b0", "a2", "b1", "a3", "b2"]


def test_a_refused_number_does_not_hold_up_the_next(queue):
    futures, scheduler, gate, ran = queue
    scheduler.register_model("m", 1)
    later = job(futures, ran, "a", "a2", "m", 2)
    scheduler.submit(later)
    scheduler.skip("m", 1)
    gate.set()
    (record,) = wait_all(futures, [later.request_id])
    assert record.payload.body == {"name": "a2"} and ran == ["a2"]


def test_the_queue_is_bounded_and_failures_are_failed_futures(queue):
    futures, scheduler, gate, ran = queue

    def refuse():
        raise TinkerRequestError("datum 0: bad\nsecond line")

    def crash():
        raise RuntimeError("boom")

    bad = [Job(futures.create("a"), "a", refuse, kind="fb"), Job(futures.create("a"), "a", crash, kind="fb")]
    for j in bad:
        scheduler.submit(j)
    fillers = [job(futures, ran, "b", f"b{i}") for i in range(6)]  # the gate runs already: 8 queued
    for j in fillers:
        scheduler.submit(j)
    with pytest.raises(QueueFull, match="max_queued_requests"):
        scheduler.submit(job(futures, ran, "b", "one too many"))
    gate.set()
    user, server = wait_all(futures, [j.request_id for j in bad])
    assert user.error == ("datum 0: bad second line", "user")
    assert server.error == ("internal server error in fb: boom", "server")
    assert len(wait_all(futures, [j.request_id for j in fillers])) == 6


def test_a_poll_waits_then_answers_pending_or_the_result():
    futures = FutureStore(result_ttl_s=60)
    request_id = futures.create("a")

    async def poll():
        pending = await futures.wait(request_id, 0.05)
        threading.Timer(0.05, futures.finish, (request_id, Payload(b"proto"))).start()
        done = await futures.wait(request_id, 5)
        return pending, done

    pending, done = asyncio.run(poll())
    assert pending is None and done.payload.is_proto and done.payload.body == b"proto"


def test_jobs_with_one_batch_key_share_a_call_and_a_failed_batch_runs_them_alone(queue):
    futures, scheduler, gate, ran = queue
    calls: list[list[str]] = []

    def together(jobs):
        calls.append([j.args for j in jobs])
        if "bad" in calls[-1]:
            raise TinkerRequestError("bad prompt")
        return [Payload({"name": j.args}) for j in jobs]

    def alone(name):
        def run():
            if name == "bad":
                raise TinkerRequestError("bad prompt")
            ran.append(name)
            return Payload({"name": name})

        return run

    def sample(name, key):
        return Job(futures.create("a"), "a", alone(name), kind="sample", batch_key=key, run_batch=together, args=name)

    first = [sample(name, "k") for name in ("p0", "p1", "p2")] + [sample("other", "k2")]
    second = [sample(name, "k3") for name in ("q0", "bad", "q1")]
    for j in first + second:
        scheduler.submit(j)
    gate.set()
    records = wait_all(futures, [j.request_id for j in first + second])
    assert calls == [["p0", "p1", "p2"], ["q0", "bad", "q1"]]  # a lone job runs on its own
    assert [r.payload.body["name"] if r.payload else r.error[0] for r in records] == [
        "p0", "p1", "p2", "other", "q0", "bad prompt", "q1",
    ]  # fmt: skip
    assert ran == ["other", "q0", "q1"]
