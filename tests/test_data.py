"""Datasets from files the tests write (no downloads), and the two batch paths."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.datasets as tvd

from files import MNIST_FILES, mnist_arrays, write_cifar10, write_image_folder, write_mnist
from pipeline.common.errors import DatasetError
from pipeline.config import DataConfig, LoaderConfig
from pipeline.data import (
    DataBundle,
    EpochOrder,
    Normalize,
    Place,
    ResidentLoader,
    Split,
    load_data,
    make_batches,
    sources,
)

LOADER = LoaderConfig(
    batch_size=16,
    num_workers=0,
    pin_memory="auto",
    persistent_workers=False,
    prefetch_factor=None,
    drop_last=False,
    resident=False,
)


def test_digits_are_real_upsampled_and_split_the_same_way_every_time() -> None:
    first = load_data(DataConfig("digits", image_size=28, val_fraction=0.2))
    second = load_data(DataConfig("digits", image_size=28, val_fraction=0.2))
    spec = first.spec
    assert (spec.train_size, spec.val_size, spec.num_classes, spec.in_shape) == (1438, 359, 10, (1, 28, 28))
    images, labels = first.train.tensors
    assert images.dtype == torch.uint8 and images.shape == (1438, 1, 28, 28) and int(images.max()) == 255
    assert sorted(labels.unique().tolist()) == list(range(10))
    assert torch.equal(images, second.train.tensors[0]) and spec.digest == second.spec.digest
    val_images = first.val.tensors[0]
    assert not any(torch.equal(val_images[0], im) for im in images[:200])  # held-out, not a copy


@pytest.mark.parametrize(("name", "folder"), [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_mnist_format_files_load_with_their_labels(tmp_path: Path, name: str, folder: str) -> None:
    write_mnist(tmp_path, folder, n_train=100, n_val=30)
    bundle = load_data(DataConfig(name, root=str(tmp_path), download=False))
    train_images, train_labels = mnist_arrays(100, 30)[True]
    images, labels = bundle.train.tensors
    assert images.shape == (100, 1, 28, 28) and bundle.spec.val_size == 30
    assert torch.equal(images[:, 0], torch.from_numpy(train_images))
    assert torch.equal(labels, torch.from_numpy(train_labels).long())
    assert bundle.spec.source == str(tmp_path.resolve())
    assert bundle.spec.mean == ((0.1307,) if name == "mnist" else (0.2860,))


def test_cifar10_pickles_load_as_nchw_colour_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    md5 = write_cifar10(tmp_path, per_batch=8, n_val=6)
    monkeypatch.setattr(tvd.CIFAR10, "train_list", [[f"data_batch_{i}", md5[f"data_batch_{i}"]] for i in range(1, 6)])
    monkeypatch.setattr(tvd.CIFAR10, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(tvd.CIFAR10, "meta", {**tvd.CIFAR10.meta, "md5": md5["batches.meta"]})
    bundle = load_data(DataConfig("cifar10", root=str(tmp_path), download=False))
    assert bundle.spec.in_shape == (3, 32, 32) and bundle.spec.num_classes == 10
    assert (bundle.spec.train_size, bundle.spec.val_size) == (40, 6)
    assert bundle.train.tensors[0].dtype == torch.uint8


def test_missing_files_without_download_name_the_folder_and_the_files(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as info:
        load_data(DataConfig("mnist", root=str(tmp_path), download=False))
    message = str(info.value)
    assert str(tmp_path / "MNIST" / "raw") in message and "data.download=false" in message
    for name in MNIST_FILES:
        assert name in message
    assert "\n" not in message


def test_a_failing_download_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the real download code, pointed at a port where nothing listens: fails at once, no network used
    monkeypatch.setattr(tvd.MNIST, "mirrors", ["http://127.0.0.1:9/"])
    with pytest.raises(
        DatasetError, match=r"files missing under .*MNIST/raw and the download failed \(Error downloading"
    ):
        load_data(DataConfig("mnist", root=str(tmp_path), download=True))


def test_cifar10_missing_lists_its_batches(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"cifar-10-batches-py .*data_batch_1, .*test_batch, batches\.meta"):
        load_data(DataConfig("cifar10", root=str(tmp_path), download=False))


@pytest.mark.slow
def test_mnist_downloads_from_a_mirror_and_checks_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served = tmp_path / "mirror"
    raw = write_mnist(served, "MNIST", n_train=50, n_val=10, gz=True)
    resources = [(f"{n}.gz", hashlib.md5((raw / f"{n}.gz").read_bytes()).hexdigest()) for n in MNIST_FILES]
    handler = functools.partial(_QuietHandler, directory=str(raw))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(tvd.MNIST, "mirrors", [f"http://127.0.0.1:{server.server_port}/"])
        monkeypatch.setattr(tvd.MNIST, "resources", resources)
        bundle = load_data(DataConfig("mnist", root=str(tmp_path / "data"), download=True))
    finally:
        server.shutdown()
    assert bundle.spec.train_size == 50 and bundle.spec.val_size == 10
    assert (tmp_path / "data" / "MNIST" / "raw" / "train-images-idx3-ubyte").read_bytes() == gzip.decompress(
        (raw / "train-images-idx3-ubyte.gz").read_bytes()
    )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def test_image_folder_reads_a_class_per_sub_folder(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "imgs", classes=("cat", "dog", "fox"), per_class=5, size=20)
    bundle = load_data(
        DataConfig("imagefolder", root=str(tmp_path / "imgs"), image_size=16, channels=3, val_fraction=0.2)
    )
    spec = bundle.spec
    assert (spec.num_classes, spec.in_shape, spec.train_size, spec.val_size) == (3, (3, 16, 16), 12, 3)
    image, label = bundle.train[0]
    assert image.dtype == torch.uint8 and image.shape == (3, 16, 16) and 0 <= label < 3


def test_image_folder_greyscale_has_one_channel(tmp_path: Path) -> None:
    write_image_folder(tmp_path, per_class=2)
    bundle = load_data(DataConfig("imagefolder", root=str(tmp_path), image_size=8, channels=1, val_fraction=0.25))
    assert bundle.train[0][0].shape == (1, 8, 8)


def test_image_folder_errors_name_the_folder(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="data.root='.*nowhere' is not a folder"):
        load_data(DataConfig("imagefolder", root=str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="data=imagefolder: .*class folder"):
        load_data(DataConfig("imagefolder", root=str(tmp_path / "empty")))


def test_synthetic_has_the_requested_shape_and_is_the_same_every_time() -> None:
    cfg = DataConfig("synthetic", shape=[3, 8, 8], num_classes=5, num_samples=40, val_samples=10)
    a, b = load_data(cfg), load_data(cfg)
    assert a.spec.in_shape == (3, 8, 8) and a.spec.num_classes == 5 and a.spec.train_size == 40
    assert torch.equal(a.train.tensors[0], b.train.tensors[0]) and int(a.train.tensors[1].max()) < 5


def test_resident_loader_visits_every_sample_once_per_epoch_in_a_new_order() -> None:
    images = torch.arange(10, dtype=torch.uint8).view(10, 1, 1, 1)
    labels = torch.arange(10)
    loader = ResidentLoader(images, labels, batch_size=4, shuffle=True, drop_last=False, seed=0)
    epochs = []
    for epoch in (1, 2):
        loader.set_epoch(epoch)
        epochs.append([b[1] for b in loader])
    assert len(loader) == 3 and [len(b) for b in epochs[0]] == [4, 4, 2]
    orders = [torch.cat(e).tolist() for e in epochs]
    assert sorted(orders[0]) == list(range(10)) and sorted(orders[1]) == list(range(10))
    assert orders[0] != orders[1]
    for batch_images, batch_labels in loader:
        assert torch.equal(batch_images.view(-1).long(), batch_labels)  # images stay with their labels
    again = ResidentLoader(images, labels, batch_size=4, shuffle=True, drop_last=False, seed=0)
    again.set_epoch(2)
    assert torch.cat([b[1] for b in again]).tolist() == orders[1]  # epoch 2's order, whatever ran before
    again.set_epoch(2, skip=2)
    assert len(again) == 1 and torch.cat([b[1] for b in again]).tolist() == orders[1][8:]


def test_the_epoch_order_depends_on_the_seed_and_the_epoch_alone() -> None:
    order = EpochOrder(100, seed=7, shuffle=True)
    order.set_epoch(3)
    third = list(order)
    torch.manual_seed(123)
    torch.rand(1000)  # other random draws in the process change nothing
    fresh = EpochOrder(100, seed=7, shuffle=True)
    fresh.set_epoch(3)
    assert list(fresh) == third and sorted(third) == list(range(100))
    fresh.set_epoch(4)
    assert list(fresh) != third
    fresh.set_epoch(3, start=40)
    assert len(fresh) == 60 and list(fresh) == third[40:]
    assert list(EpochOrder(5, seed=7, shuffle=False)) == [0, 1, 2, 3, 4]


def test_a_dataloader_skips_batches_in_its_sampler_without_loading_them() -> None:
    loaded: list[int] = []

    class Counting(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            loaded.append(i)
            return torch.zeros(1, 2, 2, dtype=torch.uint8), i

    loader = make_batches(Split(Counting(), train=True), LOADER, Place(torch.device("cpu"), seed=0))
    loader.set_epoch(1)
    whole = torch.cat([labels for _, labels in loader]).tolist()
    loaded.clear()
    loader.set_epoch(1, skip=2)  # batches of 16: only the last 8 samples are left
    assert len(loader) == 1 and torch.cat([labels for _, labels in loader]).tolist() == whole[32:]
    assert sorted(loaded) == sorted(whole[32:])


def test_resident_loader_drop_last_and_no_shuffle() -> None:
    loader = ResidentLoader(
        torch.zeros(10, 1, 1, 1), torch.arange(10), batch_size=4, shuffle=False, drop_last=True, seed=0
    )
    assert len(loader) == 2 and torch.cat([b[1] for b in loader]).tolist() == list(range(8))


def test_make_loader_resident_keeps_the_data_as_tensors_on_the_device() -> None:
    bundle = load_data(DataConfig("synthetic", shape=[1, 4, 4], num_classes=3, num_samples=20, val_samples=5))
    cfg = LoaderConfig(**{**LOADER.__dict__, "resident": True})
    loader = make_batches(Split(bundle.train, train=True), cfg, Place(torch.device("cpu"), seed=1))
    assert isinstance(loader, ResidentLoader) and loader.images.data_ptr() == bundle.train.tensors[0].data_ptr()


def test_make_loader_dataloader_path_honours_the_loader_keys() -> None:
    bundle = load_data(DataConfig("synthetic", shape=[1, 4, 4], num_classes=3, num_samples=20, val_samples=5))
    cfg = LoaderConfig(**{**LOADER.__dict__, "batch_size": 8, "drop_last": True})
    loader = make_batches(Split(bundle.train, train=True), cfg, Place(torch.device("cpu"), seed=1))
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert (loader.batch_size, loader.drop_last, loader.pin_memory, loader.num_workers) == (8, True, False, 0)
    assert len(list(loader)) == 2
    val = make_batches(Split(bundle.val, train=False), cfg, Place(torch.device("cpu"), seed=1))
    assert val.drop_last is False and len(list(val)) == 1


def test_normalize_scales_uint8_pixels_with_mean_and_std() -> None:
    norm = Normalize((0.5,), (0.25,), device=torch.device("cpu"))
    out = norm(torch.tensor([0, 255, 128], dtype=torch.uint8).view(1, 1, 1, 3))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.view(-1), torch.tensor([-2.0, 2.0, (128 / 255 - 0.5) / 0.25]))


def test_make_loader_passes_the_start_method_to_the_dataloader_and_auto_leaves_the_default() -> None:
    bundle = load_data(DataConfig("synthetic", shape=[1, 4, 4], num_classes=3, num_samples=20, val_samples=5))
    cpu = torch.device("cpu")
    spawn = LoaderConfig(**{**LOADER.__dict__, "num_workers": 1, "multiprocessing_context": "spawn"})
    loader = make_batches(Split(bundle.train, train=True), spawn, Place(cpu, seed=1))  # no iteration: no worker starts
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    auto = LoaderConfig(**{**LOADER.__dict__, "num_workers": 1})
    assert make_batches(Split(bundle.train, train=True), auto, Place(cpu, seed=1)).multiprocessing_context is None


def _bundle(name: str, root: Path, monkeypatch: pytest.MonkeyPatch) -> DataBundle:
    """The dataset ``name`` as the pipeline builds it, from files written under ``root`` where it reads files."""
    if name in ("mnist", "fashion_mnist"):
        write_mnist(root, "MNIST" if name == "mnist" else "FashionMNIST", n_train=40, n_val=10)
        return load_data(DataConfig(name, root=str(root), download=False))
    if name == "cifar10":
        md5 = write_cifar10(root, per_batch=4, n_val=4)
        monkeypatch.setattr(
            tvd.CIFAR10, "train_list", [[f"data_batch_{i}", md5[f"data_batch_{i}"]] for i in range(1, 6)]
        )
        monkeypatch.setattr(tvd.CIFAR10, "test_list", [["test_batch", md5["test_batch"]]])
        monkeypatch.setattr(tvd.CIFAR10, "meta", {**tvd.CIFAR10.meta, "md5": md5["batches.meta"]})
        return load_data(DataConfig("cifar10", root=str(root), download=False))
    if name.startswith("imagefolder"):
        write_image_folder(root / "imgs", per_class=3, size=12)
        channels = 1 if name.endswith("grey") else 3
        return load_data(DataConfig("imagefolder", root=str(root / "imgs"), image_size=8, channels=channels))
    if name == "synthetic":
        return load_data(DataConfig("synthetic", shape=[3, 4, 4], num_classes=3, num_samples=20, val_samples=5))
    return load_data(DataConfig("digits", image_size=8, val_fraction=0.2))


@pytest.mark.parametrize(
    "name", ["digits", "synthetic", "mnist", "fashion_mnist", "cifar10", "imagefolder", "imagefolder_grey"]
)
def test_every_dataset_survives_the_pickling_that_spawned_workers_receive_it_by(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under spawn (always on Windows and macOS) each loader worker unpickles the dataset: a lambda, a local class
    or an open file in it fails there, and only there."""
    bundle = _bundle(name, tmp_path, monkeypatch)
    for split in (bundle.train, bundle.val):
        back = pickle.loads(pickle.dumps(split))
        assert type(back) is type(split) and len(back) == len(split) > 0
        for i in (0, len(split) - 1):
            (image, label), (image_back, label_back) = split[i], back[i]
            assert image.dtype == torch.uint8 and image.shape == bundle.spec.in_shape
            assert torch.equal(image_back, image) and int(label_back) == int(label)


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (
            DataConfig("digits", image_size=8, val_fraction=0.0001),
            ["only 1 validation sample", "steps of 100% (1/1)", "data.val_fraction >= 0.056"],
        ),
        (
            DataConfig("synthetic", shape=[1, 4, 4], num_samples=200, val_samples=40),
            ["only 40 validation samples", "steps of 2.5% (1/40)", "data.val_samples >= 100"],
        ),
    ],
    ids=["val_fraction", "val_samples"],
)
def test_too_few_validation_samples_are_warned_about_with_the_accuracy_resolution(
    caplog: pytest.LogCaptureFixture, config: DataConfig, words: list[str]
) -> None:
    with caplog.at_level("WARNING", logger="pipeline.data.sources"):
        load_data(config)
    (warning,) = [r.getMessage() for r in caplog.records if "validation sample" in r.getMessage()]
    for word in words:
        assert word in warning


def test_enough_validation_samples_are_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="pipeline.data.sources"):
        load_data(DataConfig("digits", image_size=8, val_fraction=0.2))
    assert not [r for r in caplog.records if "validation sample" in r.getMessage()]


def test_the_digits_are_read_from_scikit_learns_file_as_load_digits_gives_them_without_importing_it() -> None:
    """The default run skips ``sklearn.datasets``'s import (1-3 s) and reads the CSV it ships: the same arrays."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    images, labels = sources.digits_arrays()
    reference = load_digits()
    assert images.shape == (1797, 8, 8) and np.array_equal(images, reference.images)
    assert np.array_equal(labels, reference.target) and labels.dtype.kind == "i"
    probe = "import sys; from pipeline.data import sources; sources.digits_arrays(); print('sklearn' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"


def test_the_datasets_own_order_gives_each_rank_a_contiguous_share_of_whole_batches() -> None:
    """loader.shuffle=false: a corpus laid out in batch order stays a stream of the same batches on each rank."""
    from pipeline.data.loaders import EpochOrder, Shard

    one = EpochOrder(23, seed=1, shuffle=False, shard=Shard(contiguous=True, unit=4))
    assert one.indices().tolist() == list(range(23))
    ranks = [
        EpochOrder(23, seed=1, shuffle=False, shard=Shard(rank=r, world=2, contiguous=True, unit=4)) for r in (0, 1)
    ]
    assert [r.indices().tolist() for r in ranks] == [list(range(12)), [*range(12, 23), 0]]  # 3 batches each, padded
    assert [len(r) for r in ranks] == [12, 12]
    val = [
        EpochOrder(23, seed=1, shuffle=False, shard=Shard(rank=r, world=2, pad=False, contiguous=True, unit=4))
        for r in (0, 1)
    ]
    assert [v.indices().tolist() for v in val] == [list(range(12)), list(range(12, 23))] and len(val[1]) == 11
