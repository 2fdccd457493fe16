"""``python frontend_check.py JSON``: run vLLM's front-end start-up path for each case
(``vllm serve``'s argument parser, ``create_engine_config``, ``Executor.get_class``) and
print ``RESULT {case id: {error, error_type}}``. No engine starts."""

from __future__ import annotations

import json
import os
import sys


def check(args: list[str], env: dict[str, str]) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.executor.abstract import Executor

    saved = dict(os.environ)
    os.environ.update(env)
    try:
        parser = make_arg_parser(FlexibleArgumentParser())
        ns = parser.parse_args(args)
        config = AsyncEngineArgs.from_cli_args(ns).create_engine_config()
        Executor.get_class(config)
        return {"error": None, "error_type": None}
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"error": str(e), "error_type": type(e).__name__}
    finally:
        os.environ.clear()
        os.environ.update(saved)


if __name__ == "__main__":
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    out = {c["id"]: check(c["args"], c["env"]) for c in json.loads(sys.argv[1])}
    print("RESULT " + json.dumps(out), flush=True)
