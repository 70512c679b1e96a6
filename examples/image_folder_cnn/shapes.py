"""An image folder of drawn shapes (circles, squares, triangles), read by torchvision's ``ImageFolder`` with this
project's own transform: ``data._target_=shapes.folders``.

The folder is drawn on first use (``shapes/<class>/<n>.png``, a few hundred small PNGs), so the example needs no
download; point ``root`` at your own folder of one sub-folder per class to train on your images instead.
"""

import random
from pathlib import Path

from torch.utils.data import Subset
from torchvision import datasets, transforms

CLASSES = ("circle", "square", "triangle")


def folders(root: str = "shapes", size: int = 32, per_class: int = 120, val_fraction: float = 0.25, seed: int = 0):
    """(train, val): the same images, the training split with a random flip and a little jitter."""
    folder = Path(root)
    if not folder.is_dir():
        draw(folder, per_class=per_class, seed=seed)
    train_transform = transforms.Compose(
        [
            transforms.Resize((size, size)),
            transforms.RandomHorizontalFlip(),
            transforms.ColorJitter(brightness=0.2),
            transforms.ToTensor(),
            transforms.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
        ]
    )
    val_transform = transforms.Compose(
        [transforms.Resize((size, size)), transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.25,) * 3)]
    )
    train_all = datasets.ImageFolder(str(folder), transform=train_transform)
    val_all = datasets.ImageFolder(str(folder), transform=val_transform)
    order = list(range(len(train_all)))
    random.Random(seed).shuffle(order)
    cut = int(len(order) * val_fraction)
    return Subset(train_all, order[cut:]), Subset(val_all, order[:cut])  # classes: through Subset.dataset


def draw(folder: Path, *, per_class: int, seed: int) -> None:
    """``per_class`` PNGs of each shape, in random places, sizes and colours on a noisy background."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    for name in CLASSES:
        (folder / name).mkdir(parents=True, exist_ok=True)
        for n in range(per_class):
            image = Image.new("RGB", (48, 48), tuple(rng.randrange(0, 90) for _ in range(3)))
            pen = ImageDraw.Draw(image)
            r = rng.randrange(9, 18)
            x, y = rng.randrange(r, 48 - r), rng.randrange(r, 48 - r)
            colour = tuple(rng.randrange(140, 256) for _ in range(3))
            if name == "circle":
                pen.ellipse((x - r, y - r, x + r, y + r), fill=colour)
            elif name == "square":
                pen.rectangle((x - r, y - r, x + r, y + r), fill=colour)
            else:
                pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=colour)
            image.save(folder / name / f"{n:03d}.png")
