"""The executor seam: every executor gives the serial results, in item order, with bounded work in flight;
errors keep their type; no worker outlives the build, however the build ends."""

from __future__ import annotations

import functools
import gc
import itertools
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
from support import ctrl_c_reaches_child

from packtool.builder.executors import (
    ITEM_COLLECTION_THRESHOLD,
    ITEMS_PER_WORKER,
    LOCAL_NODE,
    ProcessExecutor,
    RemoteTraceback,
    SerialExecutor,
    describe_workers,
    make_executor,
    node_turns,
    resolve_workers,
)
from packtool.errors import PacktoolError, RecordError, WorkerError
from packtool.workers import auto_workers, usable_cores

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)  # a worker that never answers fails the test instead of hanging the run
RAY_TIMEOUT = pytest.mark.timeout(150, method="thread")  # a misconfigured Ray hangs instead of failing


# -- work functions: module level, so worker processes and Ray tasks can import them --------------------


def square_later(x: int) -> int:
    """x * x, finishing out of order: early items sleep longest."""
    time.sleep(0.002 * (x % 5))
    return x * x


def add(offset: int, x: int) -> int:
    return offset + x


def fail_on_seven(x: int) -> int:
    if x == 7:
        raise RecordError("no 'messages' field", kind="bad_record", file="chat.jsonl", row=8, field="messages")
    return x


def collector_threshold(x: int) -> tuple[int, ...]:
    return gc.get_threshold()


def die(x: int) -> int:
    os._exit(3)


def node_of(x: int) -> tuple[int, str]:
    import ray

    time.sleep(0.3)  # long enough that one CPU per node cannot take every item
    return x, ray.get_runtime_context().get_node_id()


class LimitError(PacktoolError):
    """A subclass whose fields are required keyword-only arguments: default exception pickling cannot rebuild it."""

    def __init__(self, *, value: int, limit: int):
        self.value, self.limit = value, limit
        super().__init__(f"{value} > limit {limit}")


@pytest.fixture(scope="module")
def processes():
    with make_executor("processes", 2) as executor:
        yield executor


# -- choosing an executor ----------------------------------------------------------------------------


def test_auto_workers_run_one_process_on_a_small_machine_and_a_worker_per_core_on_a_larger_one():
    assert [auto_workers(cores) for cores in (1, 2, 3, 16)] == [1, 1, 3, 16]
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert usable_cores() == expected
    assert resolve_workers("auto") == auto_workers(expected)
    assert "1 process" in describe_workers(1) and describe_workers(4) == "4 worker processes"
    assert resolve_workers(3) == 3
    for bad in (0, -1, "many", True):
        with pytest.raises(PacktoolError, match="positive integer or 'auto'"):
            resolve_workers(bad)


def test_make_executor_names_the_choices():
    with pytest.raises(PacktoolError, match=r"expected one of processes, serial, ray, got 'threads'"):
        make_executor("threads", 2)
    with pytest.raises(PacktoolError, match="needs executor ray"):
        make_executor("processes", 2, address="127.0.0.1:6379")
    # One worker process would only add a process start: the work runs here instead.
    with make_executor("processes", 1) as executor:
        assert isinstance(executor, SerialExecutor)


def test_missing_ray_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(PacktoolError, match=r'pip install "packtool\[ray\]"'):
        make_executor("ray", 1)


# -- results, order, memory --------------------------------------------------------------------------


def test_serial_and_processes_give_the_same_results_in_item_order(processes):
    expected = [x * x for x in range(40)]
    with make_executor("serial", 1) as serial:
        assert list(serial.map(square_later, range(40))) == expected
    assert serial.nodes == {LOCAL_NODE: 40}
    before = processes.nodes[LOCAL_NODE]
    assert list(processes.map(square_later, range(40))) == expected
    assert processes.nodes[LOCAL_NODE] - before == 40
    assert list(processes.map(square_later, [])) == []


def test_items_run_with_fewer_collections_and_the_setting_comes_back(processes):
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        with make_executor("serial", 1) as serial:
            assert list(serial.map(collector_threshold, [0])) == [(ITEM_COLLECTION_THRESHOLD, 10, 10)]
        assert gc.get_threshold() == (700, 10, 10)
        gc.set_threshold(0)  # a caller that switched the collector off keeps it off
        with make_executor("serial", 1) as serial:
            assert list(serial.map(collector_threshold, [0])) == [(0, 10, 10)]
        assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*saved)
    assert {t[0] for t in processes.map(collector_threshold, range(4))} == {ITEM_COLLECTION_THRESHOLD}


def _consumed_at_each_result(executor) -> list[tuple[int, int]]:
    """(results taken, items pulled from the input) after each of the first 30 results of an endless input."""
    pulled = 0

    def endless():
        nonlocal pulled
        for x in itertools.count():
            pulled += 1
            yield x

    seen = []
    for taken, result in enumerate(itertools.islice(executor.map(square_later, endless()), 30), start=1):
        assert result == (taken - 1) ** 2
        seen.append((taken, pulled))
    return seen


def test_items_are_pulled_at_most_a_bounded_distance_ahead(processes):
    depth = ITEMS_PER_WORKER * 2
    for taken, pulled in _consumed_at_each_result(processes):
        assert pulled <= taken + depth
    # Stopping early abandoned items in flight: the executor still works, with fresh workers.
    assert list(processes.map(square_later, range(5))) == [0, 1, 4, 9, 16]
    with SerialExecutor() as serial:
        assert all(pulled == taken for taken, pulled in _consumed_at_each_result(serial))


def test_each_map_runs_its_own_function(processes):
    """Workers keep a map's function between its items; the next map's function replaces it."""
    assert list(processes.map(functools.partial(add, 1), range(9))) == list(range(1, 10))
    assert list(processes.map(functools.partial(add, 100), range(9))) == list(range(100, 109))


def test_one_map_at_a_time_on_worker_processes(processes):
    first = processes.map(square_later, range(20))
    assert next(first) == 0
    with pytest.raises(RuntimeError, match="one map at a time"):
        next(processes.map(square_later, range(3)))
    assert list(first) == [x * x for x in range(1, 20)]
    assert list(processes.map(square_later, range(3))) == [0, 1, 4]


# -- errors ------------------------------------------------------------------------------------------


def test_packtool_errors_survive_pickling_with_their_fields():
    error = RecordError("no 'messages' field", kind="bad_record", file="chat.jsonl", row=8, field="messages")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is RecordError and vars(copy) == vars(error) and str(copy) == str(error)
    limit = pickle.loads(pickle.dumps(LimitError(value=9, limit=8)))
    assert (type(limit), limit.value, limit.limit, str(limit)) == (LimitError, 9, 8, "9 > limit 8")


def _assert_record_error_from_worker(executor) -> None:
    with pytest.raises(RecordError) as caught:
        list(executor.map(fail_on_seven, range(20)))
    error = caught.value
    assert (error.file, error.row, error.field, error.kind) == ("chat.jsonl", 8, "messages", "bad_record")
    assert str(error) == "chat.jsonl:8, field 'messages': no 'messages' field"
    # The worker's traceback travels along for debugging.
    assert isinstance(error.__cause__, RemoteTraceback) and "fail_on_seven" in str(error.__cause__)
    assert list(executor.map(fail_on_seven, range(3))) == [0, 1, 2]


def test_an_error_in_a_worker_reaches_the_caller_with_its_type_and_fields(processes):
    _assert_record_error_from_worker(processes)
    with SerialExecutor() as serial, pytest.raises(RecordError, match=r"chat\.jsonl:8"):
        list(serial.map(fail_on_seven, range(20)))


def test_a_worker_that_dies_is_reported_and_replaced(processes):
    with pytest.raises(WorkerError, match=r"worker process died \(exit code 3\) while running work item [01];") as died:
        list(processes.map(die, range(3)))
    assert "workers" not in str(died.value)  # an exit of its own is not memory: no advice about memory
    assert list(processes.map(square_later, range(3))) == [0, 1, 4]
    # A worker killed between maps (the kernel's OOM killer, an operator) fails the item it was sent.
    processes._pool[0].process.kill()
    processes._pool[0].process.join()
    with pytest.raises(WorkerError, match=r"exit code -9\) while running work item") as killed:
        list(processes.map(square_later, range(6)))
    # the two causes of an out-of-memory kill and the setting for each
    assert "lower workers" in str(killed.value) and "lower max_record_bytes" in str(killed.value)
    assert list(processes.map(square_later, range(3))) == [0, 1, 4]


# A worker's item that leaves work for its interpreter's teardown: a line written at exit, and output
# still in the buffers.
TEARDOWN = """
import atexit, os, sys
from pathlib import Path
from packtool.builder.executors import ProcessExecutor

def leave_work_for_teardown(path):
    atexit.register(lambda: Path(path).write_text("the worker's interpreter was torn down"))
    print("printed by the worker", end="")
    return os.getpid()

if __name__ == "__main__":
    executor = ProcessExecutor(1)
    list(executor.map(leave_work_for_teardown, [sys.argv[1]]))
    worker = executor._pool[0].process
    executor.close()
    print("", worker.exitcode)
"""


def test_a_stopped_worker_exits_without_the_interpreter_teardown(tmp_path):
    """The parent waits for its workers after the last shard: their teardown (freeing the tokenizer,
    the templates, numpy, object by object) is skipped; what they printed still arrives."""
    script, marker = tmp_path / "teardown.py", tmp_path / "torn-down"
    script.write_text(TEARDOWN, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), str(marker)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "printed by the worker 0\n"
    assert not marker.exists()


def test_a_closed_executor_refuses_work():
    executor = ProcessExecutor(2)
    executor.close()
    with pytest.raises(PacktoolError, match="closed"):
        next(executor.map(square_later, range(3)))


# -- no worker outlives the build --------------------------------------------------------------------

BUILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from packtool.builder.executors import make_executor

    def slow(marker):
        Path(marker).touch()
        time.sleep(120)

    if __name__ == "__main__":
        folder = Path(sys.argv[1])
        with make_executor("processes", 2) as executor:
            list(executor.map(slow, [str(folder / f"started-{i}") for i in range(6)]))
    """
)


def _descendants(root: int) -> set[int]:
    """Live processes below `root` (zombies count as gone: only their exit status is left)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.add(pid)
    return alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from Linux /proc")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["kill-9", "term", "ctrl-c"])
def test_workers_exit_when_the_build_process_ends(tmp_path, signum):
    script = tmp_path / "build.py"
    script.write_text(BUILD, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, preexec_fn=ctrl_c_reaches_child)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("started-*"))) < 2:  # both workers are inside a slow item
            if parent.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the build never started its items (exit code {parent.poll()})")
            time.sleep(0.05)
        workers = _descendants(parent.pid)  # the two workers and multiprocessing's resource tracker
        assert len(workers) >= 2
        parent.send_signal(signum)
        parent.wait(timeout=20)
        deadline = time.monotonic() + 5
        while _alive(workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(workers) == set()
        assert len(list(tmp_path.glob("started-*"))) == 2  # nothing further started after the signal
    finally:
        parent.kill()
        parent.wait()


# -- Ray -----------------------------------------------------------------------------------------------


@pytest.mark.ray
@RAY_TIMEOUT
def test_ray_on_one_node_matches_serial_and_propagates_errors(ray_local):
    with make_executor("ray", 1) as executor:
        assert list(executor.map(square_later, range(40))) == [x * x for x in range(40)]
        _assert_record_error_from_worker(executor)
        for taken, pulled in _consumed_at_each_result(executor):
            assert pulled <= taken + executor.depth
    assert ray_local.is_initialized()  # the executor joined this cluster, so it left it running


@pytest.mark.ray
@RAY_TIMEOUT
def test_ray_on_two_loopback_nodes_runs_items_on_both(ray_two_nodes):
    nodes = {node["NodeID"] for node in ray_two_nodes.nodes() if node["Alive"]}
    assert len(nodes) == 2
    with make_executor("ray", 2) as executor:
        results = list(executor.map(node_of, range(8)))
    assert [x for x, _ in results] == list(range(8))
    # items are dealt to the nodes in turn: each ran half, not whatever a lagging resource report allowed
    assert sorted(Counter(node for _, node in results).values()) == [4, 4]
    # the executor's own count of where items ran agrees with what the items saw
    assert executor.nodes == Counter(node for _, node in results)


def test_node_turns_deal_items_by_cpus_and_skip_nodes_without_cpus_or_life():
    nodes = [
        {"NodeID": "b", "Alive": True, "Resources": {"CPU": 2.0}},
        {"NodeID": "a", "Alive": True, "Resources": {"CPU": 3.0}},
        {"NodeID": "dead", "Alive": False, "Resources": {"CPU": 8.0}},
        {"NodeID": "head-only", "Alive": True, "Resources": {}},
    ]
    assert node_turns(nodes) == ["a", "b", "a", "b", "a"]
    assert node_turns([]) == []


RAY_BUILD = textwrap.dedent(
    """
    import os
    from pathlib import Path
    import ray
    from packtool.builder.executors import make_executor

    def children():
        stats = [p.read_text().rsplit(")", 1)[1].split() for p in Path("/proc").glob("[0-9]*/stat") if p.exists()]
        return [s for s in stats if s[1] == str(os.getpid()) and s[0] != "Z"]

    if __name__ == "__main__":
        with make_executor("ray", 1) as executor:
            print(list(executor.map(abs, [-1, -2, -3])), ray.is_initialized(), len(children()) > 0)
        print(ray.is_initialized(), len(children()))
    """
)


@pytest.mark.ray
@RAY_TIMEOUT
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from Linux /proc")
def test_ray_started_by_the_executor_is_stopped_by_it(tmp_path):
    """Without a cluster to join, the executor starts a local one on loopback and shuts it down on close."""
    pytest.importorskip("ray")
    script = tmp_path / "ray_build.py"
    script.write_text(RAY_BUILD, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    # Ray's own processes (gcs_server, raylet, workers) were children of the build while it ran, and are gone.
    assert done.stdout.splitlines() == ["[1, 2, 3] True True", "False 0"]
