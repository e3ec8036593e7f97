"""Is the store folder on a network filesystem? (statfs f_type, through ctypes)

SQLite's WAL mode keeps its index in shared memory (the `-shm` file, mmap'ed), so every
process using the database must be on one host: WAL on NFS, Lustre, GPFS, ... is how a
store is torn when two login nodes open it. The store asks this module once per open
and uses the rollback journal (`journal_mode=DELETE`) wherever the folder is remote.

The magic numbers are the kernel's (include/uapi/linux/magic.h: NFS, CIFS, SMB2, 9p,
FUSE, Ceph) and the out-of-tree filesystems' own headers (Lustre LL_SUPER_MAGIC, GPFS,
BeeGFS alias FhGFS); coreutils' stat(1) lists the same values as "remote". FUSE counts
as network: sshfs, s3fs and most FUSE mounts a home is served by are.

A site may declare the answer (`[store] filesystem = "network" | "local" | "auto"`),
for a filesystem not listed here or a container that hides the real mount.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

NETWORK_MAGICS: dict[int, str] = {
    0x6969: "nfs",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0x19830326: "beegfs",
    0x00C36400: "cephfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x01021997: "9p",
    0x65735546: "fuse",
}
DECLARED = ("auto", "network", "local")

# struct statfs is larger than this on every Linux ABI; f_type is its first member (a
# long: __fsword_t), which is all we read.
_STATFS_BUF_BYTES = 256


@dataclass(frozen=True)
class FsInfo:
    magic: int | None  # None: declared by the site, not asked
    name: str  # "nfs", ..., or "local", or the site's declaration
    network: bool


def statfs_magic(path: str | os.PathLike[str]) -> int:
    """statfs(2)'s f_type for `path` (OSError with errno on failure)."""
    # The interpreter's own symbols include libc's (find_library would run ldconfig).
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(_STATFS_BUF_BYTES)
    if libc.statfs(os.fsencode(os.fspath(path)), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(path))
    # A 32-bit long gives CIFS's 0xFF534D42 as a negative number: compare unsigned.
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def filesystem_of(path: str | os.PathLike[str], declared: str = "auto") -> FsInfo:
    """What the store folder `path` (it must exist) is on, or what the site says it is."""
    if declared not in DECLARED:
        raise ValueError(f"[store] filesystem must be one of {', '.join(DECLARED)}, got {declared!r}")
    if declared != "auto":
        return FsInfo(magic=None, name=f"declared {declared}", network=declared == "network")
    magic = statfs_magic(path)
    name = NETWORK_MAGICS.get(magic)
    return FsInfo(magic=magic, name=name or "local", network=name is not None)
