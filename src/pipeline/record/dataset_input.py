"""The dataset as an MLflow run input (the runs table's Dataset column), every text in it masked."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # an annotation only: importing pipeline.data would load torch for a type
    from pipeline.data.sources import DataSpec


def dataset_inputs(spec: DataSpec, context: str, *, mask: Callable[[str], str]) -> list[Any]:
    """One ``DatasetInput`` for ``spec`` used as ``context`` (train, validation), its name, digest and source masked."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    local = spec.source.startswith("/")
    source = mask(spec.source)  # masked before JSON escapes it (a Windows path's backslashes)
    dataset = Dataset(
        name=mask(spec.name),
        digest=mask(spec.digest),
        source_type="local" if local else "code",
        source=json.dumps({"uri": source} if local else {"tags": {"origin": source}}),
        schema=json.dumps({"inputs": spec.inputs, "shape": spec.in_shape, "classes": spec.num_classes}),
        profile=json.dumps({"train_samples": spec.train_size, "val_samples": spec.val_size}),
    )
    return [DatasetInput(dataset, [InputTag(MLFLOW_DATASET_CONTEXT, context)])]
