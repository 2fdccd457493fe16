"""The layout the package docstring and the README draw is the package's real layout."""

from pathlib import Path

import keepalive_executor

ROOT = Path(keepalive_executor.__file__).resolve().parent
README = (ROOT.parent / "README.md").read_text()
MODULES = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__init__")


def test_every_module_is_in_the_package_docstring():
    doc = keepalive_executor.__doc__
    missing = [m for m in MODULES if f"keepalive_executor.{m}`" not in doc]
    assert not missing, missing
    assert "keepalive_executor.torchrun`" in doc


def test_every_module_is_in_the_readme_layout():
    layout = README[README.index("## Layout"):]
    missing = [m for m in MODULES if f"{m}.py" not in layout]
    assert not missing, missing
