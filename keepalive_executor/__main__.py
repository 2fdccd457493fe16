"""``python -m keepalive_executor serve MODEL ...``: the torchrun entry point."""

import sys

from keepalive_executor.torchrun import main

if __name__ == "__main__":
    sys.exit(main())
