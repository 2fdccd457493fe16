"""Compute the reference outputs the parity tests compare keepalive with, by running them.

``python scripts/make_references.py [NAME ...] [--force] [--jobs N]`` runs each reference of
``tests/reference_calls.py``'s ``REFERENCES`` (vLLM's ``mp`` executor, or TP=1 without a
distributed executor) through the very call ``tests/test_parity.py`` would make live,
``run_engine.run_script``, and writes ``tests/references/NAME.json``: the result and the key it
is valid for (vLLM, torch and package versions, the tiny model builder, the scripts, the CPU's
ISA; see ``run_engine.reference_key``). A reference whose file already matches the current key
is left alone unless ``--force``. Nothing here is copied from a keepalive run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts")]

from reaping import reaped  # noqa: E402
from reference_calls import REFERENCES  # noqa: E402
from run_engine import Reference, reference_call, run_script  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402

#: references that use all four ranks of TP=2 x PP=2: run alone on a small machine
ALONE = {"pipeline_tp2_pp2_mp"}


def make(names: list[str], force: bool, jobs: int, work: Path) -> list[str]:
    """Run the references NAMES (those out of date, or all with FORCE), JOBS at a time, and
    write their files; return what was written."""
    model = str(build_tiny_model(work / "model" / "tiny-llama"))
    refs = [Reference.look_up(n, reference_call(REFERENCES[n], model, work / n), model)
            for n in names]
    todo = [r for r in refs if force or r.cached is None]
    for r in refs:
        print(r.message() if r not in todo else f"reference {r.name}: running "
              f"({'forced' if r.cached is not None else 'key mismatch: ' + ', '.join(r.mismatch)})",
              flush=True)

    def one(r: Reference) -> str:
        start = time.monotonic()
        # a run that fails or times out leaves nothing running (its server is in a session
        # of its own, which run_script's timeout does not reach)
        r.store(reaped(lambda call: run_script(**call))(r.call))
        print(f"wrote {r.path.relative_to(ROOT)} ({time.monotonic() - start:.0f} s)", flush=True)
        return r.name

    together = [r for r in todo if r.name not in ALONE]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        done = list(pool.map(one, together))
    return done + [one(r) for r in todo if r.name in ALONE]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"default: all of {', '.join(REFERENCES)}")
    parser.add_argument("--force", action="store_true", help="rerun matching ones too")
    parser.add_argument("--jobs", type=int, default=1, help="references run at once")
    args = parser.parse_args()
    unknown = set(args.names) - set(REFERENCES)
    if unknown:
        parser.error(f"unknown reference(s): {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="references-") as work:
        make(args.names or list(REFERENCES), args.force, args.jobs, Path(work))


if __name__ == "__main__":
    main()
