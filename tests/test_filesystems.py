"""No SQLite store and no run.lock where the filesystem's locks cannot be trusted (a faked mount table)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import run_main
from pipeline.config import RunConfig
from pipeline.engine.checkpointing.checkpoint import RunLock, check_dir
from pipeline.record import filesystems
from pipeline.record.filesystems import NetworkFilesystem, mount_of
from pipeline.record.reachability import check_reachable
from pipeline.record.store import TrackingUnavailable

MakeCfg = Callable[..., RunConfig]


def fake_mounts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *lines: tuple[str, str, str]) -> None:
    """A mount table of ``(mount point, fstype, options)`` lines after an ext4 root, read instead of the real one."""
    rows = ["22 1 254:0 / / rw,relatime - ext4 /dev/vda rw"]
    for i, (point, fstype, options) in enumerate(lines):
        escaped = point.replace(" ", "\\040")  # as the kernel writes a space
        rows.append(f"{30 + i} 22 0:{50 + i} / {escaped} rw,relatime - {fstype} src{i} {options}")
    table = tmp_path / "mountinfo"
    table.write_text("\n".join(rows) + "\n")
    monkeypatch.setattr(filesystems, "MOUNTINFO", table)


def test_the_longest_mount_point_holding_the_path_decides_and_a_space_in_it_is_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    here = os.path.realpath(tmp_path)
    fake_mounts(
        monkeypatch,
        tmp_path,
        (f"{here}/shared", "nfs4", "rw,vers=4.2"),
        (f"{here}/shared/scratch", "ext4", "rw"),
        (f"{here}/my disk", "lustre", "rw,flock"),
        (f"{here}/shared", "xfs", "rw"),  # mounted over the first: the last one wins
    )
    assert mount_of(tmp_path / "shared" / "mlflow.db").fstype == "xfs"
    assert mount_of(tmp_path / "shared" / "scratch" / "x" / "y").fstype == "ext4"
    assert mount_of(tmp_path / "sharedness").point == "/"  # a prefix of the name is no folder of it
    assert mount_of(tmp_path / "my disk" / "a.db").fstype == "lustre"


@pytest.mark.parametrize("fstype", ["nfs4", "nfs", "lustre", "gpfs", "cifs", "fuse.sshfs", "9p", "beegfs"])
def test_an_sqlite_store_on_a_network_filesystem_is_refused_in_one_line_naming_it_and_the_team_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fstype: str
) -> None:
    shared = Path(os.path.realpath(tmp_path)) / "shared"
    shared.mkdir()
    fake_mounts(monkeypatch, tmp_path, (str(shared), fstype, "rw"))
    with pytest.raises(TrackingUnavailable) as caught:
        check_reachable(f"sqlite:///{shared / 'runs' / 'mlflow.db'}")
    message = str(caught.value)
    assert "\n" not in message
    assert f"({fstype}: src0 mounted at {shared})" in message
    assert "SQLite's file locking is unreliable" in message and "tracking.uri=http://host:5000" in message


@pytest.mark.parametrize("fstype", ["ext4", "xfs", "tmpfs", "overlay", "btrfs", "zfs"])
def test_an_sqlite_store_on_a_local_filesystem_is_accepted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fstype: str
) -> None:
    fake_mounts(monkeypatch, tmp_path, (os.path.realpath(tmp_path), fstype, "rw"))
    check_reachable(f"sqlite:///{tmp_path / 'mlflow.db'}")
    check_dir(_checkpoint(tmp_path))
    RunLock(tmp_path / "checkpoints" / "run").acquire().release()


def test_a_training_run_with_its_store_on_nfs_fails_before_anything_is_recorded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, make_cfg: MakeCfg
) -> None:
    from pipeline.train import train

    fake_mounts(monkeypatch, tmp_path, (os.path.realpath(tmp_path), "nfs4", "rw"))
    with pytest.raises(TrackingUnavailable, match=r"is on NFS \(nfs4: "):
        train(make_cfg(), echo=False)
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize(
    ("fstype", "options", "why"),
    [
        ("nfs", "rw,vers=3,nolock,local_lock=all", "mounted nolock"),
        ("nfs4", "rw,vers=4.2,local_lock=flock", "mounted local_lock=flock"),
        ("lustre", "rw,localflock", "mounted localflock"),
        ("lustre", "rw,lazystatfs", "mounted without -o flock"),
        ("beegfs", "rw,cfgFile=/etc/beegfs/beegfs-client.conf", "unless every client sets tuneUseGlobalFileLocks"),
        ("fuse.sshfs", "rw,user_id=0", "which shares no locks between machines"),
    ],
)
def test_a_run_lock_whose_locks_stay_on_one_machine_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fstype: str, options: str, why: str
) -> None:
    fake_mounts(monkeypatch, tmp_path, (os.path.realpath(tmp_path), fstype, options))
    for take in (lambda: check_dir(_checkpoint(tmp_path)), lambda: RunLock(tmp_path / "checkpoints" / "r").acquire()):
        with pytest.raises(NetworkFilesystem) as caught:
            take()
        message = str(caught.value)
        assert "\n" not in message and why in message and f"mounted at {os.path.realpath(tmp_path)}" in message
        assert "put checkpoint.dir on a local disk" in message
    assert not (tmp_path / "checkpoints" / "r" / "run.lock").exists()


@pytest.mark.parametrize(
    ("fstype", "options"),
    [("nfs4", "rw,vers=4.2,local_lock=none"), ("lustre", "rw,flock"), ("gpfs", "rw"), ("ceph", "rw,name=me")],
)
def test_checkpoints_on_a_shared_filesystem_whose_locks_every_machine_sees_are_accepted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fstype: str, options: str
) -> None:
    fake_mounts(monkeypatch, tmp_path, (os.path.realpath(tmp_path), fstype, options))
    check_dir(_checkpoint(tmp_path))
    RunLock(tmp_path / "checkpoints" / "r").acquire().release()


def test_the_slurm_launcher_is_refused_an_sqlite_store_in_one_line_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bin").mkdir()  # a login node: SLURM's commands are there (never called before the refusal)
    for command in ("srun", "sbatch"):
        (tmp_path / "bin" / command).write_text("#!/bin/sh\nexit 1\n")
        (tmp_path / "bin" / command).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert run_main(monkeypatch, "-m", "hydra/launcher=slurm", "device=cpu", "loader.batch_size=16,32") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: hydra/launcher=slurm with tracking.uri=sqlite:///mlflow.db: the compute nodes")
    assert "tracking.uri=http://host:5000" in err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "multirun").exists()


def test_the_slurm_store_rule_concerns_sqlite_under_the_slurm_launcher_only() -> None:
    slurm = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    local = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
    assert filesystems.slurm_store_refusal(slurm, "sqlite:////shared/mlflow.db") is not None
    assert filesystems.slurm_store_refusal(slurm, "http://login1:5000") is None
    assert filesystems.slurm_store_refusal(slurm, "postgresql://db/mlflow") is None
    assert filesystems.slurm_store_refusal(local, "sqlite:///mlflow.db") is None


def _checkpoint(tmp_path: Path) -> object:
    from pipeline.config import load

    return load(["device=cpu", f"checkpoint.dir={tmp_path / 'checkpoints'}"]).checkpoint
