"""How an error reads to a user: ``brief(err)`` for the one line, ``best_effort("what failed")`` for the steps whose
failure is logged and the run goes on. Every message that names an exception goes through ``brief``: one format,
secrets masked, long library messages cut."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pipeline.common.errors import Interruption
from pipeline.common.secrets import mask_text


def brief(
    error: BaseException,
    *,
    secrets: Collection[str] = frozenset(),
    limit: int = 300,
    first_line: bool = False,
    with_type: bool = True,
    where: str = "",
) -> str:
    """An error as one line a user reads: ``"OSError: [Errno 28] No space left on device"``.

    The message is masked (``pipeline.common.secrets.mask_text``: a store URI's password, a token), its whitespace
    collapsed, and cut to ``limit`` characters (torch's and MLflow's messages run to pages).

    Args:
        error: the exception.
        secrets: values to mask besides the patterns ``mask_text`` knows (a run's ``env_values``).
        limit: the longest the message part may be.
        first_line: keep the message's first line only (a traceback-like message's headline).
        with_type: start with the exception's type; without it, an empty message still gives the type.
        where: said after the type: ``" at loop.py:88"`` gives ``"KeyError at loop.py:88: 'x'"``.
    """
    text = str(error).strip()
    if first_line:
        text = (text.splitlines() or [""])[0]
    text = " ".join(mask_text(text, secrets).split())[:limit]
    kind = type(error).__name__
    if not with_type:
        return text or kind
    return f"{kind}{where}: {text}" if text else f"{kind}{where}"


@dataclass
class Attempt:
    """What ``best_effort`` saw: ``error`` is the brief of what it caught, ``None`` while nothing failed."""

    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


@contextmanager
def best_effort(
    what: str, logger: logging.Logger, *, secrets: Collection[str] = frozenset(), level: int = logging.WARNING
) -> Iterator[Attempt]:
    """Run a block whose failure must not end the run: log ``"<what> (<brief of the error>)"`` and go on.

    For the steps that only add to what a run keeps (a summary, a tag, a parent run in a sweep), where the exit
    status and the terminal still tell the user. An ``Interruption``, ``KeyboardInterrupt`` or ``SystemExit`` is
    never swallowed. ``Attempt.failed`` lets the caller take another path afterwards::

        with best_effort("the sweep's summary could not be logged", log) as attempt:
            table = summarize_sweep(...)
        if attempt.failed:
            ...
    """
    attempt = Attempt()
    try:
        yield attempt
    except Interruption:
        raise
    except Exception as err:
        attempt.error = brief(err, secrets=secrets)
        logger.log(level, "%s (%s)", what, attempt.error)
