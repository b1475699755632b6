"""The project's pytest settings: a skipped test says why in the summary of every run (CI included)."""

from __future__ import annotations

import subprocess
import sys

from support import REPO


def test_every_run_lists_each_skip_with_its_reason(tmp_path):
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n\n\ndef test_needs_data():\n    pytest.skip('shared test data not found at /nowhere')\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SKIPPED [1] test_skips.py:5: shared test data not found at /nowhere" in done.stdout
