"""The layout the package docstring and docs/development.md draw is the package's real layout."""

import re
from pathlib import Path

import pytest

import keepalive_executor

pytestmark = pytest.mark.fast  # in `scripts/test.sh --fast`: see pyproject.toml

ROOT = Path(keepalive_executor.__file__).resolve().parent
DEVELOPMENT = (ROOT.parent / "docs" / "development.md").read_text()
MODULES = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__init__")


def test_every_module_is_in_the_package_docstring():
    doc = keepalive_executor.__doc__
    missing = [m for m in MODULES if f"keepalive_executor.{m}`" not in doc]
    assert not missing, missing
    assert "keepalive_executor.torchrun`" in doc


def test_every_module_is_in_the_development_guides_layout():
    layout = DEVELOPMENT[DEVELOPMENT.index("## Layout"):]
    missing = [m for m in MODULES if f"{m}.py" not in layout]
    assert not missing, missing


def test_every_test_the_docs_name_exists():
    """A test named in README.md or docs/ (`test_name`, or `test_prefix_...` for a long one)
    is a test of tests/: a renamed test otherwise leaves the docs citing evidence that is
    gone."""
    tests_dir = ROOT.parent / "tests"
    defined = {m.group(1) for p in tests_dir.rglob("*.py")
               for m in re.finditer(r"^\s*(?:async )?def (test_\w+)", p.read_text(), re.M)}
    docs = [ROOT.parent / "README.md", *sorted((ROOT.parent / "docs").glob("*.md"))]
    missing = []
    for doc in docs:
        for m in re.finditer(r"`(test_\w+?)(_?\.\.\.)?(?:\[[^`\]]*\])?`", doc.read_text()):
            name, abridged = m.group(1), m.group(2)
            if not (any(d.startswith(name) for d in defined) if abridged else name in defined):
                missing.append(f"{doc.name}: {name}")
    assert not missing, missing
