"""The trained model is logged with this process's versions as its requirements, without MLflow's check of them
against this environment (the environment they come from): the check cost about 1 s of every run."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import torch
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts
from mlflow.utils import environment
from torch import nn

from pipeline.record.logged_model import REQUIREMENTS_CHECK, ModelCard, log_model, requirements


def test_a_model_is_logged_with_this_process_versions_and_without_mlflows_check_of_them(
    store_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[list[str]] = []
    # raising=True: an MLflow without this check fails here, so the second it saved does not come back unnoticed
    monkeypatch.setattr(environment, REQUIREMENTS_CHECK, lambda reqs: checked.append(list(reqs)), raising=True)
    mine = getattr(environment, REQUIREMENTS_CHECK)
    client = MlflowClient(store_uri)
    experiment_id = client.create_experiment("models")
    run_id = client.create_run(experiment_id).info.run_id
    model = nn.Linear(4, 2)
    inputs = torch.zeros(2, 4)
    card = ModelCard(inputs, model(inputs).detach(), {"task": "classification"}, metrics=[])

    uri = log_model(client, uri=store_uri, experiment_id=experiment_id, run_id=run_id, model=model, card=card)

    assert uri == f"runs:/{run_id}/model"
    assert checked == [] and getattr(environment, REQUIREMENTS_CHECK) is mine  # skipped for the call, then put back
    (logged,) = client.search_logged_models([experiment_id])
    folder = Path(download_artifacts(artifact_uri=logged.artifact_location))
    assert (folder / "requirements.txt").read_text().split() == [f"mlflow=={mlflow.__version__}", *requirements()]
