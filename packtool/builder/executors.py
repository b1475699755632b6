"""Where work items run: one ordered map over picklable items, in this process, in local worker processes, or on Ray.

Executors know nothing of the build's stages; the build hands them a module-level function and
an iterator of items and gets the results back in item order:

    items    i0   i1   i2   i3   i4 ...      pulled lazily, at most `depth` ahead of the consumer
    workers  [i1] [i0] [i2]                   finish in any order
    results  r0   r1   r2   r3   r4 ...      yielded in item order

An exception raised by the function is raised again in the caller with its own type and fields
(the worker's traceback is attached as its __cause__); the items still in flight are cancelled.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, NoReturn, Protocol, TypeVar

from packtool.errors import PacktoolError, WorkerError
from packtool.workers import EXECUTORS, WORKERS_CHOICES, count_workers

T = TypeVar("T")
R = TypeVar("R")

RAY_INSTALL = 'pip install "packtool[ray]"'
# Results wait in order behind the slowest item: two items per worker keep every worker busy
# while one straggler finishes, and cap what is held in memory at 2 x workers results.
ITEMS_PER_WORKER = 2
# A local Ray node only carries items and small results through its object store; without a
# limit Ray reserves ~30% of the machine's memory for it.
RAY_OBJECT_STORE_BYTES = 512 * 1024**2
# Where items ran, as counted in Executor.nodes: a Ray node id, or this name for this machine.
LOCAL_NODE = "local"
# A work item allocates millions of short-lived objects (records, rendered texts, tokenizer results)
# that reference counting frees. The default collector still scans them, a pass every 700 net
# allocations: 0.1-0.2 s of a 12k-sample build, all of it holding the GIL. A pass every 50,000
# still bounds what a reference cycle can keep alive (see run_item).
ITEM_COLLECTION_THRESHOLD = 50_000
_PARENT_POLL_S = 0.25  # how soon an orphaned worker notices, when the kernel's death signal is not available
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Executor(Protocol):
    """An ordered map over work items; close() (or leaving the `with` block) stops every worker it started.

    `workers` is how many items run at once. Maps run one after another (worker processes serve
    one map at a time); leaving a map early cancels its items in flight. `fn` runs once per item,
    except that Ray reruns a task whose node was lost: work items write their outputs atomically.
    `nodes` counts the items each node finished, over every map so far (LOCAL_NODE off Ray)."""

    workers: int
    nodes: Counter[str]

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]: ...

    def close(self) -> None: ...

    def __enter__(self) -> Executor: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


def resolve_workers(value: int | str) -> int:
    """`workers` as a count (packtool.workers.count_workers: `auto` by the usable cores); raise for anything else."""
    workers = count_workers(value)
    if workers is None:
        raise PacktoolError(f"workers: expected {WORKERS_CHOICES}, got {value!r}")
    return workers


def make_executor(kind: str, workers: int | str, address: str | None = None) -> Executor:
    """The executor named `kind` with `workers` (a count or `auto`); `address` is a Ray cluster's.

    `processes` with one worker runs in this process: a worker process would only add its start."""
    if kind not in EXECUTORS:
        raise PacktoolError(f"executor: expected one of {', '.join(EXECUTORS)}, got {kind!r}")
    if address is not None and kind != "ray":
        raise PacktoolError(f"a Ray address ({address!r}) needs executor ray, got executor {kind!r}")
    workers = resolve_workers(workers)
    if kind == "ray":
        return RayExecutor(workers, address)
    if kind == "processes" and workers > 1:
        return ProcessExecutor(workers)
    return SerialExecutor()


def describe_workers(workers: int, kind: str = "processes") -> str:
    """How a build with `workers` runs its encode and emit, in words."""
    if kind == "ray":
        return f"Ray, {workers} worker(s)"
    if workers == 1 or kind == "serial":
        return "1 process (its encode threads run the tokenizer beside the Python)"
    return f"{workers} worker processes"


class _Closing:
    """Context manager plumbing shared by the executors; SIGTERM inside the block unwinds like an exception."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._sigterm = _exit_on_sigterm()
        self._sigterm.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.close()
        finally:
            self._sigterm.__exit__(exc_type, exc, tb)


@contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) in the main thread so `finally` blocks cancel work and stop workers.

    Left alone when another handler is installed (Ray installs its own, to the same effect) or off the main thread."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def raise_exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class SerialExecutor(_Closing):
    """Every item in this process, one after the other: the reference the other executors must match."""

    workers = 1

    def __init__(self) -> None:
        self.nodes: Counter[str] = Counter()

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        for item in items:
            result = run_item(fn, item)
            self.nodes[LOCAL_NODE] += 1
            yield result

    def close(self) -> None:
        pass


# -- outcomes: what a worker sends back, the same for processes and Ray ------------------------------


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, chained as its __cause__ in the caller."""

    def __str__(self) -> str:
        return self.args[0]


def run_item(fn: Callable[[T], R], item: T) -> R:
    """fn(item) with the cyclic collector's first generation run every ITEM_COLLECTION_THRESHOLD net allocations
    instead of 700 (a collector the caller switched off, threshold 0, stays off); the setting is restored after."""
    saved = gc.get_threshold()
    if saved[0]:
        gc.set_threshold(max(saved[0], ITEM_COLLECTION_THRESHOLD), *saved[1:])
    try:
        return fn(item)
    finally:
        gc.set_threshold(*saved)


def _outcome(fn: Callable[[Any], Any], item: Any) -> tuple[bool, Any, str]:
    """(True, result, "") or (False, exception, traceback text); an exception that cannot be pickled is described."""
    try:
        return True, run_item(fn, item), ""
    except Exception as exc:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            pickle.dumps(exc)
        except Exception:
            exc = WorkerError(f"{type(exc).__name__}: {exc} (raised in a worker; its type could not be pickled)")
        return False, exc, text


def _unwrap(outcome: tuple[bool, Any, str]) -> Any:
    ok, value, text = outcome
    if ok:
        return value
    raise value from RemoteTraceback(f'\n"""\n{text}"""')


# -- local worker processes ---------------------------------------------------------------------------


def _exit_with_parent(parent_pid: int, kernel_signal: bool) -> None:
    """Make this worker die when its parent does, even by kill -9.

    Linux delivers SIGKILL at once (prctl PR_SET_PDEATHSIG), but only when the spawning thread
    is the parent's main thread: the signal follows the thread, not the process. A watchdog
    thread covers every case by polling for the parent to change (orphans are re-parented)."""
    if kernel_signal and sys.platform.startswith("linux"):
        with suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="packtool-parent-watchdog", daemon=True).start()


def _serve(conn: Connection, parent_pid: int, kernel_signal: bool) -> None:
    """A worker process: run the tasks the parent sends until it sends None or goes away.

    A task is (map number, fn or None, item): fn comes with a worker's first item of each map
    only, since it may carry settings much larger than an item (a functools.partial)."""
    _exit_with_parent(parent_pid, kernel_signal)
    # Ctrl-C reaches the whole process group; the parent alone decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already: no nested thread pool
    current: tuple[int, Callable[[Any], Any]] | None = None
    while True:
        try:
            task = conn.recv_bytes()
        except (EOFError, OSError):
            _leave()
        try:
            unpacked = pickle.loads(task)
        except Exception as exc:
            conn.send(_outcome(_raise, exc))
            continue
        if unpacked is None:
            _leave()
        number, fn, item = unpacked
        if fn is not None:
            current = (number, fn)
        if current is None or current[0] != number:
            outcome = _outcome(_raise, WorkerError("the work function never reached this worker"))
        else:
            outcome = _outcome(current[1], item)
        try:
            reply = pickle.dumps(outcome)
        except Exception as exc:
            reply = pickle.dumps(_outcome(_raise, WorkerError(f"the result of a work item cannot be pickled: {exc}")))
        conn.send_bytes(reply)


def _leave() -> NoReturn:
    """End the worker without the interpreter's teardown. Every reply has been sent and every file a
    work item wrote was closed and published inside it, so teardown would only free memory object by
    object (the tokenizer, the templates, numpy and pyarrow): ~0.1 s that the parent's close() waited
    for, after the last shard and before the manifest."""
    with suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


def _raise(exc: BaseException) -> None:
    raise exc


class _Worker:
    def __init__(self, context: Any) -> None:
        parent_end, child_end = multiprocessing.Pipe(duplex=True)
        kernel_signal = threading.current_thread() is threading.main_thread()
        self.process: BaseProcess = context.Process(
            target=_serve, args=(child_end, os.getpid(), kernel_signal), name="packtool-worker", daemon=True
        )
        self.process.start()
        child_end.close()  # only the worker holds it now, so its death reads as EOF here
        self.conn = parent_end
        self.item: int | None = None  # the item it runs now
        self.map_number = -1  # the last map whose function it received

    def stop(self, *, now: bool) -> None:
        if not now:
            with suppress(OSError):
                self.conn.send(None)
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


class ProcessExecutor(_Closing):
    """`workers` spawned processes on this machine (spawn, not fork: tokenizers' thread pool does not survive a fork).

    Each worker runs one item at a time and receives the next as soon as it is done, so slow and
    fast items mix freely; at most `depth` items are pulled from the iterator ahead of the consumer.
    Workers start with the first map (a build that finds all its work cached starts none)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.depth = ITEMS_PER_WORKER * workers
        self._context = multiprocessing.get_context("spawn")
        self._pool: list[_Worker] = []
        self._closed = False
        self._mapping = False
        self._maps = itertools.count()
        self.nodes: Counter[str] = Counter()

    def _fill(self) -> None:
        while len(self._pool) < self.workers:
            self._pool.append(_Worker(self._context))

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        if self._closed:
            raise PacktoolError("this executor is closed")
        if self._mapping:
            raise RuntimeError("one map at a time: the workers of this executor are serving another map")
        self._fill()
        number = next(self._maps)
        source = enumerate(items)
        idle = list(self._pool)
        busy: dict[Connection, _Worker] = {}
        done: dict[int, tuple[bool, Any, str]] = {}
        pulled = 0  # items taken from `source`
        yielded = 0
        exhausted = False
        self._mapping = True
        try:
            while True:
                while idle and not exhausted and pulled - yielded < self.depth:
                    entry = next(source, None)
                    if entry is None:
                        exhausted = True
                        break
                    worker = idle.pop()
                    worker.item = entry[0]
                    task = pickle.dumps((number, fn if worker.map_number != number else None, entry[1]))
                    busy[worker.conn] = worker  # from here on, its death is this item's failure
                    pulled += 1
                    try:
                        worker.conn.send_bytes(task)
                    except OSError:
                        raise self._lost(worker) from None
                    worker.map_number = number
                while yielded in done:
                    result = _unwrap(done.pop(yielded))
                    yielded += 1
                    self.nodes[LOCAL_NODE] += 1
                    yield result
                if not busy:
                    if exhausted:
                        return
                    continue
                for conn in wait(list(busy)):
                    worker = busy[conn]  # type: ignore[index]
                    done[worker.item] = self._receive(worker)  # type: ignore[index]
                    del busy[conn]  # type: ignore[arg-type]
                    worker.item = None
                    idle.append(worker)
        finally:
            # Left early (an item failed, the consumer stopped, Ctrl-C): the items still running
            # are abandoned, so their workers are stopped now; the next map starts new ones.
            for worker in busy.values():
                worker.stop(now=True)
                self._pool.remove(worker)
            self._mapping = False

    def _receive(self, worker: _Worker) -> tuple[bool, Any, str]:
        try:
            return worker.conn.recv()
        except (EOFError, OSError):
            raise self._lost(worker) from None

    @staticmethod
    def _lost(worker: _Worker) -> WorkerError:
        worker.process.join(timeout=5)
        return WorkerError(
            f"a worker process died (exit code {worker.process.exitcode}) while running work item {worker.item}; "
            + _death_advice(worker.process.exitcode)
        )

    def close(self) -> None:
        self._closed = True
        pool, self._pool = self._pool, []
        for worker in pool:
            worker.stop(now=False)


def _death_advice(code: int | None) -> str:
    """What to change, by how the worker died: each worker holds one work item's records, each bounded by
    max_record_bytes, so memory grows with workers and with that setting, never with one record alone."""
    if code == -signal.SIGKILL:
        return (
            "-9 is SIGKILL, usually the out-of-memory killer: each worker holds a batch of records of up to "
            "max_record_bytes each (tokenizing takes ~150x a record's size), so lower workers, or lower "
            "max_record_bytes when the data has very large records"
        )
    if code is not None and code < 0:
        known = -code in {number.value for number in signal.Signals}
        return f"signal {-code} ({signal.Signals(-code).name if known else 'unknown'}) stopped it from outside packtool"
    return "a worker exits on its own only when Python itself fails (see the lines printed above)"


# -- Ray ------------------------------------------------------------------------------------------------


def _ray_outcome(fn: Callable[[Any], Any], item: Any) -> tuple[str, tuple[bool, Any, str]]:
    """(the id of the node it ran on, _outcome) inside a Ray task, whose worker process Ray started
    (and may reuse) for one CPU."""
    import ray

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one task per CPU already: no nested thread pool
    return ray.get_runtime_context().get_node_id(), _outcome(fn, item)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise PacktoolError(f"executor ray needs Ray, which is not installed: {RAY_INSTALL}") from None
    return ray


def node_turns(nodes: list[dict[str, Any]]) -> list[str]:
    """The node ids of the alive nodes with CPUs, each as many times as it has CPUs, interleaved
    (a, b, a, b, a for three CPUs on a and two on b): the order a map hands its items out."""
    cpus = {node["NodeID"]: int(node["Resources"].get("CPU", 0)) for node in nodes if node["Alive"]}
    rounds = max(cpus.values(), default=0)
    return [node for k in range(rounds) for node in sorted(cpus) if cpus[node] > k]


class RayExecutor(_Closing):
    """Each item a plain Ray task (a CPU each), handed to the nodes in turn; results fetched in item order.

    Items read and write shared storage, so no node is nearer their data. Each map deals its items
    over the nodes' CPUs in turn (node_turns), as a soft node affinity: a node lost or gone is
    skipped by Ray. Not Ray's default, which fills the driver's node first, nor SPREAD, which
    follows resource reports that lag on a busy machine and then sends a map of a few items to one node.

    Joins the Ray runtime already initialised in this process, else the cluster at `address` or
    $RAY_ADDRESS, else starts a one-machine cluster with `workers` CPUs on 127.0.0.1. close()
    shuts Ray down only when this executor initialised it. Every node must be able to import
    packtool and see the files the items name."""

    def __init__(self, workers: int, address: str | None = None) -> None:
        import logging

        ray = self._ray = _import_ray()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
            if address is not None or os.environ.get("RAY_ADDRESS"):
                ray.init(address=address, **quiet)
            else:
                # "local", not None: None would join whatever cluster `ray start` last left on this machine.
                ray.init(
                    address="local",
                    num_cpus=workers,
                    object_store_memory=RAY_OBJECT_STORE_BYTES,
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                    **quiet,
                )
        cpus = int(ray.cluster_resources().get("CPU", workers))
        self.workers = max(cpus, 1)
        self.depth = ITEMS_PER_WORKER * self.workers
        self._task = ray.remote(_ray_outcome)
        self.nodes: Counter[str] = Counter()

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        ray = self._ray
        if self._task is None:
            raise PacktoolError("this executor is closed")
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        fn_ref = ray.put(fn)
        turns = itertools.cycle(node_turns(ray.nodes()) or [None])
        in_flight: deque[Any] = deque()  # object refs, oldest first
        try:
            for item in items:
                node = next(turns)
                task = self._task
                if node is not None:
                    task = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True))
                in_flight.append(task.remote(fn_ref, item))
                if len(in_flight) >= self.depth:
                    yield self._result(in_flight.popleft())
            while in_flight:
                yield self._result(in_flight.popleft())
        finally:
            for ref in in_flight:
                ray.cancel(ref, force=True)

    def _result(self, ref: Any) -> Any:
        ray = self._ray
        try:
            node, outcome = ray.get(ref)
        except ray.exceptions.RayError as exc:
            # Not the function's own exception (those come back as outcomes): a node or worker was lost,
            # or the task could not start (packtool missing on a node).
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise WorkerError(f"a Ray task failed: {last}") from exc
        result = _unwrap(outcome)
        self.nodes[node] += 1
        return result

    def close(self) -> None:
        if self._task is None:
            return
        self._task = None
        if self._owns_ray:
            self._ray.shutdown()
