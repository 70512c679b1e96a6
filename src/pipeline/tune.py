"""``python -m pipeline.tune [overrides…]``: the changes your run's bottleneck implies (loader settings, amp,
channels_last, compile, the micro-batch), tried inside its real training step, and the fastest proven against your
configuration (``pipeline.autotune.tuning``; ``--help`` for the options)."""

import sys

from pipeline.autotune.tuning import main

if __name__ == "__main__":
    code = main()
    distributed = sys.modules.get("pipeline.parallel.distributed")
    if distributed is not None and distributed.joins():  # a rank ends without the teardown Gloo's threads can abort
        from pipeline.common.heap import exit_without_teardown

        exit_without_teardown(code)
    sys.exit(code)
