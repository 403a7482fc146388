"""The ``flodl-trio`` command line (docs/cli.rst).

Re-exports only; the code lives in its private modules.
"""

from .._errors import UsageError
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    EXIT_USAGE,
    SALT_ENV,
    CommandFailed,
    load_salt,
    parse_address,
    parse_ranks,
)
from ._main import main
from ._parser import build_parser

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_SIGINT",
    "EXIT_SIGTERM",
    "EXIT_USAGE",
    "SALT_ENV",
    "CommandFailed",
    "UsageError",
    "build_parser",
    "load_salt",
    "main",
    "parse_address",
    "parse_ranks",
]
