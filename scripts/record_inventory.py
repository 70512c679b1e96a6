"""What one run recorded, as JSON: ``.venv/bin/python scripts/record_inventory.py [--uri URI] [--run ID]``.

    python scripts/record_inventory.py --uri sqlite:///a/mlflow.db > before.json   # the newest run in that store
    python scripts/record_inventory.py --diff before.json after.json             # what differs; exit 1 if anything

The inventory holds what must not change when the code changes how fast a run starts or ends: the params with their
values, the metric keys, the tag keys, the artifact paths, and the logged model's tags, metric keys, artifact paths,
``requirements.txt`` and the keys of its ``MLmodel`` file; the last values of the metrics a seed fixes (the FLOPs per
sample, the losses, the val metrics). Values that differ from one run to the next by nature
(timings, ids, times) are left out: only their keys are compared.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts

SAME_VALUES = ("perf/flops_per_sample", "train/epoch_loss")  # and val/*: the same seed gives the same numbers
# An epoch's utilisation summary exists only when the sampler read the machine during that epoch (every
# monitor.interval_s): a fast epoch has none. Listed apart, so that a diff says when only the clock differed.
SAMPLED = ("cpu/util_mean_pct", "cpu/run_util_mean_pct", "gpu/util_mean_pct", "gpu/util_p95_pct", "gpu/mem_peak_mb")


def artifact_paths(list_files: Any, path: str | None = None) -> list[str]:
    """Every file under ``path``, through a client's listing call (a run's or a logged model's)."""
    found = []
    for info in list_files(path):
        found += artifact_paths(list_files, info.path) if info.is_dir else [info.path]
    return sorted(found)


def model_inventory(client: MlflowClient, model_id: str) -> dict[str, Any]:
    """The logged model's record: its tags, metric keys, files, requirements and the keys of its MLmodel."""
    model = client.get_logged_model(model_id)
    folder = Path(download_artifacts(artifact_uri=model.artifact_location))
    mlmodel = yaml.safe_load((folder / "MLmodel").read_text())
    return {
        "tags": sorted(model.tags),
        "metrics": sorted({m.key for m in model.metrics or []}),
        "params": dict(sorted(model.params.items())),
        "artifacts": artifact_paths(lambda path: client.list_logged_model_artifacts(model_id, path)),
        "requirements.txt": (folder / "requirements.txt").read_text().splitlines(),
        "MLmodel keys": sorted(mlmodel),
        "MLmodel flavors": {name: sorted(flavor) for name, flavor in mlmodel.get("flavors", {}).items()},
    }


def inventory(uri: str, run_id: str | None) -> dict[str, Any]:
    """The run's record (the newest run of the store when ``run_id`` is None)."""
    client = MlflowClient(tracking_uri=uri)
    if run_id is None:
        experiments = [e.experiment_id for e in client.search_experiments()]
        run_id = client.search_runs(experiments, order_by=["attributes.start_time DESC"], max_results=1)[0].info.run_id
    run = client.get_run(run_id)
    models = [output.model_id for output in (run.outputs.model_outputs if run.outputs else [])]
    return {
        "status": run.info.status,
        "params": dict(sorted(run.data.params.items())),
        "metrics": sorted(k for k in run.data.metrics if k not in SAMPLED),
        "sampled metrics (on a slow enough epoch)": sorted(k for k in run.data.metrics if k in SAMPLED),
        "values": {k: v for k, v in sorted(run.data.metrics.items()) if k in SAME_VALUES or k.startswith("val/")},
        "tags": sorted(run.data.tags),
        "artifacts": artifact_paths(lambda path: client.list_artifacts(run_id, path)),
        "datasets": sorted(d.dataset.name for d in run.inputs.dataset_inputs),
        "models": [model_inventory(client, model_id) for model_id in models],
    }


def differences(before: Any, after: Any, where: str = "") -> list[str]:
    """Where two inventories differ, one line each."""
    if isinstance(before, dict) and isinstance(after, dict):
        lines = []
        for key in sorted(set(before) | set(after)):
            if key not in after or key not in before:
                lines.append(f"{where}/{key}: only {'before' if key in before else 'after'}")
            else:
                lines += differences(before[key], after[key], f"{where}/{key}")
        return lines
    if isinstance(before, list) and isinstance(after, list) and all(isinstance(x, str) for x in before + after):
        gone, new = sorted(set(before) - set(after)), sorted(set(after) - set(before))
        return [f"{where}: before only {gone}, after only {new}"] if gone or new else []
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        pairs = enumerate(zip(before, after, strict=True))
        return [line for n, (old, new) in pairs for line in differences(old, new, f"{where}/{n}")]
    return [] if before == after else [f"{where}: {before!r} -> {after!r}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uri", default="sqlite:///mlflow.db", help="the tracking store")
    parser.add_argument("--run", default=None, help="the run id (default: the newest run)")
    parser.add_argument("--diff", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="compare two inventories")
    args = parser.parse_args(argv)
    if args.diff:
        before, after = (json.loads(path.read_text()) for path in args.diff)
        lines = differences(before, after)
        print("\n".join(lines) if lines else "the same record")
        return 1 if lines else 0
    print(json.dumps(inventory(args.uri, args.run), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
