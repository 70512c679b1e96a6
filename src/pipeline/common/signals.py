"""Signal names as people read them: ``SIGTERM`` for 15, in the messages of a stopped run, sweep or torchrun."""

from __future__ import annotations

import signal


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15: the platform's name for the number, else the number itself."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
