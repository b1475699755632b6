"""The project's pytest settings: the summary of every run (CI included) names each failure and each
skipped test with its reason."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from support import REPO


def test_every_run_lists_each_failure_and_each_skip_with_its_reason(tmp_path):
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n\n\ndef test_needs_data():\n    pytest.skip('shared test data not found at /nowhere')\n"
        "\n\ndef test_fails():\n    assert 1 == 2\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "SKIPPED [1] test_skips.py:5: shared test data not found at /nowhere" in done.stdout
    assert re.search(r"^FAILED \S*test_skips.py::test_fails", done.stdout, re.M), done.stdout


# The shared data's own README (../shared/data) is cited as data/README.md; it is not the repository's.
OUTSIDE_THE_REPO = {"data/README.md", "OUT/README.md"}  # OUT/README.md: the dataset card a build writes


def test_every_markdown_file_cited_exists():
    """Modules, examples and docs cited a DESIGN.md the repository never had. A cited NAME.md resolves
    from the citing file's folder, the repository root or docs/."""
    missing = []
    roots = ["packtool", "examples", "bench", "docs", "configs", "templates"]
    files = [REPO / "README.md", *(p for root in roots for p in (REPO / root).rglob("*") if p.suffix in {".py", ".md"})]
    for path in files:
        for cited in set(re.findall(r"[\w./-]+\.md\b", path.read_text(encoding="utf-8"))):
            folders = (path.parent, REPO, REPO / "docs")
            if cited not in OUTSIDE_THE_REPO and not any((folder / cited).is_file() for folder in folders):
                missing.append(f"{path.relative_to(REPO)} cites {cited}")
    assert missing == []


COMPLEXITY_LIMIT = 40  # the anchor codebases' worst functions sit near 30-40; packtool's render was 123


def test_no_function_is_too_complex_to_hold():
    """radon's cyclomatic complexity of every function and method of the package."""
    complexity = pytest.importorskip("radon.complexity", reason="radon is a dev dependency (pip install radon)")
    worst = []
    for path in sorted((REPO / "packtool").rglob("*.py")):
        if path.is_symlink() or any(part.is_symlink() for part in path.parents):
            continue  # packtool/templates and packtool/configs link to data, not code
        for block in complexity.cc_visit(path.read_text(encoding="utf-8")):
            if block.complexity > COMPLEXITY_LIMIT:
                worst.append(f"{path.relative_to(REPO)}:{block.lineno} {block.fullname} {block.complexity}")
    assert worst == []


def test_every_package_of_the_tree_ships():
    """pyproject.toml lists the packages by name: a new subpackage left off it is missing from a regular
    install (CI's), whatever an editable one shows."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(REPO).parts)
        for init in (REPO / "packtool").rglob("__init__.py")
        if not any(part.is_symlink() for part in init.parents)  # templates/, configs/: data, listed by name
    }
    assert found - listed == set()


def test_every_test_file_cited_exists():
    """docs/architecture.md's where-to-change table, the docs and the modules name the tests that hold them: a test
    file moved or renamed takes its citations along."""
    missing = []
    roots = ["packtool", "examples", "bench", "docs"]
    files = [REPO / "README.md", *(p for root in roots for p in (REPO / root).rglob("*") if p.suffix in {".py", ".md"})]
    for path in files:
        for cited in set(re.findall(r"\btests/[\w/]+\.py\b", path.read_text(encoding="utf-8"))):
            if not (REPO / cited).is_file():
                missing.append(f"{path.relative_to(REPO)} cites {cited}")
    assert missing == []


def test_the_tests_are_laid_out_like_the_package():
    """A folder of tests holds the tests of the package's wing of that name (tests/render/ those of
    packtool/render/), so a module's tests are found where the module is."""
    wings = {init.parent.name for init in (REPO / "packtool").glob("*/__init__.py")}
    folders = {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    assert folders - wings == set()
