"""A small convolutional network: ``model._target_=cnn.SmallCNN``; ``num_classes`` comes from the data (the
dataset's ``classes``), ``width`` from the config."""

from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int, in_shape: tuple[int, int, int] = (3, 32, 32), width: int = 16) -> None:
        super().__init__()
        channels = in_shape[0]
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1),
            nn.BatchNorm2d(4 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))
