"""fastdecode command line.

    python -m fastdecode generate --model DIR "prompt"     stream a completion (in-process engine)
    python -m fastdecode bench --model DIR --batch 64       engine throughput
    python -m fastdecode plan --model DIR [--latency-budget MS] [--seq-len S]
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": "fastdecode.engine.cli",
    "bench": "fastdecode.engine.cli",
    "plan": "fastdecode.ops.plan",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]])
    return module.main(argv) or 0


if __name__ == "__main__":
    sys.exit(main())
