"""The ``flodl-trio`` command line (SPEC §12)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._version import __version__
from .wire import SessionSalt


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flodl-trio", description=__doc__)
    parser.add_argument("--version", action="version", version=f"flodl-trio {__version__}")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("salt", help="print a fresh session salt (32 hex chars)")
    args = parser.parse_args(argv)
    if args.command == "salt":
        print(SessionSalt.generate().hex())
        return 0
    print(f"flodl-trio {__version__}")
    print(f"fresh session salt: {SessionSalt.generate().hex()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
