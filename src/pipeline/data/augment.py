"""Training-only augmentation on the device: random crop with zero padding, horizontal flip, whole uint8 batches.

    python -m pipeline data=cifar10 data.augment=crop_flip data.augment_padding=4

Every sample gets its own crop offset and flip decision, drawn in one call for the whole batch and
applied with two ``torch.gather`` calls (rows, then columns, with the flip folded into the column
index): no Python per sample and no float copy, for any ``[N, C, H, W]`` batch (MNIST's one channel,
CIFAR-10's three, image folders of any size). The loop calls it once per batch, right after the copy
to the device and before the out-of-memory replay, so a replayed batch is the same augmented batch;
with ``data.augment=none`` there is no augmenter and the loop makes no call at all.

The draws come from a generator seeded with ``(trainer.seed, step)`` alone, ``step`` being the global
optimizer step the batch trains: nothing else that draws random numbers changes them, and a resumed
run, which restores the step, augments every batch exactly as the uninterrupted run did. Under DDP the
draws are made for the global batch and each rank keeps its samples' share (every ``world``-th, as
``EpochOrder`` deals them out), so N ranks augment as one process with the global batch does. The
generator lives on the training device: the same device type draws the same numbers, but a CUDA
generator draws different ones than a CPU generator with the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.common.errors import ConfigError
from pipeline.config import DataConfig

# data.augment -> (random crop, horizontal flip). Flipping is wrong for digits and text (a mirrored 2 is no 2).
AUGMENTS = {"none": (False, False), "crop": (True, False), "flip": (False, True), "crop_flip": (True, True)}


def step_seed(seed: int, step: int) -> int:
    """The generator seed for one step: a function of the run's seed and the step alone (odd multipliers, so
    nearby seeds and steps do not collide, and it differs from ``EpochOrder``'s ``(seed, epoch)`` seeds)."""
    return (seed * 6_364_136_223_846_793_005 + step * 1_442_695_040_888_963_407 + 1) % 2**63


@dataclass(frozen=True)
class Draws:
    """One batch's random choices: crop offsets ``[n, 2]`` (rows, columns; 0..2*padding) and flips ``[n, 1]``."""

    shifts: torch.Tensor | None
    flips: torch.Tensor | None


class CropFlip:
    """Random crop (pad ``padding`` zero pixels on every side, crop back to H x W) and/or horizontal flip.

    Args:
        crop, flip: which of the two to apply.
        padding: zero pixels added on each side before cropping (crop only).
        seed: the run's seed (``trainer.seed``).
        device: the training device; the generator lives there, so drawing costs no host-to-device copy.
        rank, world: this process's rank and the number of ranks (DDP).
    """

    def __init__(
        self, *, crop: bool, flip: bool, padding: int, seed: int, device: torch.device, rank: int = 0, world: int = 1
    ) -> None:
        if not (crop or flip):
            raise ValueError("CropFlip needs crop or flip; with neither, use no augmenter at all")
        if crop and padding < 1:
            raise ValueError(f"crop needs padding >= 1, got {padding}")
        self.crop, self.flip, self.padding = crop, flip, padding
        self.seed, self.rank, self.world = seed, rank, world
        self.generator = torch.Generator(device=device)

    def __call__(self, images: torch.Tensor, step: int) -> torch.Tensor:
        """``images`` (uint8 ``[N, C, H, W]`` on the device) augmented with step ``step``'s draws."""
        return self.apply(images, self.draw(images.shape[0], step))

    def draw(self, n: int, step: int) -> Draws:
        """Step ``step``'s choices for this rank's ``n`` samples (a host-side reseed, then one or two small draws)."""
        generator = self.generator
        generator.manual_seed(step_seed(self.seed, step))
        total, mine = n * self.world, slice(self.rank, None, self.world)  # the global batch's draws, this rank's share
        device = generator.device
        shifts = None
        if self.crop:
            shifts = torch.randint(0, 2 * self.padding + 1, (total, 2), generator=generator, device=device)[mine][:n]
        flips = None
        if self.flip:
            flips = torch.randint(0, 2, (total, 1), generator=generator, device=device)[mine][:n].bool()
        return Draws(shifts, flips)

    def apply(self, images: torch.Tensor, draws: Draws) -> torch.Tensor:
        n, c, h, w = images.shape
        cols = torch.arange(w, device=images.device).expand(n, w)  # source column of each output column
        if draws.shifts is not None:
            p = self.padding
            images = F.pad(images, (p, p, p, p))  # zeros: [N, C, H + 2p, W + 2p]
            rows = draws.shifts[:, :1] + torch.arange(h, device=images.device)
            images = images.gather(2, rows.view(n, 1, h, 1).expand(n, c, h, w + 2 * p))
            cols = cols + draws.shifts[:, 1:]
        if draws.flips is not None:
            cols = torch.where(draws.flips, cols.flip(1), cols)  # a mirrored crop: the same columns, read backwards
        return images.gather(3, cols.reshape(n, 1, 1, w).expand(n, c, h, w))


def make_augment(
    cfg: DataConfig,
    *,
    in_shape: tuple[int, ...],
    seed: int,
    device: torch.device,
    rank: int = 0,
    world: int = 1,
) -> CropFlip | None:
    """The training augmenter ``data.augment`` names, or None for ``none`` (then the loop calls nothing).

    Raises:
        ConfigError: data.augment_padding as wide as the images or wider (a crop could be all padding).
    """
    crop, flip = AUGMENTS[cfg.augment]
    if not (crop or flip):
        return None
    _, h, w = in_shape
    if crop and cfg.augment_padding >= min(h, w):
        raise ConfigError(
            "data.augment_padding",
            cfg.augment_padding,
            f"at most {min(h, w) - 1} for these {h}x{w} images (wider, a crop could miss the image entirely)",
        )
    return CropFlip(crop=crop, flip=flip, padding=cfg.augment_padding, seed=seed, device=device, rank=rank, world=world)
