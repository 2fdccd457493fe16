"""The package as a user installs it: a wheel built from this tree, installed (not editable)
into a fresh venv beside the tested vLLM, serves through vLLM's plugin entry point.

The fresh venv does not get vLLM's 3.5 GB again: a ``.pth`` file names the test venv's
site-packages as a plain path entry, which puts that directory on ``sys.path`` without
running its own ``.pth`` files, so the test venv's editable install of this project (an
import hook started by such a file) stays off. Its dist-info is still on the path, behind
the wheel's, which is what a user with an older copy installed elsewhere on the path has.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest
from serve_scripts import LOAD_ARGS
from servers import Server, by_title

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this tree, built from a copy of it (the build writes build/ and
    *.egg-info beside its sources), without build isolation: setuptools from this venv."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for path in REPO.iterdir():  # what the build reads: the top-level files and the package
        if path.is_file() and not path.name.startswith("."):
            shutil.copy2(path, src)
    shutil.copytree(REPO / "keepalive_executor", src / "keepalive_executor",
                    ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "-w", str(work / "dist"), str(src)],
        capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    [whl] = (work / "dist").glob("keepalive_executor-*.whl")
    return whl


@pytest.mark.fast
def test_the_wheel_holds_the_package_its_entry_point_license_and_metadata(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        dist_info = next(n.split("/")[0] for n in names if ".dist-info/" in n)
        metadata = z.read(f"{dist_info}/METADATA").decode()
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
        license_text = z.read(f"{dist_info}/licenses/LICENSE").decode()
    modules = {str(p.relative_to(REPO)) for p in (REPO / "keepalive_executor").rglob("*.py")}
    assert {n for n in names if n.endswith(".py")} == modules  # every module, nothing else
    assert "[vllm.general_plugins]\nkeepalive = keepalive_executor:register" in entry_points
    assert license_text == (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text
    headers = metadata.split("\n\n", 1)[0].splitlines()
    assert "Requires-Python: >=3.11" in headers
    assert "License: Apache-2.0" in headers
    assert "Provides-Extra: vllm" in headers
    assert 'Requires-Dist: vllm<0.35,>=0.32; extra == "vllm"' in headers
    assert not any(h.startswith("Requires-Dist: vllm") and "extra ==" not in h for h in headers)
    assert "Classifier: Programming Language :: Python :: 3.11" in headers
    # the long description: the README, then the changelog
    readme, changelog = ((REPO / name).read_text() for name in ("README.md", "CHANGELOG.md"))
    description = metadata.split("\n\n", 1)[1]
    assert description.startswith(readme.strip()) and changelog.strip() in description


def _site_packages(venv: Path) -> Path:
    return Path(sysconfig.get_path("purelib", vars={"base": str(venv),
                                                    "platbase": str(venv)}))


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    """A new venv with the wheel installed (pip's ordinary install, by this venv's pip),
    then the tested vLLM's site-packages put on its path."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    # installed before the test venv's packages are on its path: pip sees no other copy
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--disable-pip-version-check", str(wheel)],
        capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    tested = Path(sysconfig.get_path("purelib"))
    (_site_packages(venv) / "tested_vllm.pth").write_text(f"{tested}\n")
    return venv


PROBE = """
import importlib.metadata as md, json, sys
import keepalive_executor, vllm
eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "keepalive"]
print(json.dumps({
    "keepalive_executor": keepalive_executor.__file__,
    "vllm": vllm.__file__,
    "entry_points": [[ep.value, str(ep.dist.locate_file(""))] for ep in eps],
    "dists": [str(d.locate_file("")) for d in md.distributions()
              if d.metadata["Name"] == "keepalive-executor"],
    "editable_hook": any("__editable__" in m for m in sys.modules),
}))
"""


def test_the_fresh_venv_imports_the_wheel_and_vllm_finds_its_entry_point(fresh_venv, tmp_path):
    """Run from outside the repository (``python -c`` puts the working directory first on the
    path): keepalive_executor and the plugin's entry point come from the wheel, vLLM from the
    tested venv, whose editable install is on the path but not active."""
    site = _site_packages(fresh_venv)
    tested = Path(sysconfig.get_path("purelib"))
    out = subprocess.run([str(fresh_venv / "bin" / "python"), "-c", PROBE], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(probe["keepalive_executor"]).is_relative_to(site), probe
    assert Path(probe["vllm"]).is_relative_to(tested), probe
    # vLLM loads plugins by entry point: exactly one, the wheel's
    assert probe["entry_points"] == [["keepalive_executor:register", str(site)]], probe
    # the test venv's editable keepalive-executor is on the path too, behind the wheel's
    assert probe["dists"] == [str(site), str(tested)], probe
    assert not probe["editable_hook"], probe


@pytest.mark.slow
def test_vllm_serve_from_the_fresh_venv_serves_through_the_wheels_plugin(
        fresh_venv, tmp_path, tiny_model, reference, monkeypatch):
    """`vllm serve` of the tiny model, `--distributed-executor-backend keepalive -tp 2`, run
    by the fresh venv's Python from outside the repository: mp's greedy completion; then
    rank 1 dumps its stacks (SIGUSR1, every rank's stack dump) and every keepalive_executor
    frame in them is the wheel's file in the fresh venv, none the repository's."""
    site = _site_packages(fresh_venv)
    with monkeypatch.context() as m:  # only while the server process is started
        m.setattr(sys, "executable", str(fresh_venv / "bin" / "python"))
        m.chdir(tmp_path)
        server = Server(tiny_model, tmp_path / "serve.log", tp=2, backend="keepalive",
                        extra_args=LOAD_ARGS, extra_env={"PYTHONPATH": ""})
    try:
        assert server.args[0] == str(fresh_venv / "bin" / "python")
        server.wait_ready()
        answer = server.client().completions.create(
            model="tiny", prompt="Hello, my name is", max_tokens=12, temperature=0)
        assert answer.choices[0].text == reference("serve_tp2")["completion"]
        [rank1] = by_title(server, "KeepaliveWorker_TP1")
        rank1.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        frames: list[str] = []
        while not frames and time.monotonic() < deadline:
            time.sleep(0.5)
            frames = re.findall(r'File "([^"]*keepalive_executor[^"]*)"', server.log())
        assert server.health() == 200  # the dump stops nothing
    finally:
        server.stop()
    assert frames, server.log()[-3000:]
    assert all(Path(f).is_relative_to(site) for f in frames), frames
    assert not any(Path(f).is_relative_to(REPO) for f in frames), frames
    assert not server.leftovers, server.leftovers
