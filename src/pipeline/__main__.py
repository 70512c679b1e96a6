"""Train from the command line: ``python -m pipeline [group=option] [group.key=value] ...``.

    python -m pipeline                                      # MLP on the bundled digits
    python -m pipeline model=resnet50 amp=true trainer.max_steps=20
    python -m pipeline -m loader.batch_size=32,64,128 loader.num_workers=0,2,4
    python -m pipeline --help                               # the groups and the composed config

Exit status: 0 on success, 2 for a problem the user can fix (bad config, missing device or
dataset, a tracking store that cannot work, a full disk; one line on stderr), 143 / 130 after
SIGTERM / Ctrl-C (checkpoint written, run KILLED), 1 for anything else (with a traceback).
A sweep (``-m``) is checked job by job before the first job starts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

import hydra
from omegaconf import DictConfig

from pipeline.config import config_dir, from_dictconfig, load, sweep_jobs
from pipeline.errors import PipelineError
from pipeline.stopping import Stopped


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def run(cfg: DictConfig) -> float:
    """Hydra's task (one per sweep job): validate, train, return the final val/acc for sweepers."""
    try:
        run_cfg = from_dictconfig(cfg)  # before any torch work: bad input never touches CUDA or MLflow
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from pipeline.train import train  # imported late: `--help` and bad input skip torch's import

        hydra_cfg = HydraConfig.get()
        result = train(run_cfg, overrides=list(hydra_cfg.overrides.task), quiet=hydra_cfg.mode == RunMode.MULTIRUN)
    except PipelineError as err:
        _fail(err)
    except Stopped as stop:  # SIGTERM / Ctrl-C: checkpoint written, run KILLED; exit as the signal would
        print(f"{stop}; resume with resume=latest", file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)
    except Exception as err:  # a full disk mid-run is the user's to fix too: one line naming where
        from pipeline.store import DiskFull, disk_full

        if not disk_full(err):
            raise
        uri = cfg.tracking.uri if cfg.tracking.enabled else None
        _fail(DiskFull.explain(err, uri=uri, also=[Path(cfg.checkpoint.dir)]))
    return result.val_acc


def main() -> None:
    """Check plain overrides, or every job of a sweep, in one line each, then hand over to Hydra."""
    args = sys.argv[1:]
    plain = not any(a.startswith("-") or a.startswith("hydra") for a in args)
    try:
        if plain:
            load(args)  # Hydra reports these in several lines and exits 1; we say it in one and exit 2
        elif "-m" in args or "--multirun" in args:
            check_sweep(args)
    except PipelineError as err:
        _fail(err)
    run()


def check_sweep(args: list[str]) -> None:
    """Validate every job of ``-m ...`` before Hydra starts the first (which would run before the second fails).

    Commands that run no job (``--help``, ``--cfg``, ``--info``), another primary config (``--config-name``...) and
    sweeps whose jobs the basic sweeper cannot list (``interval()``, another sweeper) are left to Hydra.

    Raises:
        PipelineError: the first bad job, named by its overrides; ``OverrideError`` for one Hydra cannot parse.
    """
    from hydra._internal.utils import get_args_parser

    parsed, unknown = get_args_parser().parse_known_args(args)
    elsewhere = (parsed.config_path, parsed.config_name, parsed.config_dir, parsed.experimental_rerun)
    shows = (parsed.help, parsed.hydra_help, parsed.cfg, parsed.info, parsed.shell_completion, parsed.run)
    if unknown or any(elsewhere) or any(shows):
        return
    jobs = sweep_jobs(parsed.overrides)
    for number, job in enumerate(jobs or [], start=1):
        try:
            load(job)
        except PipelineError as err:
            from pipeline.secrets import mask_overrides

            raise PipelineError(
                f"sweep job {number} of {len(jobs)} ({' '.join(mask_overrides(job))}): {err}; no job was started"
            ) from err


def _fail(err: PipelineError) -> NoReturn:
    print(f"error: {err}", file=sys.stderr, flush=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
