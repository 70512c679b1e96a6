"""The trained model is logged with this process's versions as its requirements, without MLflow's check of them
against this environment (the environment they come from, about 1 s of every run) and without its serving of the
input example in this process (about 0.7 s): the model still serves it, through ``mlflow.pyfunc``, here."""

from __future__ import annotations

import importlib
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts
from torch import nn

from pipeline.record.logged_model import SELF_CHECKS, Destination, ModelCard, log_model, requirements


def test_a_model_is_logged_with_this_process_versions_without_mlflows_self_checks_and_serves_its_example(
    store_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[str] = []
    for module_name, name in SELF_CHECKS:
        # raising=True: an MLflow without this check fails here, so the time it saved does not come back unnoticed
        spy = lambda *args, name=name, **kwargs: checked.append(name)  # noqa: E731
        monkeypatch.setattr(importlib.import_module(module_name), name, spy, raising=True)
    mine = [getattr(importlib.import_module(module_name), name) for module_name, name in SELF_CHECKS]
    client = MlflowClient(store_uri)
    experiment_id = client.create_experiment("models")
    run_id = client.create_run(experiment_id).info.run_id
    model = nn.Linear(4, 2)
    inputs = torch.arange(8.0).view(2, 4)
    card = ModelCard(inputs, model(inputs).detach(), {"task": "classification"}, metrics=[])

    uri = log_model(client, Destination(store_uri, experiment_id, run_id), model=model, card=card).uri

    assert uri == f"runs:/{run_id}/model"
    assert checked == []  # skipped for the call, then put back:
    assert [getattr(importlib.import_module(module_name), name) for module_name, name in SELF_CHECKS] == mine
    served = mlflow.pyfunc.load_model(uri).predict(inputs.numpy())  # what MLflow's serving check would have run
    np.testing.assert_allclose(served, card.outputs.numpy(), rtol=1e-6)
    (logged,) = client.search_logged_models([experiment_id])
    folder = Path(download_artifacts(artifact_uri=logged.artifact_location))
    assert (folder / "requirements.txt").read_text().split() == [f"mlflow=={mlflow.__version__}", *requirements()]
