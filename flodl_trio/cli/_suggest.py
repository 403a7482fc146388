"""Unknown options on the command line, named with the closest flag (``did you mean --x?``).

argparse checks the required options before it reports the ones it did not recognise, so
``coordinator --world-szie 4`` answered "the following arguments are required: --world-size" and
never named the typo. :class:`SuggestingParser` looks at the arguments first: an option that is
not one of the parser's own (nor of the command it runs) is the error, with the closest flag.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any

# argparse's own rule for a value such as ``-1`` or ``-.5`` (a number, not an option).
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser whose first check is for options it does not know (every level).

    Subclasses keep their own ``error()``; this one only decides the message.
    """

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None,
    ) -> tuple[Any, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        unknown = self.unknown_options(argv)
        if unknown:
            owner = unknown[0][0]
            owner.error(unknown_text([(flag, near) for _, flag, near in unknown]))
        return super().parse_known_args(argv, namespace)

    def unknown_options(
        self, args: Sequence[str],
    ) -> list[tuple[argparse.ArgumentParser, str, str | None]]:
        """Each option of ``args`` this parser (or the command it dispatches to) does not
        know: ``(parser that would have taken it, the option, the closest flag or None)``."""
        commands = self._commands()
        found: list[tuple[argparse.ArgumentParser, str, str | None]] = []
        for i, arg in enumerate(args):
            if arg == "--":
                break
            command = commands.get(arg)
            if command is not None:
                if isinstance(command, SuggestingParser):
                    found += command.unknown_options(args[i + 1:])
                break
            if not arg.startswith("-") or arg == "-" or _NEGATIVE_NUMBER.match(arg):
                continue  # a value or a positional
            flag = arg.split("=", 1)[0]
            if not self._knows(flag):
                found.append((self, flag, closest(flag, self._flags())))
        return found

    def _flags(self) -> list[str]:
        return sorted(self._option_string_actions)

    def _knows(self, flag: str) -> bool:
        if flag in self._option_string_actions:
            return True
        if not flag.startswith("--"):
            return flag[:2] in self._option_string_actions  # ``-ofile``: -o with its value
        # An unambiguous prefix is argparse's (allow_abbrev); an ambiguous one it reports.
        return self.allow_abbrev and any(f.startswith(flag) for f in self._option_string_actions)

    def _commands(self) -> dict[str, argparse.ArgumentParser]:
        for action in self._actions:
            if action.nargs == argparse.PARSER and isinstance(action.choices, dict):
                return dict(action.choices)
        return {}


def closest(flag: str, flags: Sequence[str]) -> str | None:
    """The flag ``flag`` was most likely meant to be, or None when none is close."""
    near = difflib.get_close_matches(flag, [f for f in flags if f.startswith("--")]
                                     if flag.startswith("--") else list(flags), n=1, cutoff=0.6)
    return near[0] if near else None


def unknown_text(unknown: Sequence[tuple[str, str | None]]) -> str:
    """``unrecognized option --world-szie: did you mean --world-size?`` (one line, every
    unknown option named).

    >>> unknown_text([("--world-szie", "--world-size")])
    'unrecognized option --world-szie: did you mean --world-size?'
    >>> unknown_text([("--epochz", "--epochs"), ("--frob", None)])
    'unrecognized options --epochz (did you mean --epochs?), --frob'
    """
    if len(unknown) == 1:
        flag, near = unknown[0]
        return f"unrecognized option {flag}" + (f": did you mean {near}?" if near else "")
    return "unrecognized options " + ", ".join(
        flag + (f" (did you mean {near}?)" if near else "") for flag, near in unknown)
