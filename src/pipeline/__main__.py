"""Train from the command line: ``python -m pipeline [group=option] [group.key=value] ...``.

    python -m pipeline                                      # MLP on the bundled digits
    python -m pipeline model=resnet50 amp=true trainer.max_steps=20
    python -m pipeline -m loader.batch_size=32,64,128 loader.num_workers=0,2,4
    python -m pipeline --help                               # the groups and the composed config

Exit status: 0 on success, 2 for a problem the user can fix (bad config, missing device or
dataset; one line on stderr), 143 / 130 after SIGTERM / Ctrl-C (checkpoint written, run KILLED),
1 for anything else (with a traceback).
"""

from __future__ import annotations

import sys
from typing import NoReturn

import hydra
from omegaconf import DictConfig

from pipeline.config import config_dir, from_dictconfig, load
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
    return result.val_acc


def main() -> None:
    """Check plain overrides in one line each, then hand over to Hydra (which also runs sweeps)."""
    args = sys.argv[1:]
    plain = not any(a.startswith("-") or a.startswith("hydra") for a in args)
    if plain:
        try:
            load(args)  # Hydra reports these in several lines and exits 1; we say it in one and exit 2
        except PipelineError as err:
            _fail(err)
    run()


def _fail(err: PipelineError) -> NoReturn:
    print(f"error: {err}", file=sys.stderr, flush=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
