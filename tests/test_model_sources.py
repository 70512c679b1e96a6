"""Models from torchvision by name, pretrained weights (a file, or torchvision's offline), timm, and the user's
factories: each fitted to the data, each failure one line."""

from __future__ import annotations

import sys
import urllib.error
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.common.targets import TargetError
from pipeline.config import ModelConfig
from pipeline.engine.models import WeightsError, build_model

TORCHVISION = "pipeline.engine.models.torchvision_model"


def torchvision(arch: str, weights: str | None = None) -> ModelConfig:
    return ModelConfig(TORCHVISION, {"arch": arch, "weights": weights})


@pytest.mark.parametrize("arch", ["mobilenet_v3_small", "squeezenet1_0", "efficientnet_b0"])
def test_any_torchvision_classifier_fits_the_datas_channels_and_classes(arch: str) -> None:
    model = build_model(torchvision(arch), in_shape=(1, 64, 64), num_classes=5).eval()
    assert model(torch.zeros(2, 1, 64, 64)).shape == (2, 5)


def test_an_unknown_architecture_is_one_line_with_names_to_try() -> None:
    with pytest.raises(TargetError, match=r"^model\.arch='resnet_99' is no torchvision classification model: e\.g\. "):
        build_model(torchvision("resnet_99"), in_shape=(3, 32, 32), num_classes=10)


def test_weights_from_a_file_load_and_a_classifier_of_another_class_count_trains_from_scratch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import torchvision.models as tv

    source = tv.resnet18(num_classes=1000)
    torch.save(source.state_dict(), tmp_path / "r18.pt")
    model = build_model(torchvision("resnet18", str(tmp_path / "r18.pt")), in_shape=(3, 32, 32), num_classes=4)
    torch.testing.assert_close(model.conv1.weight, source.conv1.weight)
    assert model.fc.out_features == 4 and "['fc.weight', 'fc.bias'] did not fit the data's classes" in caplog.text
    torch.save({"unrelated": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(WeightsError, match=r"other\.pt: does not fit this architecture \(\d+ missing, 1 unexpected"):
        build_model(torchvision("resnet18", str(tmp_path / "other.pt")), in_shape=(3, 32, 32), num_classes=4)


def test_named_weights_offline_say_which_file_to_put_where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr("torchvision.models._api.load_state_dict_from_url", offline)
    with pytest.raises(WeightsError) as info:
        build_model(torchvision("resnet18", "DEFAULT"), in_shape=(3, 32, 32), num_classes=10)
    message = str(info.value)
    assert message.startswith("model.weights=DEFAULT: resnet18's weights are not in the hub cache and could not be")
    assert f"at {tmp_path / 'hub' / 'checkpoints' / 'resnet18-f37072fd.pth'}" in message and "\n" not in message
    with pytest.raises(WeightsError, match=r"^model\.weights='SHINY': no such weights for resnet18 \(one of DEFAULT"):
        build_model(torchvision("resnet18", "SHINY"), in_shape=(3, 32, 32), num_classes=10)


def test_pretrained_weights_replace_the_classifier_to_fit_the_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchvision.models as tv

    cached = tv.resnet18(num_classes=1000).state_dict()
    monkeypatch.setattr("torchvision.models._api.load_state_dict_from_url", lambda *a, **k: cached)
    model = build_model(torchvision("resnet18", "IMAGENET1K_V1"), in_shape=(1, 32, 32), num_classes=3)
    assert model.fc.out_features == 3 and model.conv1.in_channels == 1  # pretrained RGB filters averaged to grey
    torch.testing.assert_close(model.conv1.weight, cached["conv1.weight"].mean(dim=1, keepdim=True))


def test_timm_is_one_line_with_the_install_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    with pytest.raises(
        TargetError, match=r"^model=timm needs timm: pip install timm \(or pip install -e '\.\[timm\]'\)$"
    ):
        build_model(
            ModelConfig("pipeline.engine.models.timm_model", {"arch": "resnet18"}), in_shape=(3, 32, 32), num_classes=2
        )


def test_a_timm_architecture_fits_the_data() -> None:
    pytest.importorskip("timm")
    cfg = ModelConfig("pipeline.engine.models.timm_model", {"arch": "resnet18", "pretrained": False})
    model = build_model(cfg, in_shape=(1, 32, 32), num_classes=7).eval()
    assert model(torch.zeros(2, 1, 32, 32)).shape == (2, 7)


def test_a_factory_needing_the_class_count_the_data_lacks_says_which_key_sets_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mynets.py").write_text(
        "from torch import nn\n\ndef head(num_classes, width=4):\n    return nn.Linear(width, num_classes)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mynets", raising=False)
    with pytest.raises(TargetError, match=r"needs num_classes, which the data does not give: set data\.num_classes=N"):
        build_model(ModelConfig("mynets.head", {}), in_shape=(4,), num_classes=None)
    assert isinstance(build_model(ModelConfig("mynets.head", {}), in_shape=(4,), num_classes=3), nn.Linear)
