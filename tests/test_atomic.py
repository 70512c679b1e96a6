"""The one atomic writer: a failed write leaves the old file and no temporary file; the rename is made durable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.common import atomic
from pipeline.common.atomic import UnwritableFolder, write_atomic, write_text_atomic


def test_a_file_is_replaced_whole_and_its_folder_made(tmp_path: Path) -> None:
    path = tmp_path / "new" / "jobs" / "1.json"
    assert write_text_atomic(path, "one\n") == path and path.read_text() == "one\n"
    write_text_atomic(path, "two\n")
    assert path.read_text() == "two\n" and sorted(p.name for p in path.parent.iterdir()) == ["1.json"]


def test_a_write_that_fails_halfway_leaves_the_old_file_and_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "outbox.jsonl"
    write_text_atomic(path, "old\n")

    def half(f: object) -> None:
        f.write(b"new, half of it")  # type: ignore[attr-defined]
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, half)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["outbox.jsonl"]


def test_the_file_and_then_its_folder_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append("folder" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_text_atomic(tmp_path / "a.json", "{}\n")
    assert synced == ["file", "folder"]


def test_a_folder_that_refuses_fsync_still_gets_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fsync(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    assert write_text_atomic(tmp_path / "a.json", "{}\n").read_text() == "{}\n"


def test_a_folder_that_cannot_be_made_is_said_before_anything_is_written(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(UnwritableFolder) as raised:
        write_text_atomic(tmp_path / "file" / "x.json", "{}")
    assert raised.value.filename == str(tmp_path / "file") and raised.value.strerror
