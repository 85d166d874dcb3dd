"""Ordered dispatch: many buckets, random per-rank delays, no mismatch, no hang; the fused local work.

Every bucket is one parameter (DDP's bucket cap below one parameter's size), so the
reference can follow each bucket's error feedback on its own, in plain torch.  DDP's
first backward runs with all parameters in one bucket and then rebuilds; one step of
zero gradients first (it sends zeros and leaves zero residuals) puts the real steps on
the final buckets, at step counter 1 onwards.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flexcomm
from flexcomm.comm import Dispatcher, dispatch
from flexcomm.compress import k_for, unpack_all
from delays import SlowBackward
from multiproc import run_world

BUCKETS = 10
NUMEL = 4096
DENSITY = 0.02


class ManyBuckets(nn.Module):
    """BUCKETS parameters; the loss ``sum_j sum(p_j * g_j)`` makes ``p_j.grad == g_j``."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.zeros(NUMEL)) for _ in range(BUCKETS)])
        self.rng = rng

    def forward(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return sum((SlowBackward.apply(w, self.rng.uniform(0, 0.004)) * g).sum() for w, g in zip(self.weights, grads))


def gradients(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * rank + 7)
    return [torch.randn(NUMEL, generator=gen) * (1 + j) for j in range(BUCKETS)]


def _delay_collectives(rng: random.Random) -> None:
    """Every collective this process issues waits a random 0-4 ms first."""
    for name in ("all_reduce", "broadcast", "all_gather_into_tensor"):
        original = getattr(dist, name)

        def delayed(*args, _original=original, **kwargs):
            time.sleep(rng.uniform(0, 0.004))
            return _original(*args, **kwargs)

        setattr(dist, name, delayed)


def one_bucket_per_parameter(rng: random.Random, compressor: str) -> tuple[DDP, flexcomm.FlexState]:
    model = DDP(ManyBuckets(rng), bucket_cap_mb=NUMEL * 4 / 2**20 / 2)
    state = flexcomm.register(model, compressor=compressor, density=DENSITY)
    model(gradients(0, 0)).mul(0).backward()  # DDP's first backward, then its bucket rebuild
    state.drain_records()
    return model, state


def _train_with_delays(rank: int, world: int, compressor: str, steps: int) -> dict:
    rng = random.Random(1234 + rank)
    _delay_collectives(rng)
    model, state = one_bucket_per_parameter(rng, compressor)
    updates = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        model(gradients(rank, step)).backward()
        updates.append([w.grad.detach().clone() for w in model.module.weights])
    records = state.drain_records()
    return {"updates": updates, "buckets_per_step": len(records) / steps, "leaders": sorted({r.leader for r in records})}


def reference(world: int, compressor: str, steps: int) -> list[list[torch.Tensor]]:
    """AR-Topk (STAR) or AG-Topk with error feedback, per parameter, all ranks simulated."""
    k = k_for(NUMEL, DENSITY)
    residuals = [[torch.zeros(NUMEL) for _ in range(BUCKETS)] for _ in range(world)]
    out = []
    for step in range(steps):
        grads = [gradients(r, step) for r in range(world)]
        step_updates = []
        for j in range(BUCKETS):
            accumulated = [grads[r][j] + residuals[r][j] for r in range(world)]
            if compressor == "artopk-star":
                leader_indices = torch.topk(accumulated[(step + 1) % world].abs(), k).indices  # after the zero step
                chosen = [leader_indices] * world
            else:
                chosen = [torch.topk(a.abs(), k).indices for a in accumulated]
            update = torch.zeros(NUMEL)
            for r, (a, idx) in enumerate(zip(accumulated, chosen)):
                update.index_add_(0, idx, a[idx])
                residuals[r][j] = a.clone().index_fill_(0, idx, 0)
            step_updates.append(update / world)
        out.append(step_updates)
    return out


@pytest.mark.parametrize("compressor,world", [("artopk-star", 2), ("artopk-star", 4), ("agtopk", 2)])
def test_many_buckets_with_random_delays_match_the_reference_on_every_rank(compressor: str, world: int) -> None:
    steps = 4
    results = run_world(_train_with_delays, world, compressor, steps, timeout_s=60.0)
    expected = reference(world, compressor, steps)
    for rank, result in enumerate(results):
        assert result["buckets_per_step"] == BUCKETS  # really one bucket per parameter
        for step in range(steps):
            for j in range(BUCKETS):
                torch.testing.assert_close(result["updates"][step][j], expected[step][j], msg=f"rank {rank} step {step} bucket {j}")
                # Every rank holds the same update, bit for bit (the same collectives, in the same order).
                assert torch.equal(result["updates"][step][j], results[0]["updates"][step][j])
    if compressor == "artopk-star":
        assert results[0]["leaders"] == list(range(world))


# ---------------------------------------------------------------- the fused local work, bit for bit

def _capture_what_is_sent() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copies of what this process hands to allreduce/allgather (before they run) and of the broadcast indices (after)."""
    messages: list[torch.Tensor] = []
    indices: list[torch.Tensor] = []
    gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    reduce, gather, broadcast = dist.all_reduce, getattr(dist, gather_name), dist.broadcast

    def all_reduce(tensor, *args, **kwargs):
        messages.append(tensor.detach().clone())
        return reduce(tensor, *args, **kwargs)

    def all_gather_into_tensor(output, message, *args, **kwargs):
        messages.append(message.detach().clone())
        return gather(output, message, *args, **kwargs)

    def broadcast_indices(tensor, *args, **kwargs):
        work = broadcast(tensor, *args, **kwargs)  # blocking: the tensor holds the leader's indices now
        indices.append(tensor.detach().clone())
        return work

    dist.all_reduce, dist.broadcast = all_reduce, broadcast_indices
    setattr(dist, gather_name, all_gather_into_tensor)
    return messages, indices


def _sent_and_residuals(rank: int, world: int, compressor: str, steps: int) -> list[str]:
    """Per bucket and step: what this rank sent (times N: ranks send ``a_i[I] / N``) plus its new residual
    equals its a_i, bit for bit (N = 2: the division is exact)."""
    messages, broadcast_indices = _capture_what_is_sent()
    model, state = one_bucket_per_parameter(random.Random(rank), compressor)
    names = {f"weights.{j}": j for j in range(BUCKETS)}
    k = k_for(NUMEL, DENSITY)
    failures = []
    for step in range(steps):
        grads = gradients(rank, step)
        before = state.memory.state_dict()["pieces"]  # residual per parameter name
        messages.clear()
        broadcast_indices.clear()
        model.zero_grad(set_to_none=True)
        model(grads).backward()
        after = state.memory.state_dict()["pieces"]
        for position, rec in enumerate(state.drain_records()):
            ((name, _),) = state.memory.layout(rec.bucket)
            g = grads[names[name]]
            a = g if name not in before else torch.add(g, before[name])
            if compressor == "agtopk":
                values, indices = unpack_all(messages[position], 1, k, torch.float32)
            else:
                values, indices = messages[position][:k], broadcast_indices[position]
            sent = torch.zeros(NUMEL).index_put_((indices.long(),), values * world)
            if not torch.equal(sent + after[name], a):
                failures.append(f"step {step} {name}: sent + new residual != a_i")
            if int((sent != 0).sum()) > k:
                failures.append(f"step {step} {name}: more than k values sent")
    return failures


@pytest.mark.parametrize("compressor", ["artopk-star", "agtopk"])
def test_sent_plus_new_residual_equals_the_accumulated_gradient_bit_for_bit(compressor: str) -> None:
    for failures in run_world(_sent_and_residuals, 2, compressor, 3):
        assert failures == []


# ---------------------------------------------------------------- the dispatcher itself

def test_dispatcher_runs_in_order_and_propagates_errors() -> None:
    dispatcher = Dispatcher()
    order: list[int] = []

    def task(i: int, fail: bool = False):
        def run() -> torch.futures.Future:
            order.append(i)
            if fail:
                raise RuntimeError(f"collective {i} failed")
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(torch.tensor([i]))
            return fut
        return run

    futures = [dispatcher.submit(task(i)) for i in range(5)]
    assert [int(f.wait()) for f in futures] == list(range(5))
    failed = dispatcher.submit(task(5, fail=True))
    with pytest.raises(RuntimeError, match="collective 5 failed"):
        failed.wait()
    later = dispatcher.submit(task(6))
    with pytest.raises(RuntimeError, match="an earlier exchange failed, so this one was not started"):
        later.wait()
    assert order == list(range(6))  # the task after the failure never ran


def test_dispatcher_propagates_an_asynchronous_error() -> None:
    dispatcher = Dispatcher()
    pending: torch.futures.Future = torch.futures.Future()
    result = dispatcher.submit(lambda: pending)
    pending.set_exception(RuntimeError("timed out waiting for peer"))
    with pytest.raises(RuntimeError, match="timed out waiting for peer"):
        result.wait()


def _recording(seen: list[tuple[int, threading.Thread]], i: int) -> Callable[[], torch.futures.Future]:
    """A task that notes its number and thread, and returns a done future holding ``i``."""
    def run() -> torch.futures.Future:
        seen.append((i, threading.current_thread()))  # the thread object: its id cannot be reused
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(torch.tensor([i]))
        return fut
    return run


def _wait_all(futures: list[torch.futures.Future], deadline_s: float = 60.0) -> list[int]:
    """The futures' values; fails instead of hanging if one was stranded."""
    deadline = time.monotonic() + deadline_s
    while not all(f.done() for f in futures):
        assert time.monotonic() < deadline, f"{sum(not f.done() for f in futures)} tasks never ran"
        time.sleep(0.01)
    return [int(f.value()) for f in futures]


def _alive(name: str) -> bool:
    return any(t.name == name for t in threading.enumerate())


def _until_gone(name: str, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while _alive(name):
        assert time.monotonic() < deadline, f"worker {name} still running"
        time.sleep(0.01)


def test_one_worker_serves_submissions_with_gaps_between_them() -> None:
    # As in backward: DDP hands a bucket over, the dispatcher drains it, the next one follows.
    dispatcher = Dispatcher(idle_timeout=60.0)
    seen: list[tuple[int, threading.Thread]] = []
    values = []
    for i in range(50):
        values.append(int(dispatcher.submit(_recording(seen, i)).wait()))  # the queue is empty after each
        time.sleep(0.001)
    dispatcher.close()
    assert values == list(range(50))
    assert len({thread for _, thread in seen}) == 1


def test_the_worker_ends_after_the_idle_timeout_and_a_new_one_takes_over() -> None:
    dispatcher = Dispatcher(name="flexcomm-test-idle", idle_timeout=0.05)
    seen: list[tuple[int, threading.Thread]] = []
    assert int(dispatcher.submit(_recording(seen, 0)).wait()) == 0
    _until_gone("flexcomm-test-idle")
    assert int(dispatcher.submit(_recording(seen, 1)).wait()) == 1
    assert seen[0][1] is not seen[1][1]
    _until_gone("flexcomm-test-idle")
    dispatcher.close()  # with no worker: returns at once


def test_an_idle_worker_holds_no_task() -> None:
    # A task holds its state and bucket; an idle worker must not keep them alive.
    class Task:
        def __call__(self) -> torch.futures.Future:
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(torch.zeros(1))
            return done

    dispatcher = Dispatcher(name="flexcomm-test-holds", idle_timeout=3600.0)
    task = Task()
    held = weakref.ref(task)
    dispatcher.submit(task).wait()
    del task
    deadline = time.monotonic() + 30.0
    while held() is not None:  # the worker may still be on its way back from the task
        assert time.monotonic() < deadline, "the idle worker still holds the task"
        time.sleep(0.01)
    assert _alive("flexcomm-test-holds")
    dispatcher.close()


def test_close_ends_an_idle_worker_at_once_and_later_tasks_still_run() -> None:
    dispatcher = Dispatcher(name="flexcomm-test-close", idle_timeout=3600.0)
    seen: list[tuple[int, threading.Thread]] = []
    assert int(dispatcher.submit(_recording(seen, 0)).wait()) == 0
    assert _alive("flexcomm-test-close")  # waiting for the next task
    dispatcher.close()
    assert not _alive("flexcomm-test-close")  # close() waited for it to end
    assert int(dispatcher.submit(_recording(seen, 1)).wait()) == 1
    _until_gone("flexcomm-test-close")  # after close a worker ends on an empty queue


def test_submissions_racing_the_idle_timeout_run_once_each_in_order() -> None:
    # Gaps around the idle timeout: many submissions land while the worker decides to end.
    timeout = 0.003
    rng = random.Random(21)
    dispatcher = Dispatcher(idle_timeout=timeout)
    seen: list[tuple[int, threading.Thread]] = []
    futures = []
    for i in range(400):
        futures.append(dispatcher.submit(_recording(seen, i)))
        time.sleep(rng.uniform(0.3, 1.7) * timeout)
    assert _wait_all(futures) == list(range(400))
    assert [i for i, _ in seen] == list(range(400))
    assert len({thread for _, thread in seen}) > 1  # workers did end and hand over


def _submit_in_child(dispatcher: Dispatcher) -> None:
    values = _wait_all([dispatcher.submit(_recording([], 7))], deadline_s=30.0)
    os._exit(0 if values == [7] else 1)


def test_a_forked_child_starts_its_own_worker() -> None:
    # The parent's worker is idle at the fork; the child has the dispatcher but not the thread.
    dispatcher = Dispatcher(idle_timeout=60.0)
    dispatcher.submit(_recording([], 0)).wait()
    child = multiprocessing.get_context("fork").Process(target=_submit_in_child, args=(dispatcher,))
    child.start()
    child.join(60.0)
    dispatcher.close()
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0


EXITS_WITHOUT_CLOSE = """
import atexit, threading

ran = []

def report() -> None:  # registered before flexcomm's hook, so it runs after it (atexit is LIFO)
    print("ran:", len(ran), "workers at exit:", [t.name for t in threading.enumerate() if t.name.startswith("exit-test")], flush=True)

atexit.register(report)
import torch
from flexcomm.comm import Dispatcher, dispatch

def task() -> torch.futures.Future:
    done = torch.futures.Future()
    done.set_result(torch.ones(1000, 1000).sum())  # C++ work, as a bucket's task does
    ran.append(1)
    return done

print("result:", int(Dispatcher("exit-test-idle").submit(task).wait()), flush=True)  # then idle at exit
busy = Dispatcher("exit-test-busy")
for _ in range(20):
    busy.submit(task)  # still running at exit
"""


def test_a_process_exits_cleanly_with_workers_idle_or_busy_and_no_close() -> None:
    # The old dispatcher aborted here most times ("terminate called without an active exception").
    src = str(Path(flexcomm.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", EXITS_WITHOUT_CLOSE], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["result: 1000000", "ran: 21 workers at exit: []"]


EXITS_WITH_A_STUCK_TASK = """
import threading, time
from flexcomm.comm import dispatch

dispatch.EXIT_WAIT_S = 0.5
never = threading.Event()
dispatcher = dispatch.Dispatcher()
dispatcher.submit(lambda: never.wait())  # a task that never returns, like a collective whose peer died
time.sleep(0.1)
dispatch._close_all()
print("gave up; worker still in its task:", any(t.name == "flexcomm-dispatch" for t in threading.enumerate()))
"""


def test_exit_waits_a_bounded_time_for_a_task_that_never_returns() -> None:
    src = str(Path(flexcomm.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", EXITS_WITH_A_STUCK_TASK], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gave up; worker still in its task: True"


def test_deferred_halves_run_in_order_and_a_failed_one_does_not_strand_the_rest() -> None:
    deferred, ran = dispatch.Deferred(), []

    def failing() -> None:
        ran.append("b")
        raise ValueError("half b failed")

    for half in (lambda: ran.append("a"), failing, lambda: ran.append("c")):
        deferred.defer(half, torch.futures.Future())
    halves = deferred.take()
    assert deferred.take() == []
    with pytest.raises(ValueError, match="half b failed"):
        dispatch.run_halves(halves)
    assert ran == ["a", "b", "c"]  # c's bucket still completes: its future must not wait forever


def test_halves_that_will_not_run_fail_their_buckets() -> None:
    done, pending = torch.futures.Future(), torch.futures.Future()
    done.set_result(torch.zeros(1))
    dispatch.fail_halves([(lambda: None, done), (lambda: None, pending)], ValueError("bucket 3 failed"))
    assert torch.equal(done.wait(), torch.zeros(1))
    with pytest.raises(RuntimeError, match="a later bucket's exchange failed before this one finished: ValueError"):
        pending.wait()


def test_forward_to_completes_the_result_with_the_value_or_the_error() -> None:
    ok, failed = torch.futures.Future(), torch.futures.Future()
    source_ok, source_failed = torch.futures.Future(), torch.futures.Future()
    source_ok.add_done_callback(dispatch.forward_to(ok))
    source_failed.add_done_callback(dispatch.forward_to(failed))
    source_ok.set_result(torch.ones(2))
    source_failed.set_exception(RuntimeError("collective failed"))
    assert torch.equal(ok.wait(), torch.ones(2))
    with pytest.raises(RuntimeError, match="collective failed"):
        failed.wait()


def test_a_failure_between_tasks_fails_the_halves_deferred_before_it() -> None:
    # A bucket deferred its second half; an earlier collective then fails asynchronously, so the
    # next bucket's task is skipped and never runs that half: its bucket must fail, not wait.
    dispatcher = Dispatcher()
    half_result: torch.futures.Future = torch.futures.Future()
    pending: torch.futures.Future = torch.futures.Future()
    deferred = threading.Event()

    def defers() -> torch.futures.Future:
        dispatcher.deferred.defer(lambda: None, half_result)
        deferred.set()
        return pending

    first = dispatcher.submit(defers)
    assert deferred.wait(60)
    pending.set_exception(RuntimeError("peer died"))
    with pytest.raises(RuntimeError, match="peer died"):
        first.wait()
    skipped = dispatcher.submit(lambda: pending)
    with pytest.raises(RuntimeError, match="an earlier exchange failed"):
        skipped.wait()
    _assert_failed_soon(half_result, "a later bucket's exchange failed before this one finished")


def test_a_task_that_fails_before_taking_the_deferred_halves_fails_their_buckets() -> None:
    # The next bucket's task raises before the hook took the earlier halves (e.g. entering its CUDA
    # exchange context): no later task may come (it was the step's last bucket), so they fail now.
    dispatcher = Dispatcher()
    half_result: torch.futures.Future = torch.futures.Future()
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(torch.zeros(1))

    def defers() -> torch.futures.Future:
        dispatcher.deferred.defer(lambda: None, half_result)
        return done

    def raises() -> torch.futures.Future:
        raise RuntimeError("CUDA error: an illegal memory access")

    dispatcher.submit(defers).wait()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        dispatcher.submit(raises).wait()
    _assert_failed_soon(half_result, "a later bucket's exchange failed before this one finished")


def _assert_failed_soon(future: torch.futures.Future, message: str, deadline_s: float = 60.0) -> None:
    """``future`` fails with ``message``; an assertion instead of a hang if it was left waiting."""
    deadline = time.monotonic() + deadline_s
    while not future.done():
        assert time.monotonic() < deadline, "the deferred half's bucket was left waiting"
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match=message):
        future.wait()
