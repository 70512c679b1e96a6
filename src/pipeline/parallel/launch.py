"""torchrun, quiet when it is stopped: ``python -m pipeline.launch`` takes torchrun's arguments.

    python -m pipeline.launch --standalone --nproc_per_node=4 -m pipeline model=resnet50 amp=true

Sent SIGTERM or Ctrl-C, torchrun's agent passes the signal on to every rank (each stops at a step boundary, rank 0
writes the checkpoint, the run ends KILLED) and then raises ``SignalException`` out of its ``main``, in a traceback
and with exit status 1. This launcher runs the same ``torch.distributed.run.main`` and ends that case in one line
and the signal's exit status (143 for SIGTERM, 130 for Ctrl-C), as ``python -m pipeline`` does; anything else
torchrun does or says is unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pipeline.common.signals import signal_name


def main(argv: Sequence[str] | None = None) -> None:
    """Run torchrun with ``argv`` (default: this command's arguments); exit 128 + the signal after a stop."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(list(sys.argv[1:] if argv is None else argv))
    except SignalException as stop:
        signum = int(stop.sigval)
        print(
            f"torchrun stopped by {signal_name(signum)}: every rank was passed the signal and stopped (with a "
            "checkpoint, unless checkpoint.enabled=false); resume with the same command and resume=<run id>",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(128 + signum)
