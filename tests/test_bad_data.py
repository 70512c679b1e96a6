"""Bad data stops at load time: one line naming the file (or key) and the fix, exit 2, no MLflow run.

Each case writes a good dataset with ``files.py``, damages one thing, and runs the real entry point.
"""

from __future__ import annotations

import hashlib
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.datasets as tvd

from files import (
    mnist_arrays,
    truncate,
    write_cifar10,
    write_idx,
    write_image,
    write_image_folder,
    write_mnist,
    write_pickle,
    write_random_bytes,
)
from helpers import run_main
from pipeline.common.errors import DatasetError
from pipeline.config import DataConfig, LoaderConfig
from pipeline.data import Place, Split, load_data, make_batches


def one_line_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run ``python -m pipeline device=cpu ARGS``; assert exit 2, one ``error:`` line and no MLflow store."""
    assert run_main(monkeypatch, "device=cpu", "trainer.max_steps=2", *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert not Path("mlflow.db").exists() and not Path("mlruns").exists()  # stopped before any run was opened
    return err


# --- image folders -----------------------------------------------------------------------------

# Each writes a folder under ``base`` and returns (data.root, the path the message must name, words it must hold).
FolderCase = Callable[[Path], tuple[Path, Path, list[str]]]


def _text_named_like_an_image(base: Path) -> tuple[Path, Path, list[str]]:
    root = write_image_folder(base)
    (bad := root / "dog" / "notes.png").write_text("not an image")
    return root, bad, ["cannot be read as an image"]


def _truncated_png(base: Path) -> tuple[Path, Path, list[str]]:
    root = write_image_folder(base)
    return root, truncate(root / "fox" / "3.png"), ["cannot be read as an image", "delete or replace it"]


def _single_image(base: Path) -> tuple[Path, Path, list[str]]:
    root = write_image_folder(base, classes=("cat",), per_class=1)
    return root, root, ["1 image", "at least 2"]


def _one_class(base: Path) -> tuple[Path, Path, list[str]]:
    root = write_image_folder(base, classes=("cat",), per_class=6)
    return root, root, ["one class", "cat/", "at least 2 classes"]


def _empty_class_folder(base: Path) -> tuple[Path, Path, list[str]]:
    root = write_image_folder(base)
    (root / "zebra").mkdir()
    return root, root / "zebra", ["holds no images"]


def _class_folder_without_images(base: Path) -> tuple[Path, Path, list[str]]:
    root = write_image_folder(base)
    (root / "zebra").mkdir()
    (root / "zebra" / "notes.txt").write_text("a text file is not an image")
    return root, root / "zebra", ["holds no images", ".png"]


@pytest.mark.parametrize(
    "case",
    [
        _text_named_like_an_image,
        _truncated_png,
        _single_image,
        _one_class,
        _empty_class_folder,
        _class_folder_without_images,
    ],
    ids=lambda case: case.__name__.strip("_"),
)
def test_a_bad_image_folder_stops_at_load_time_naming_the_file_or_folder(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, case: FolderCase
) -> None:
    root, named, words = case(tmp_path / "imgs")
    err = one_line_error(monkeypatch, capsys, "data=imagefolder", f"data.root={root}", "data.image_size=8")
    assert err.startswith("error: data=imagefolder: ") and str(named) in err
    for word in words:
        assert word in err


def test_a_truncated_jpeg_found_by_the_resident_decoding_pass_stops_before_any_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    root = write_image_folder(tmp_path / "imgs")
    bad = truncate(write_image(root / "cat" / "big.jpg", size=64), keep=0.9)  # its header passes verify()
    err = one_line_error(monkeypatch, capsys, "data=imagefolder", f"data.root={root}", "loader=resident")
    assert err.startswith(f"error: data=imagefolder: {bad}: cannot be decoded as an image (")


def test_an_image_that_fails_to_decode_in_a_loader_worker_is_one_line_naming_it(tmp_path: Path) -> None:
    root = write_image_folder(tmp_path, per_class=2)
    bad = truncate(write_image(root / "cat" / "big.jpg", size=64), keep=0.9)
    bundle = load_data(DataConfig("imagefolder", root=str(root), image_size=8, channels=3, val_fraction=0.1))
    cfg = LoaderConfig(
        batch_size=64,
        num_workers=1,
        pin_memory=False,
        persistent_workers=False,
        prefetch_factor=2,
        drop_last=False,
        resident=False,
    )
    everything = bundle.train.dataset  # the whole folder, whichever split the bad file fell into
    loader = make_batches(Split(everything, train=False), cfg, Place(torch.device("cpu"), seed=0))
    loader.set_epoch(1)
    with pytest.raises(DatasetError) as info:
        list(loader)
    message = str(info.value)
    assert message.startswith(f"data=imagefolder: {bad}: cannot be decoded as an image (") and "\n" not in message


def test_image_folder_datasets_survive_pickling_for_worker_processes(tmp_path: Path) -> None:
    bundle = load_data(DataConfig("imagefolder", root=str(write_image_folder(tmp_path)), image_size=8, channels=1))
    copy = pickle.loads(pickle.dumps(bundle.train))
    assert torch.equal(copy[0][0], bundle.train[0][0]) and copy[0][1] == bundle.train[0][1]


# --- train/val splits --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["data=digits", "data.val_fraction=0.9999"], ["data.val_fraction=0.9999", "1797 samples", "<= 0.9994"]),
        (
            ["data=imagefolder", "data.root={root}", "data.val_fraction=0.99"],
            ["data.val_fraction=0.99", "18 samples", "<= 0.9444"],
        ),
    ],
    ids=["digits", "imagefolder"],
)
def test_a_val_fraction_that_leaves_no_training_samples_is_refused_with_what_would_work(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    args: list[str],
    words: list[str],
) -> None:
    root = write_image_folder(tmp_path / "imgs")  # 3 classes x 6 images
    err = one_line_error(monkeypatch, capsys, *(a.format(root=root) for a in args))
    for word in words:
        assert word in err


def test_the_smallest_val_fraction_still_holds_out_one_sample() -> None:
    bundle = load_data(DataConfig("digits", image_size=8, val_fraction=0.0001))
    assert (bundle.spec.train_size, bundle.spec.val_size) == (1796, 1)


# --- MNIST / Fashion-MNIST idx files -------------------------------------------------------------

IMAGES, LABELS = "train-images-idx3-ubyte", "train-labels-idx1-ubyte"
VAL_IMAGES = "t10k-images-idx3-ubyte"

# Each damages the files in ``raw`` (256 train / 64 val samples) and returns the file the message must name.


def _bad_magic(raw: Path) -> Path:
    return write_idx(raw / IMAGES, np.zeros((4, 28, 28)), magic=0x00000903)


def _labels_where_images_belong(raw: Path) -> Path:
    return write_idx(raw / IMAGES, np.zeros(256))


def _random_bytes(raw: Path) -> Path:
    return write_random_bytes(raw / VAL_IMAGES)


def _zero_bytes(raw: Path) -> Path:
    return write_random_bytes(raw / LABELS, size=0)


def _truncated(raw: Path) -> Path:
    return truncate(raw / IMAGES)


def _zero_samples(raw: Path) -> Path:
    write_idx(raw / LABELS, np.zeros(0))
    return write_idx(raw / IMAGES, np.zeros((0, 28, 28)))


def _fewer_labels_than_images(raw: Path) -> Path:
    return write_idx(raw / LABELS, np.zeros(200))


def _label_out_of_range(raw: Path) -> Path:
    return write_idx(raw / LABELS, np.where(np.arange(256) == 7, 12, 3))


def _val_images_of_another_size(raw: Path) -> Path:
    return write_idx(raw / VAL_IMAGES, np.zeros((64, 32, 32)))


def _truncated_gzip(raw: Path) -> Path:
    (raw / IMAGES).unlink()
    return truncate(write_idx(raw / f"{IMAGES}.gz", mnist_arrays(256, 64)[True][0]))


MNIST_CASES: list[tuple[Callable[[Path], Path], list[str]]] = [
    (_bad_magic, ["starts with 0x00000903", "0x00000803"]),
    (_labels_where_images_belong, ["0x00000801", "an idx labels file"]),
    (_random_bytes, ["not an MNIST-format images file"]),
    (_zero_bytes, ["is empty"]),
    (_truncated, ["is truncated", "dims [256, 28, 28]"]),
    (_zero_samples, ["0 samples"]),
    (_fewer_labels_than_images, ["200 labels", "256 images"]),
    (_label_out_of_range, ["label 12 (sample 7)", "0..9"]),
    (_val_images_of_another_size, ["32x32", "28x28"]),
    (_truncated_gzip, ["not a complete gzip file"]),
]


@pytest.mark.parametrize(
    ("name", "damage", "words"),
    [pytest.param("mnist", damage, words, id=damage.__name__.strip("_")) for damage, words in MNIST_CASES]
    + [
        pytest.param("fashion_mnist", damage, words, id=f"fashion_mnist-{damage.__name__.strip('_')}")
        for damage, words in MNIST_CASES
        if damage in (_bad_magic, _label_out_of_range)
    ],
)
def test_a_bad_mnist_file_stops_at_load_time_naming_it(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    name: str,
    damage: Callable[[Path], Path],
    words: list[str],
) -> None:
    raw = write_mnist(tmp_path / "data", "MNIST" if name == "mnist" else "FashionMNIST")
    bad = damage(raw)
    err = one_line_error(monkeypatch, capsys, f"data={name}", f"data.root={tmp_path / 'data'}", "data.download=false")
    assert err.startswith(f"error: data={name}: {bad}: ") and "files missing" not in err
    for word in words:
        assert word in err


def test_a_damaged_mnist_file_is_reported_not_downloaded_over(tmp_path: Path) -> None:
    raw = write_mnist(tmp_path)
    truncate(raw / IMAGES)
    with pytest.raises(DatasetError, match=rf"{re.escape(str(raw / IMAGES))}: .*truncated.*delete it") as info:
        load_data(DataConfig("mnist", root=str(tmp_path), download=True))  # present: no download is tried
    assert "files missing" not in str(info.value)


def test_gzipped_mnist_files_load_like_plain_ones(tmp_path: Path) -> None:
    write_mnist(tmp_path, gz=True, n_train=100, n_val=30)
    bundle = load_data(DataConfig("mnist", root=str(tmp_path), download=False))
    images, labels = mnist_arrays(100, 30)[True]
    assert torch.equal(bundle.train.tensors[0][:, 0], torch.from_numpy(images))
    assert torch.equal(bundle.train.tensors[1], torch.from_numpy(labels).long())
    assert bundle.spec.val_size == 30


@pytest.mark.parametrize(
    ("name", "holder"), [("mnist", "MNIST/"), ("fashion_mnist", "FashionMNIST/"), ("cifar10", "cifar-10-batches-py/")]
)
def test_missing_files_point_data_root_at_the_folder_that_holds_the_dataset_folder(
    tmp_path: Path, name: str, holder: str
) -> None:
    with pytest.raises(DatasetError) as info:
        load_data(DataConfig(name, root=str(tmp_path), download=False))
    message = str(info.value)
    assert f"point data.root at the folder that holds {holder})" in message and "holds raw/" not in message


def test_data_root_pointing_at_the_files_themselves_says_which_root_to_use(tmp_path: Path) -> None:
    raw = write_mnist(tmp_path / "data")
    hint = f"found them in {raw}: use data.root={tmp_path / 'data'}"
    with pytest.raises(DatasetError, match=rf"{re.escape(hint)}$"):
        load_data(DataConfig("mnist", root=str(raw), download=False))


# --- CIFAR-10 pickles -----------------------------------------------------------------------------


@pytest.fixture
def cifar_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Tiny CIFAR-10 batches in ``tmp_path/data``, with torchvision's checksums set to theirs."""
    root = tmp_path / "data"
    md5 = write_cifar10(root, per_batch=8, n_val=6)
    monkeypatch.setattr(tvd.CIFAR10, "train_list", [[f"data_batch_{i}", md5[f"data_batch_{i}"]] for i in range(1, 6)])
    monkeypatch.setattr(tvd.CIFAR10, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(tvd.CIFAR10, "meta", {**tvd.CIFAR10.meta, "md5": md5["batches.meta"]})
    return root


def _batch(n: int = 8, **changes: object) -> dict[str, object]:
    batch = {"data": np.zeros((n, 3072), np.uint8), "labels": [1] * n, **changes}
    return {k: v for k, v in batch.items() if v is not None}


CIFAR_CASES: dict[str, tuple[str, Callable[[Path], object], list[str]]] = {
    "truncated": ("data_batch_3", truncate, ["cannot be unpickled", "truncated"]),
    "zero bytes": ("data_batch_1", lambda p: write_random_bytes(p, size=0), ["cannot be unpickled"]),
    "not a pickle": ("test_batch", write_random_bytes, ["cannot be unpickled"]),
    "no data key": ("data_batch_2", lambda p: write_pickle(p, _batch(data=None)), ["no 'data'"]),
    "no labels key": ("test_batch", lambda p: write_pickle(p, _batch(labels=None)), ["no 'labels'"]),
    "pixels of another shape": (
        "data_batch_5",
        lambda p: write_pickle(p, _batch(data=np.zeros((8, 100), np.uint8))),
        ["(8, 100)", "3072"],
    ),
    "fewer labels than images": ("data_batch_4", lambda p: write_pickle(p, _batch(labels=[1] * 5)), ["5 labels"]),
    "labels out of range": ("test_batch", lambda p: write_pickle(p, _batch(labels=[10] * 8)), ["label 10", "0..9"]),
    "meta without class names": ("batches.meta", lambda p: write_pickle(p, {"names": []}), ["no 'label_names'"]),
    "another file's checksum": ("data_batch_1", lambda p: write_pickle(p, _batch()), ["checksum"]),
}


def _trust(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """Make ``path``'s present bytes the published ones, so the checks behind the checksum see it."""
    md5 = hashlib.md5(path.read_bytes()).hexdigest()
    cls = tvd.CIFAR10
    if path.name == cls.meta["filename"]:
        monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": md5})
    for attr in ("train_list", "test_list"):
        files = [[f, md5 if f == path.name else m] for f, m in getattr(cls, attr)]
        monkeypatch.setattr(cls, attr, files)


@pytest.mark.parametrize("case", CIFAR_CASES, ids=str)
def test_a_bad_cifar10_file_stops_at_load_time_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cifar_root: Path, case: str
) -> None:
    file, damage, words = CIFAR_CASES[case]
    bad = cifar_root / "cifar-10-batches-py" / file
    damage(bad)
    if case != "another file's checksum":  # the checksum is checked first: these cases pass it to reach the others
        _trust(monkeypatch, bad)
    err = one_line_error(monkeypatch, capsys, "data=cifar10", f"data.root={cifar_root}", "data.download=false")
    assert err.startswith(f"error: data=cifar10: {bad}: ") and "files missing" not in err
    for word in words:
        assert word in err


class _WritesAMarker:
    """Unpickling this opens (so creates) ``marker``: code a crafted dataset file runs if it is unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.marker), "w")


@pytest.mark.parametrize("file", ["batches.meta", "data_batch_2", "test_batch"])
def test_a_crafted_cifar10_pickle_is_refused_by_its_checksum_before_it_is_unpickled(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cifar_root: Path, tmp_path: Path, file: str
) -> None:
    marker = tmp_path / "ran"
    bad = write_pickle(cifar_root / "cifar-10-batches-py" / file, {"data": _WritesAMarker(marker), "label_names": []})
    err = one_line_error(monkeypatch, capsys, "data=cifar10", f"data.root={cifar_root}", "data.download=false")
    assert err.startswith(f"error: data=cifar10: {bad}: its checksum (md5 ") and "is not the published" in err
    assert not marker.exists()  # refused before unpickling: the file's code never ran
