"""Which filesystem a path is on, and where SQLite or ``run.lock`` cannot be trusted there.

SQLite's own documentation warns that its file locking is broken on many network filesystems (NFS, Lustre,
SMB...) and that two machines writing one database there can corrupt it; MLflow's SQLite store is such a
database. ``sqlite_refusal`` says why a ``sqlite:///`` store on a network filesystem is refused, and
``slurm_store_refusal`` why the SLURM launcher is refused any SQLite store (a node-local file is not shared by
the compute nodes, and a shared one is on a network filesystem): the remedy is the team tracking server.

``run.lock`` (``pipeline.engine.checkpointing.checkpoint.RunLock``, an ``flock()`` taken by ``filelock``) keeps two
processes from training the same run. It is only as good as the filesystem's locks: NFS mounted ``nolock`` (or
``local_lock=all|flock``), Lustre without ``-o flock`` (``localflock`` or none), BeeGFS (``flock()`` is node-local
unless the client sets ``tuneUseGlobalFileLocks``, which the mount table does not show), SMB mounted ``nobrl``, and
filesystems with no locks shared between clients (sshfs, 9p, AFS, object stores) keep a lock on the one machine
that took it. ``lock_refusal`` refuses the lock there. The checkpoints themselves are fine on any of them: they are
written to a temporary file and renamed, which is atomic within one folder on all of these filesystems, so a shared
``checkpoint.dir`` on NFS with locking, Lustre ``-o flock``, GPFS, CephFS or GlusterFS is accepted (it is what lets
a stopped SLURM job resume on another node).

The mount table is Linux's ``/proc/self/mountinfo``: the mount whose mount point is the longest prefix of the
resolved path (the last one mounted when several share a mount point). Where there is none (macOS, Windows) every
path is taken as local. 9p is counted as a network filesystem: it is what WSL2 mounts Windows drives with
(``/mnt/c``) and what virtual machines share host folders with, and SQLite's locks do not cross it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.common.errors import PipelineError

MOUNTINFO = Path("/proc/self/mountinfo")  # tests point this at a table of their own

# fstype as the mount table names it -> what a message calls it
NETWORK = {
    "nfs": "NFS",
    "nfs4": "NFS",
    "lustre": "Lustre",
    "gpfs": "GPFS (IBM Storage Scale)",
    "cifs": "SMB/CIFS",
    "smb3": "SMB/CIFS",
    "smbfs": "SMB/CIFS",
    "ceph": "CephFS",
    "fuse.ceph-fuse": "CephFS",
    "beegfs": "BeeGFS",
    "glusterfs": "GlusterFS",
    "fuse.glusterfs": "GlusterFS",
    "fuse.sshfs": "sshfs",
    "9p": "9p",
    "afs": "AFS",
    "fuse.s3fs": "s3fs",
    "fuse.gcsfuse": "gcsfuse",
}
# where flock() is seen by every client, unless the mount options below say otherwise
SHARED_LOCKS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "fuse.ceph-fuse"})
SHARED_LOCKS |= {"glusterfs", "fuse.glusterfs"}
TEAM_SERVER = "a team tracking server (tracking.uri=http://host:5000; see docs/team-server.md)"

_ESCAPE = re.compile(r"\\([0-7]{3})")  # the kernel writes a space in a mount point as \040


class NetworkFilesystem(PipelineError):
    """A file that needs locks every machine sees (``run.lock``) is on a filesystem whose locks stay local."""


@dataclass(frozen=True)
class Mount:
    """One line of the mount table."""

    point: str  # where it is mounted, e.g. /shared
    fstype: str  # e.g. nfs4, fuse.sshfs, ext4
    source: str  # e.g. server:/export
    options: frozenset[str]  # the mount's and the superblock's options: rw, nolock, local_lock=all, flock...

    @property
    def network(self) -> bool:
        return self.fstype in NETWORK

    def describe(self) -> str:
        """``NFS (nfs4: server:/export mounted at /shared)``."""
        return f"{NETWORK.get(self.fstype, self.fstype)} ({self.fstype}: {self.source} mounted at {self.point})"


def mounts(table: Path | None = None) -> list[Mount]:
    """The mount table, in mounting order; empty where it cannot be read (not Linux)."""
    try:
        lines = (table or MOUNTINFO).read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        # id parent major:minor root point options [optional...] - fstype source superoptions
        mine, sep, theirs = line.partition(" - ")
        fields, rest = mine.split(), theirs.split()
        if not sep or len(fields) < 6 or len(rest) < 2:
            continue
        options = fields[5].split(",") + (rest[2].split(",") if len(rest) > 2 else [])
        found.append(Mount(_unescape(fields[4]), rest[0], _unescape(rest[1]), frozenset(options)))
    return found


def mount_of(path: Path, *, table: Path | None = None) -> Mount | None:
    """The mount ``path`` is on (the path need not exist yet: its nearest existing folder decides); None when the
    mount table cannot be read."""
    resolved = os.path.realpath(path)  # symbolic links followed: /scratch -> /lustre/scratch is Lustre
    best: Mount | None = None
    for mount in mounts(table):
        point = mount.point.rstrip("/") + "/"
        if (resolved + "/").startswith(point) and (best is None or len(mount.point) >= len(best.point)):
            best = mount
    return best


def network_mount(path: Path, *, table: Path | None = None) -> Mount | None:
    """The mount ``path`` is on when it is a network filesystem, else None."""
    mount = mount_of(path, table=table)
    return mount if mount is not None and mount.network else None


def sqlite_refusal(path: Path, *, table: Path | None = None) -> str | None:
    """Why an SQLite database at ``path`` is refused (it is on a network filesystem), or None when it is not."""
    mount = network_mount(path, table=table)
    if mount is None:
        return None
    return (
        f"{path} is on {mount.describe()}, where SQLite's file locking is unreliable and two machines writing the "
        f"store can corrupt it: record to {TEAM_SERVER}, or keep the SQLite file on a local disk"
    )


def check_lock_folder(folder: Path, *, setting: str = "") -> None:
    """Refuse ``run.lock`` in ``folder`` where its lock would be seen by this machine alone.

    Raises:
        NetworkFilesystem: one line naming the filesystem, its mount point and the mount option at fault.
    """
    refused = lock_refusal(folder)
    if refused:
        raise NetworkFilesystem(f"{setting}: {refused}" if setting else refused)


def lock_refusal(folder: Path, *, table: Path | None = None) -> str | None:
    """Why ``run.lock`` in ``folder`` is refused (its lock would only be seen by this machine), or None."""
    mount = network_mount(folder, table=table)
    if mount is None:
        return None
    why = _local_locks(mount)
    if why is None:
        return None
    return (
        f"{folder} is on {mount.describe()}, {why}, so run.lock there cannot keep a process on another machine "
        f"from training the same run: put checkpoint.dir on a local disk, or on a filesystem whose locks every "
        f"machine sees (NFS without nolock, Lustre mounted -o flock, GPFS, CephFS)"
    )


class SqliteUnderSlurm(PipelineError):
    """``hydra/launcher=slurm`` with an SQLite tracking store."""


def check_slurm_store(launcher_target: str, uri: str) -> None:
    """Refuse an SQLite store to ``hydra/launcher=slurm`` before the sweep opens its parent run.

    Raises:
        SqliteUnderSlurm: one line pointing to the team tracking server.
    """
    refused = slurm_store_refusal(launcher_target, uri)
    if refused:
        raise SqliteUnderSlurm(refused)


def slurm_store_refusal(launcher_target: str, uri: str) -> str | None:
    """Why ``hydra/launcher=slurm`` is refused the store ``uri`` (any SQLite file), or None (other launchers, other
    stores): a node-local file is not seen by the other compute nodes, and a shared one is on a network
    filesystem."""
    if not launcher_target.endswith(".SlurmLauncher") or not uri.lower().startswith("sqlite:"):
        return None
    return (
        f"hydra/launcher=slurm with tracking.uri={uri}: the compute nodes cannot share one SQLite file safely (a "
        f"local one is on one node only, a shared one is on a network filesystem where SQLite's locks fail): record "
        f"to {TEAM_SERVER}"
    )


def _local_locks(mount: Mount) -> str | None:
    """Why ``flock()`` on ``mount`` is seen by this machine alone, or None when every client sees it."""
    options = mount.options
    if mount.fstype in ("nfs", "nfs4"):
        local = [o for o in ("nolock", "local_lock=all", "local_lock=flock") if o in options]
        return f"mounted {local[0]}: its locks stay on this machine" if local else None
    if mount.fstype == "lustre":
        if "flock" in options:
            return None
        how = "localflock" if "localflock" in options else "without -o flock"
        return f"mounted {how}: its locks stay on this machine"
    if mount.fstype in ("cifs", "smb3", "smbfs") and "nobrl" in options:
        return "mounted nobrl: its locks stay on this machine"
    if mount.fstype in SHARED_LOCKS:
        return None
    if mount.fstype == "beegfs":
        return "whose flock() locks stay on the node unless every client sets tuneUseGlobalFileLocks"
    return "which shares no locks between machines"


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)
