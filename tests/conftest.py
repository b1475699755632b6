"""Fixtures shared by the tests (paths and helpers live in support.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# Ray reads this when it is imported: 0 keeps every node of a test cluster on 127.0.0.1 (otherwise
# Ray resolves the host's external address and a two-node loopback cluster retries forever).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# Timing deadlines flake on a loaded 2-core machine; CI also fixes the examples so a red run reproduces.
settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n`, as pyproject's addopts ask), the tests that start or join Ray all run on
    one worker (`--dist loadgroup`): one loopback cluster per session, never two side by side."""
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a YAML config (given as a dict) into tmp_path and return its path."""
    import yaml

    def write(config: dict, name: str = "config.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        return path

    return write


@pytest.fixture
def write_jsonl(tmp_path: Path):
    def write(rows: list, name: str = "data.jsonl") -> Path:
        path = tmp_path / name
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
        return path

    return write


class _RayCluster:
    """One loopback Ray cluster for the whole test session, grown or shrunk to the nodes a test asks for.

    Starting Ray costs seconds, so tests share it; the driver (this pytest process) stays connected."""

    def __init__(self, neutral: Path) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self.node_args = {"num_cpus": 1, "object_store_memory": 128 * 1024**2}  # enough for items and small results
        # Ray workers inherit the environment of the nodes, not the driver's sys.path: give them this
        # session's folders inside the repository (the test folders, the checkout when it is on the
        # path), so work functions defined in tests import there too.
        self.saved_path = os.environ.get("PYTHONPATH")
        root = Path(__file__).resolve().parent.parent
        ours = [p for p in sys.path if p and Path(p).is_dir() and Path(p).resolve().is_relative_to(root)]
        os.environ["PYTHONPATH"] = os.pathsep.join([*ours, *filter(None, [self.saved_path])])
        self.ray = ray
        self.cluster = Cluster(initialize_head=True, head_node_args={**self.node_args, "include_dashboard": False})
        # Ray puts the driver's working folder first on its workers' sys.path: from a checkout they
        # would import its packtool/ (without the bundled files) instead of the installed one.
        here = os.getcwd()
        os.chdir(neutral)
        try:
            ray.init(address=self.cluster.address, log_to_driver=False, logging_level="WARNING")
        finally:
            os.chdir(here)
        self.extra: list = []

    def nodes(self, count: int):
        while len(self.extra) + 1 < count:
            self.extra.append(self.cluster.add_node(**self.node_args))
        while len(self.extra) + 1 > count:
            self.cluster.remove_node(self.extra.pop())
        self.cluster.wait_for_nodes()
        return self.ray

    def shutdown(self) -> None:
        self.ray.shutdown()
        self.cluster.shutdown()
        if self.saved_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = self.saved_path


@pytest.fixture(scope="session")
def _ray_cluster(tmp_path_factory):
    pytest.importorskip("ray", reason='the Ray tests need the ray extra: pip install ".[ray]"')
    cluster = _RayCluster(tmp_path_factory.mktemp("ray-driver"))
    yield cluster
    cluster.shutdown()


@pytest.fixture
def ray_local(_ray_cluster):
    """The `ray` module, connected to a one-node loopback cluster (1 CPU): make_executor("ray", ...) joins it."""
    return _ray_cluster.nodes(1)


@pytest.fixture
def ray_two_nodes(_ray_cluster):
    """The `ray` module, connected to a two-node loopback cluster (1 CPU each): work spreads over both."""
    return _ray_cluster.nodes(2)


@pytest.fixture(scope="session")
def quickstart_build(tmp_path_factory) -> Path:
    """One build of the bundled quickstart config, shared read-only by the tools tests (copy it to change it)."""
    from click.testing import CliRunner
    from support import QUICKSTART

    from packtool.cli import main

    out = tmp_path_factory.mktemp("quickstart") / "out"
    result = CliRunner().invoke(main, ["build", str(QUICKSTART.parent / "quickstart.yaml"), "-o", str(out), "-q"])
    if result.exit_code != 0:
        raise RuntimeError(f"quickstart build failed: {result.output}")
    return out
