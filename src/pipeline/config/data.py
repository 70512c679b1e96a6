"""The data group's schema: a built-in source by name, or the user's datasets through ``data._target_``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.common.errors import ConfigError
from pipeline.config.targets import SPREAD, TargetConfig, check_target

DIGITS = ("digits", "mnist")  # datasets of handwritten digits: mirroring changes what a sample shows
CUSTOM_DATA_KEYS = frozenset(
    {"name", "_target_", "target_key", "collate_fn", "split_batch", "steps_per_epoch", "num_classes", "batch_dim"}
)  # data=custom: the keys that stay the pipeline's, never the factory's keywords


@dataclass(frozen=True)
class DataConfig:
    """data: a built-in source by ``name``, or ``name=custom`` with a ``_target_`` returning ``(train, val)`` (or
    ``{"train": ..., "val": ...}``) datasets; a custom group's keys other than the ones below are its keywords."""

    name: Literal["digits", "mnist", "fashion_mnist", "cifar10", "imagefolder", "synthetic", "custom"]
    root: str | None = None
    download: bool | None = None  # null where the dataset is never downloaded (digits, synthetic, folders)
    image_size: int | None = None
    channels: int | None = None
    val_fraction: float | None = None
    shape: list[int] | None = None
    num_classes: int | None = None
    num_samples: int | None = None
    val_samples: int | None = None
    augment: Literal["none", "crop", "flip", "crop_flip"] = "none"  # training only (pipeline.data.augment)
    augment_padding: int = 4  # zero pixels on each side before the random crop
    # data=custom only (pipeline.data.custom)
    _target_: str | None = None  # the factory of the datasets
    target_key: str = "target"  # dict items: the target's entry; the other entries are the model's keyword inputs
    collate_fn: TargetConfig | None = None  # batches from items; null = PyTorch's default_collate
    split_batch: TargetConfig | None = None  # (batch, pieces) -> micro-batches, for batches the OOM fallback can't cut
    steps_per_epoch: int | None = None  # iterable datasets: batches per epoch (required without __len__)
    batch_dim: int = 0  # the dimension that counts a batch's samples (1: sequence-first [T, B] data)
    keywords: dict[str, Any] = field(default_factory=dict, metadata=SPREAD)

    @staticmethod
    def open_fields(node: Any) -> frozenset[str] | None:
        """With ``data=custom`` (or a ``_target_``), the keys that stay the pipeline's; every other key is a keyword
        of the factory. None for a built-in source, whose keys are all fixed."""
        if node.get("name") != "custom" and node.get("_target_") is None:
            return None
        return CUSTOM_DATA_KEYS

    def check(self) -> None:
        if self.name == "custom" or self._target_ is not None:
            self._check_custom()
            return
        if self.steps_per_epoch is not None or self.collate_fn is not None or self.split_batch is not None:
            raise ConfigError("data.name", self.name, "custom for data.collate_fn, data.split_batch, steps_per_epoch")
        if self.batch_dim != 0:
            raise ConfigError("data.batch_dim", self.batch_dim, f"0 for data={self.name} (its images are [N, C, H, W])")
        if self.name == "imagefolder" and not self.root:
            raise ConfigError("data.root", self.root, "a folder with one sub-folder per class for data=imagefolder")
        if self.image_size is not None and self.image_size < 1:
            raise ConfigError("data.image_size", self.image_size, "an integer >= 1 (pixels per side)")
        if self.channels is not None and self.channels not in (1, 3):
            raise ConfigError("data.channels", self.channels, "1 (greyscale) or 3 (RGB)")
        if self.val_fraction is not None and not 0.0 < self.val_fraction < 1.0:
            raise ConfigError("data.val_fraction", self.val_fraction, "a fraction strictly between 0 and 1")
        if self.shape is not None and (len(self.shape) != 3 or min(self.shape) < 1):
            raise ConfigError("data.shape", self.shape, "[channels, height, width], each >= 1")
        if self.num_classes is not None and self.num_classes < 2:
            raise ConfigError("data.num_classes", self.num_classes, "an integer >= 2")
        for key in ("num_samples", "val_samples"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"data.{key}", value, "an integer >= 1")
        if self.augment_padding < 0:
            raise ConfigError("data.augment_padding", self.augment_padding, "an integer >= 0 (pixels on each side)")
        if self.augment in ("flip", "crop_flip") and self.name in DIGITS:
            raise ConfigError(
                "data.augment",
                self.augment,
                f"none or crop for data={self.name}: a mirrored digit is another symbol or none (a 2 mirrored is no "
                f"2), so flipping teaches wrong labels; use data.augment=crop to shift them instead",
            )
        if self.augment in ("crop", "crop_flip") and self.augment_padding == 0:
            raise ConfigError(
                "data.augment_padding", 0, f"an integer >= 1 with data.augment={self.augment} (0 pixels crops nothing)"
            )

    def _check_custom(self) -> None:
        if self.name != "custom":
            raise ConfigError("data._target_", self._target_, f"null with data={self.name} (data=custom takes one)")
        if self._target_ is None:
            raise ConfigError.missing("data._target_")
        check_target("data._target_", self._target_)
        for key, hook in (("data.collate_fn", self.collate_fn), ("data.split_batch", self.split_batch)):
            if hook is not None:
                hook.check_at(key)
        if not self.target_key:
            raise ConfigError("data.target_key", self.target_key, "the name of the target's entry in dict items")
        if self.steps_per_epoch is not None and self.steps_per_epoch < 1:
            raise ConfigError("data.steps_per_epoch", self.steps_per_epoch, "null or an integer >= 1")
        if self.num_classes is not None and self.num_classes < 1:
            raise ConfigError("data.num_classes", self.num_classes, "null (from the dataset) or an integer >= 1")
        if self.batch_dim < 0:
            raise ConfigError(
                "data.batch_dim", self.batch_dim, "0 (batch-first) or the dimension of the samples (1: [T, B])"
            )
