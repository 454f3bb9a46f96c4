"""Where asyncpage may write code and data it later reads back: the per-user cache root.

`root()` is `ASYNCPAGE_CACHE` if set, else `$XDG_CACHE_HOME/asyncpage`, else `~/.cache/asyncpage`;
created 0700. What is read back from it (the native kernels' .so, which is loaded as code; the GGUF
index and tokenizer, which are trusted as written) must be something only this user could have put
there, so a folder or file is refused (`UnsafeCacheError`) when it is a symlink, not owned by this
uid, or group/other-writable. One exception: a folder of ours that is group-writable only for this
user's own private group (what a umask of 002 leaves, the default on user-private-group systems such
as Ubuntu, and how earlier versions created these folders) is writable by no one else: it is
tightened to 0700, not refused. Writes go to a fresh name in the same folder (mkstemp / mkdtemp,
created by us with O_EXCL, so a planted symlink is never followed), made 0600 / 0700 whatever the
umask, and renamed into place.

This module owns paths and their checks only; what is cached, and under which key, is its callers'
(native.py, weights.py, models/compiled.py)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from asyncpage.errors import ModelLoadError

# Bits that would let someone other than the owner change what a path holds.
_SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UnsafeCacheError(ModelLoadError):
    """A cache folder or file another user could have written (owned by another uid, group- or
    other-writable, or a symlink): asyncpage refuses to read code or data back from it. `path` names
    it; the message says how to fix it."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"refusing the asyncpage cache {path}: {why}")
        self.path = path


_HINT = "another user could have written it; use a folder only you own, mode 0700 (ASYNCPAGE_CACHE names one)"


def root() -> Path:
    """The per-user cache root, created 0700 if missing, checked (UnsafeCacheError) if present."""
    configured = os.environ.get("ASYNCPAGE_CACHE")
    if configured:
        path = Path(configured).expanduser()
    else:
        try:
            base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        except RuntimeError as exc:  # no HOME and no passwd entry
            raise UnsafeCacheError(Path("~/.cache/asyncpage"), f"{exc}; set ASYNCPAGE_CACHE") from exc
        path = base / "asyncpage"
    path = Path(os.path.abspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)  # ~/.cache and the like: not ours to tighten
    if os.path.islink(path):
        # The root alone may be a symlink (a cache moved to another disk), if the link is this
        # user's own: one planted in a shared folder by someone else is refused here.
        _check(path, os.lstat(path), stat.S_ISLNK, "a symlink", mode_matters=False)
        _check(path, os.stat(path), stat.S_ISDIR, "a folder")
        return path
    _make_dir(path)
    return path


def subdir(*parts: str) -> Path:
    """root()/parts..., each level created 0700 or checked."""
    path = root()
    for part in parts:
        path = path / part
        _make_dir(path)
    return path


def check_dir(path: Path) -> None:
    """Raise UnsafeCacheError unless `path` is a real folder (not a symlink) owned by this uid and
    not group/other-writable."""
    _check(path, os.lstat(path), stat.S_ISDIR, "a folder")


def check_file(path: Path) -> os.stat_result:
    """Its lstat if `path` is a regular file (not a symlink) owned by this uid and not
    group/other-writable; else UnsafeCacheError. FileNotFoundError where nothing is there."""
    st = os.lstat(path)
    _check(path, st, stat.S_ISREG, "a regular file")
    return st


def check_tree(path: Path) -> None:
    """check_dir on `path` and every folder under it, check_file on every file: a cached folder
    (e.g. a tokenizer) read back as a whole."""
    check_dir(path)
    for entry in os.scandir(path):
        child = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            check_tree(child)
        else:
            check_file(child)


def read_bytes(path: Path) -> bytes:
    """A checked file's bytes, opened without following a symlink (O_NOFOLLOW) and re-checked on
    the open descriptor, so a swap between the check and the read cannot pass."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        _check(path, os.fstat(fd), stat.S_ISREG, "a regular file")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            return f.read()
    finally:
        if fd >= 0:
            os.close(fd)


def write_bytes(dest: Path, data: bytes) -> None:
    """`data` at `dest`, all or nothing: written to a fresh file beside it (mode 0600) and renamed
    over it (a rename replaces a symlink at `dest`, never writes through it)."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, dest)
    except BaseException:
        _unlink(tmp)
        raise


@contextmanager
def fresh_file(dest: Path, suffix: str = "", mode: int = 0o600) -> Iterator[Path]:
    """A fresh empty file beside `dest` for a tool to write (a compiler's -o); given `mode` and
    renamed onto `dest` when the block ends without an error, removed otherwise."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        # A tool may have recreated the file under the process umask (a linker does): make it ours alone.
        os.chmod(tmp, mode)
        check_file(Path(tmp))
        os.replace(tmp, dest)
    finally:
        _unlink(tmp)


@contextmanager
def fresh_dir(dest: Path) -> Iterator[Path]:
    """A fresh empty folder (0700) beside `dest`, filled by the block, then renamed onto `dest`.
    If another writer's folder got there first (a concurrent first load), ours is dropped and
    theirs kept: the caller reads `dest` either way."""
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp"))
    try:
        yield tmp
        _make_private(tmp)
        try:
            os.replace(tmp, dest)
        except OSError:
            # rename(2) onto a non-empty folder fails (ENOTEMPTY / EEXIST): the race's winner is in place.
            if not os.path.isdir(dest):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # rmtree never follows symlinks inside


def discard(path: Path) -> None:
    """Remove a cached folder or file we no longer trust: moved aside to a fresh name first (one
    rename, so a concurrent reader sees the old entry or none, never half of one), then deleted."""
    aside = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old")
    try:
        os.replace(path, Path(aside) / "entry")
    except FileNotFoundError:
        pass  # another process discarded it first
    shutil.rmtree(aside, ignore_errors=True)


def _make_dir(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask took off or left on
    except FileExistsError:
        st = os.lstat(path)
        if (stat.S_ISDIR(st.st_mode) and _is_own(st) and st.st_mode & _SHARED_WRITE == stat.S_IWGRP
                and _is_private_group(st.st_gid)):
            os.chmod(path, 0o700)  # writable by no one else: see the module's docstring
    check_dir(path)


def _make_private(path: Path) -> None:
    """Folders 0700 and files 0600 under a fresh folder of ours (tools such as save_pretrained
    create theirs under the process umask), so that they pass the checks when read back."""
    os.chmod(path, 0o700)
    for top, dirs, files in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(top, name), 0o700, follow_symlinks=False)
        for name in files:
            full = os.path.join(top, name)
            if not os.path.islink(full):  # a link is left for check_tree to refuse
                os.chmod(full, 0o600)


def _is_own(st: os.stat_result) -> bool:
    return not hasattr(os, "getuid") or st.st_uid == os.getuid()


def _is_private_group(gid: int) -> bool:
    """Whether `gid` is this user's own private group: their primary group, named after them,
    listing no other member (the user-private-group scheme)."""
    try:
        import grp
        import pwd

        me = pwd.getpwuid(os.getuid())
        group = grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return gid == me.pw_gid and group.gr_name == me.pw_name and all(m == me.pw_name for m in group.gr_mem)


def _check(path: Path, st: os.stat_result, kind_ok: Callable[[int], bool], kind: str,
           mode_matters: bool = True) -> None:
    if not kind_ok(st.st_mode):
        raise UnsafeCacheError(path, f"it is a symlink; {_HINT}" if stat.S_ISLNK(st.st_mode) else f"it is not {kind}")
    if not hasattr(os, "getuid"):
        return  # no POSIX owners (Windows): the folder's ACLs are the user's profile's
    uid = os.getuid()
    if st.st_uid != uid:
        raise UnsafeCacheError(path, f"it is owned by uid {st.st_uid}, not by this process's uid {uid}; {_HINT}")
    if mode_matters and st.st_mode & _SHARED_WRITE:
        raise UnsafeCacheError(path, f"it is group/other-writable (mode {stat.S_IMODE(st.st_mode):04o}); {_HINT}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
