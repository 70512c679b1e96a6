"""Whether a CPU peak can be trusted under load: ``.venv/bin/python scripts/peak_under_load.py [--measurements 10]``.

Issue 37's contract for the CPU's matmul peak (``pipeline.monitor.peaks``, the denominator of a CPU run's MFU): ten
consecutive measurements on a machine loaded by a CPU burner either agree with the quiet figure within 20% or are
refused and not cached. The script measures the quiet figure first (retried until a measurement is accepted), starts
a burner (a process per CPU, each spinning in a pure-Python loop; ``--duty 0.3``: for 3 ms in every 10, a load
the measurement has to judge rather than one it plainly refuses), then takes the measurements through the path a
run takes, ``cpu_peak``, each into a cache of its own, and prints each as accepted (with its ratio to the quiet
figure, per dtype) or refused (with the reason, and whether anything was cached). It exits 1 when one breaks the
contract.

The figures are this machine's only: timing claims live here, never in the test suite.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from pipeline.engine.building.devices import cpu_name
from pipeline.monitor import peaks
from pipeline.monitor.peaks import WINDOW_DTYPES, Window

AGREE = 0.20  # the contract: an accepted measurement within this of the quiet figure
PERIOD_S = 0.010  # a partial burner's cycle: it spins for --duty of it and sleeps the rest
SPIN = """import sys, time
duty = float(sys.argv[1])
while True:
    began = time.perf_counter()
    while time.perf_counter() - began < PERIOD * duty:
        pass
    if duty < 1:
        time.sleep(PERIOD * (1 - duty))
""".replace("PERIOD", repr(PERIOD_S))


def measured(cache: Path, windows: list[Window]) -> peaks.Peak:
    """One measurement through ``cpu_peak`` (as a run's start takes it), into ``cache``; its window goes to
    ``windows``, so that what decided is shown."""

    def measure(dtypes: Sequence[str]) -> Window:
        windows.append(peaks.measure_window(dtypes))
        return windows[-1]

    return peaks.cpu_peak("fp32", cpu=cpu_name(), cache=cache, measure=measure)


def evidence(window: Window) -> str:
    spread = ", ".join(f"{dtype} {s:.2f}x" for dtype, s in window.spread.items())
    return f"others took {window.others_pct:.0f}% of the {window.cpus} CPU(s) needed, median/fastest {spread}"


def quiet_figure(folder: Path, *, tries: int) -> dict[str, float]:
    """The quiet figures per dtype: the first accepted measurement in ``tries``, a second apart."""
    for attempt in range(1, tries + 1):
        windows: list[Window] = []
        peak = measured(folder / f"quiet-{attempt}.json", windows)
        if peak.tflops is not None:
            figures = windows[-1].tflops
            said = ", ".join(f"{dtype} {tflops:.3g} TFLOP/s" for dtype, tflops in figures.items())
            print(f"quiet figure (try {attempt}): {said} ({evidence(windows[-1])})")
            return figures
        print(f"quiet try {attempt}: refused: {peak.reason}")
        time.sleep(1.0)
    raise SystemExit(f"no quiet figure in {tries} tries: the machine stayed busy; run it when it is quieter")


def burner(processes: int, duty: float) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", SPIN, str(duty)]) for _ in range(processes)]


def loaded(folder: Path, quiet: dict[str, float], *, measurements: int) -> int:
    """The measurements under the burner, printed; returns how many broke the contract."""
    broken = 0
    for i in range(1, measurements + 1):
        cache, windows = folder / f"loaded-{i}.json", []
        peak = measured(cache, windows)
        if peak.tflops is None:
            ok = not cache.exists()
            print(f"{i:2d}: refused ({'not cached' if ok else 'CACHED'}): {windows[-1].refused}")
        else:
            ratios = {dtype: tflops / quiet[dtype] for dtype, tflops in windows[-1].tflops.items()}
            ok = all(abs(r - 1) <= AGREE for r in ratios.values()) and cache.exists()
            said = ", ".join(f"{dtype} {r:.2f}x" for dtype, r in ratios.items())
            print(f"{i:2d}: accepted{'' if ok else ' (BREAKS THE CONTRACT)'}: {said} quiet ({evidence(windows[-1])})")
        broken += not ok
    return broken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measurements", type=int, default=10, help="under load (default 10)")
    parser.add_argument("--quiet-tries", type=int, default=30, help="for the quiet figure, a second apart")
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 1, help="spinning processes (one per CPU)")
    parser.add_argument("--duty", type=float, default=1.0, help="the share of the time each spins (default 1: all)")
    args = parser.parse_args(argv)
    if not 0 < args.duty <= 1:
        parser.error(f"--duty must be in (0, 1], got {args.duty}")
    print(f"{cpu_name()}, {os.cpu_count()} CPU(s), dtypes {', '.join(WINDOW_DTYPES)} in one window each")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        quiet = quiet_figure(folder, tries=args.quiet_tries)
        spinning = burner(args.burners, args.duty)
        try:
            time.sleep(0.5)  # the burners past their interpreters' start
            print(f"burner: {args.burners} process(es) spinning {args.duty:.0%} of the time")
            began = time.perf_counter()
            broken = loaded(folder, quiet, measurements=args.measurements)
            took = time.perf_counter() - began
        finally:
            for process in spinning:
                process.kill()
                process.wait()
    verdict = "every one agreed within 20% or was refused and not cached" if not broken else f"{broken} broke it"
    print(f"{args.measurements} measurements under load in {took:.1f} s: {verdict}")
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
