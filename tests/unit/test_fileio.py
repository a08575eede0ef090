"""fileio: backend selection by name, the fault injector and its spec, error types, fsync_dir."""

from __future__ import annotations

import errno
import mmap
import os

import pytest

from cpuckpt import ConfigError, CpuckptError, StorageIOError
from cpuckpt.transfer import files as fileio
from cpuckpt.transfer.files import (
    BufferedFileBackend,
    DirectFileBackend,
    FaultInjectingBackend,
    fsync_dir,
    get_backend,
    register_backend,
)


def test_named_backends(tmp_path):
    b = get_backend("buffered", tmp_path)
    assert isinstance(b, BufferedFileBackend) and b.name == "buffered" and not b.aligned
    d = get_backend("direct", tmp_path)
    assert isinstance(d, DirectFileBackend) and d.name == "direct" and d.aligned


def test_auto_backend_is_direct_or_buffered(tmp_path):
    b = get_backend("auto", tmp_path / "sub", 4096)
    assert b.name in ("direct", "buffered")
    assert (tmp_path / "sub").is_dir()  # auto creates the directory it probes
    assert not [p for p in (tmp_path / "sub").iterdir()], "the O_DIRECT probe file was left behind"
    # the probe is cached per filesystem: a second call agrees
    assert get_backend("auto", tmp_path, 4096).name == b.name


@pytest.mark.parametrize("name", ["nvme", "Buffered", "", "direct ", "fault", "o_direct"])
def test_unknown_backend_is_config_error(tmp_path, name):
    with pytest.raises(ConfigError) as ei:
        get_backend(name, tmp_path)
    msg = str(ei.value)
    assert "io.backend" in msg and repr(name) in msg
    assert "buffered" in msg and "direct" in msg  # lists the known ones
    assert isinstance(ei.value, CpuckptError) and isinstance(ei.value, ValueError)


@pytest.mark.parametrize(
    ("spec", "err", "after"),
    [
        ("fault:ENOSPC@1048576", errno.ENOSPC, 1048576),
        ("fault:enospc@0", errno.ENOSPC, 0),
        ("fault:EIO@4096", errno.EIO, 4096),
        ("fault:28@5", 28, 5),
        ("fault:EDQUOT@123", errno.EDQUOT, 123),
    ],
)
def test_fault_spec_parsing(tmp_path, spec, err, after):
    b = get_backend(spec, tmp_path)
    assert isinstance(b, FaultInjectingBackend)
    assert b.err == err and b.fail_after_bytes == after


@pytest.mark.parametrize(
    "spec",
    [
        "fault:",
        "fault:ENOSPC",
        "fault:@100",
        "fault:ENOTANERRNO@1",
        "fault:ENOSPC@lots",
        "fault:ENOSPC@1@2",
        "fault:ENOSPC@",
        "fault:errorcode@1",  # an attribute of the errno module that is not an error number
    ],
)
def test_bad_fault_spec_is_config_error(tmp_path, spec):
    with pytest.raises(ConfigError) as ei:
        get_backend(spec, tmp_path)
    assert repr(spec) in str(ei.value) and "fault:" in str(ei.value)


def _buf(n: int, fill: bytes = b"a") -> memoryview:
    m = mmap.mmap(-1, n)
    m[:] = fill * n
    return memoryview(m)


@pytest.mark.parametrize(("name", "err"), [("ENOSPC", errno.ENOSPC), ("EIO", errno.EIO)])
def test_fault_backend_fails_once_budget_is_spent(tmp_path, name, err):
    b = get_backend(f"fault:{name}@10000", tmp_path)
    path = str(tmp_path / "f.distcp")
    fd = b.open_write(path)
    try:
        b.pwrite(fd, _buf(4096), 0, path)
        b.pwrite(fd, _buf(4096), 4096, path)  # 8192 <= 10000: still fine
        with pytest.raises(StorageIOError) as ei:
            b.pwrite(fd, _buf(4096), 8192, path)  # 12288 > 10000
        e = ei.value
        assert e.errno == err and e.path == path and e.offset == 8192 and e.nbytes == 4096
        assert path in str(e) and "offset 8192" in str(e) and os.strerror(err) in str(e)
        assert isinstance(e, OSError)
        with pytest.raises(StorageIOError):  # every later write fails too
            b.pwrite(fd, _buf(16), 0, path)
    finally:
        b.close(fd)
    assert os.path.getsize(path) == 8192  # the failed write wrote nothing


def test_fault_backend_zero_budget_fails_first_write(tmp_path):
    b = get_backend("fault:EIO@0", tmp_path)
    path = str(tmp_path / "f.distcp")
    fd = b.open_write(path)
    try:
        with pytest.raises(StorageIOError) as ei:
            b.pwrite(fd, _buf(1), 0, path)
        assert ei.value.errno == errno.EIO
    finally:
        b.close(fd)


def test_fault_backend_reads_normally(tmp_path):
    p = tmp_path / "f.distcp"
    p.write_bytes(b"hello world")
    b = get_backend("fault:EIO@0", tmp_path)
    fd = b.open_read(str(p))
    try:
        out = bytearray(32)
        assert b.pread_into(fd, memoryview(out), 6, str(p)) == 5
        assert out[:5] == b"world"
    finally:
        b.close(fd)


def test_each_fault_backend_has_its_own_budget(tmp_path):
    a = get_backend("fault:ENOSPC@100", tmp_path)
    b = get_backend("fault:ENOSPC@100", tmp_path)
    assert a is not b
    path = str(tmp_path / "f")
    fd = a.open_write(path)
    try:
        a.pwrite(fd, _buf(100), 0, path)
        b.pwrite(fd, _buf(100), 0, path)
    finally:
        a.close(fd)


def test_register_backend(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "_BACKENDS", dict(fileio._BACKENDS))

    class Custom(BufferedFileBackend):
        name = "custom"

    register_backend("custom", Custom)
    assert isinstance(get_backend("custom", tmp_path), Custom)


def test_storage_io_error_is_an_os_error_with_fields():
    e = StorageIOError("pwrite failed on /x at offset 4", path="/x", offset=4, nbytes=8, errno_=errno.EIO)
    assert isinstance(e, OSError) and isinstance(e, CpuckptError)
    assert (e.errno, e.path, e.filename, e.offset, e.nbytes) == (errno.EIO, "/x", "/x", 4, 8)
    assert str(e) == "pwrite failed on /x at offset 4"


def test_fsync_dir(tmp_path):
    fsync_dir(tmp_path)  # works on a directory
    missing = tmp_path / "missing"
    with pytest.raises(StorageIOError) as ei:
        fsync_dir(missing)
    assert str(missing) in str(ei.value) and ei.value.errno == errno.ENOENT
