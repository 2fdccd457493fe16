"""``python frontend_check.py JSON``: run vLLM's front-end start-up path for each case
(``vllm serve``'s argument parser, ``create_engine_config``, ``Executor.get_class``) and
print ``RESULT {case id: {error, error_type}}``. No engine starts."""

from __future__ import annotations

import json
import os
import sys

#: a case's env entry that makes ``vllm.version.__version__`` read as another release
FAKE_VERSION_ENV = "KEEPALIVE_TEST_POSE_AS_VLLM"


def check(args: list[str], env: dict[str, str]) -> dict:
    import vllm.version
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.executor.abstract import Executor

    make_arg_parser = serve_arg_parser()
    saved, real_version = dict(os.environ), vllm.version.__version__
    os.environ.update(env)
    # a case may pose as another vLLM release (the version gate reads vllm.version)
    vllm.version.__version__ = env.get(FAKE_VERSION_ENV, real_version)
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
        vllm.version.__version__ = real_version


def serve_arg_parser():
    """``vllm serve``'s ``make_arg_parser``: in ``vllm.entrypoints.common.cli_args`` since
    vLLM 0.33, ``vllm.entrypoints.launchers.cli_args`` before."""
    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    return make_arg_parser


if __name__ == "__main__":
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    out = {c["id"]: check(c["args"], c["env"]) for c in json.loads(sys.argv[1])}
    print("RESULT " + json.dumps(out), flush=True)
