"""The contract every command of the package keeps with its user.

    @command("python -m pipeline.stale")
    def main(argv: list[str] | None = None) -> int: ...

- a problem the user can fix (``PipelineError``, a bad option) is one line on stderr, ``error: ...``, exit 2;
- a bug is one short line that says so and where to report it, exit 1; its traceback only under ``--debug``
  (accepted by every command) or ``HYDRA_FULL_ERROR=1``;
- Ctrl-C is one line, exit 130; SIGTERM one line, exit 143.

Every message passes through ``mask_text``: a secret in an error never reaches the terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

from pipeline.common.errors import PipelineError
from pipeline.common.messages import brief
from pipeline.common.secrets import mask_text

DEBUG_FLAG = "--debug"


class Parser(argparse.ArgumentParser):
    """argparse, with a bad option said in one line (argparse prints the whole usage first) and ``--debug``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.add_argument(DEBUG_FLAG, action="store_true", help="show the traceback of an internal error")

    def error(self, message: str) -> NoReturn:
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
        sys.exit(2)


def debugging(argv: Sequence[str] | None = None) -> bool:
    """Whether the user asked for tracebacks: ``--debug`` among the arguments or ``HYDRA_FULL_ERROR=1``."""
    args = sys.argv[1:] if argv is None else argv
    return DEBUG_FLAG in args or os.environ.get("HYDRA_FULL_ERROR") == "1"


def bug_line(err: BaseException) -> str:
    """A bug (or a fault of the machine) in one line: what, where it was raised, and what to do."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return (
        f"internal error: {brief(err, where=where)} — not a problem with your input: a bug in "
        f"pipeline or a fault of the machine; run it again with {DEBUG_FLAG} for the traceback, and report a bug on "
        f"the project's issue tracker with that output"
    )


def report_bug(err: BaseException, *, debug: bool) -> None:
    """``bug_line`` on stderr, or the traceback when debugging."""
    if debug:
        traceback.print_exception(err)
    else:
        print(bug_line(err), file=sys.stderr, flush=True)


def one_line(text: str) -> str:
    """``text`` on one line: a message from a library can span several."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def user_error(err: PipelineError) -> int:
    print(f"error: {mask_text(one_line(str(err)))}", file=sys.stderr, flush=True)
    return 2


class Terminated(Exception):
    """SIGTERM reached a command: it ends as Ctrl-C would, in one line, with the signal's exit status."""


@contextlib.contextmanager
def _terminated_raises() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return

    def raise_terminated(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def command(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Wrap a command's ``main(argv) -> int`` in the contract above (see the module's docstring)."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def guarded(argv: Sequence[str] | None = None) -> int:
            try:
                with _terminated_raises():
                    return main(argv)
            except PipelineError as err:
                return user_error(err)
            except KeyboardInterrupt:
                print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
                return 130
            except Terminated:
                print(f"{prog}: stopped by SIGTERM", file=sys.stderr, flush=True)
                return 128 + signal.SIGTERM
            except Exception as err:  # a bug: said briefly, the traceback on request
                report_bug(err, debug=debugging(argv))
                return 1

        return guarded

    return wrap
