"""Train from the command line: ``python -m pipeline [group=option] [group.key=value] ...``.

    python -m pipeline                                      # MLP on the bundled digits
    python -m pipeline model=resnet50 amp=true trainer.max_steps=20
    python -m pipeline -m loader.batch_size=32,64,128 loader.num_workers=0,2,4
    python -m pipeline --help                               # the groups and the composed config

Exit status: 0 on success, 2 for a problem the user can fix (bad config, missing device or
dataset; one line on stderr), 1 for anything else (with a traceback).
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from pipeline.config import config_dir, from_dictconfig
from pipeline.errors import PipelineError

log = logging.getLogger("pipeline")


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def main(cfg: DictConfig) -> float:
    """Hydra's task: validate, train, and return the final val/acc (the value sweepers optimise)."""
    try:
        run_cfg = from_dictconfig(cfg)  # before any torch work: bad input never touches CUDA or MLflow
        from hydra.core.hydra_config import HydraConfig

        from pipeline.train import train  # imported late: `--help` and config errors skip torch

        result = train(run_cfg, overrides=list(HydraConfig.get().overrides.task))
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    return result.val_acc


if __name__ == "__main__":
    main()
