"""Device choice: auto prefers the biggest GPU; a requested device that is missing is an error."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from helpers import fake_command
from pipeline.config import DeviceConfig
from pipeline.engine.building.devices import DeviceError, resolve_device

GIB = 2**30


def fake_gpus(monkeypatch: pytest.MonkeyPatch, *gpus: tuple[str, int]) -> None:
    """Pretend torch sees these CUDA devices: (name, memory in GiB)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(gpus))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: SimpleNamespace(name=gpus[i][0], total_memory=gpus[i][1] * GIB, major=8, minor=6),
    )


def test_auto_picks_the_cuda_device_with_the_most_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, ("Intel-ish small", 2), ("NVIDIA GeForce RTX 3090", 24), ("NVIDIA T400", 4))
    choice = resolve_device(DeviceConfig("auto"))
    assert choice.device == torch.device("cuda", 1)
    assert choice.name == "NVIDIA GeForce RTX 3090"
    assert "most memory (24576 MB)" in choice.reason and "0: Intel-ish small 2048 MB" in choice.reason


def test_auto_without_gpu_or_mps_uses_the_cpu_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    choice = resolve_device(DeviceConfig("auto"))
    assert choice.device == torch.device("cpu")
    assert choice.reason.startswith("auto: no CUDA or MPS device") and "0 CUDA device(s)" in choice.reason


def test_auto_prefers_mps_over_cpu_when_there_is_no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device(DeviceConfig("auto")).device == torch.device("mps")


def test_cuda_requested_without_a_gpu_is_an_error_saying_what_was_found(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_gpus(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere
    with pytest.raises(
        DeviceError, match=r"device=cuda requested, but CUDA is not usable: torch .* 0 CUDA device"
    ) as e:
        resolve_device(DeviceConfig("cuda", 0))
    assert "no nvidia-smi on PATH" in str(e.value)


def test_cuda_error_names_the_driver_tool_when_present(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_gpus(monkeypatch)
    smi = fake_command(tmp_path, "nvidia-smi", "exit 9\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(DeviceError, match=f"CPU-only build.*nvidia-smi at {smi}"):
        resolve_device(DeviceConfig("cuda", 0))


def test_cuda_index_out_of_range_lists_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, ("NVIDIA A100", 40))
    with pytest.raises(
        DeviceError, match=r"device.index=3 requested, but torch sees 1 CUDA device\(s\): 0: NVIDIA A100"
    ):
        resolve_device(DeviceConfig("cuda", 3))


def test_cuda_with_index_returns_that_device(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, ("A", 8), ("B", 16))
    choice = resolve_device(DeviceConfig("cuda", 0))
    assert choice.device == torch.device("cuda", 0) and choice.name == "A"


def test_mps_requested_where_missing_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="device=mps requested, but MPS is not usable"):
        resolve_device(DeviceConfig("mps"))


def test_cpu_is_always_available_and_named() -> None:
    choice = resolve_device(DeviceConfig("cpu"))
    assert choice.device == torch.device("cpu") and choice.name and choice.reason == "device=cpu requested"


def test_a_run_asking_for_a_missing_gpu_says_the_doctors_finding(
    monkeypatch: pytest.MonkeyPatch, make_cfg: Any
) -> None:
    """The engine never imports the doctor: the entry point hands its finding to ``build``."""
    from pipeline.machine import doctor
    from pipeline.train import train

    fake_gpus(monkeypatch)
    monkeypatch.setattr(doctor, "main_finding", lambda facts=None: "the driver (470.57) is too old for CUDA 13")
    with pytest.raises(DeviceError, match=r"the driver \(470.57\) is too old for CUDA 13"):
        train(make_cfg("tracking=none", "device=cuda"), echo=False)
