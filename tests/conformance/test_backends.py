"""Conformance suite: what every FileBackend must do (buffered, direct, auto), on tmp_path's filesystem."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import pytest

from cpuckpt import StorageIOError
from cpuckpt.transfer.files import FileBackend, get_backend

ALIGN = 4096


def _o_direct_refusal(directory: Path) -> str | None:
    """None when this filesystem accepts an aligned O_DIRECT write, else why not."""
    if not hasattr(os, "O_DIRECT"):
        return "os.O_DIRECT does not exist on this platform"
    probe = directory / "o_direct_probe"
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, memoryview(buf), 0)
        finally:
            os.close(fd)
    except OSError as e:
        return f"O_DIRECT refused by the filesystem of {directory}: {e}"
    finally:
        buf.close()
        probe.unlink(missing_ok=True)
    return None


@pytest.fixture(params=["buffered", "direct", "auto"])
def backend(request, tmp_path) -> FileBackend:
    if request.param == "direct":
        why = _o_direct_refusal(tmp_path)
        if why:
            pytest.skip(why)
    b = get_backend(request.param, tmp_path, ALIGN)
    if request.param == "auto":
        expect = "buffered" if _o_direct_refusal(tmp_path) else "direct"
        assert b.name == expect
    return b


def _buf(data: bytes, size: int | None = None) -> mmap.mmap:
    """A page-aligned buffer (mmap), as the pool provides; padded with zeros to ``size``."""
    m = mmap.mmap(-1, max(size or len(data), 1))
    m[: len(data)] = data
    return m


def _pattern(n: int, seed: int = 0) -> bytes:
    return bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(n))


def _io_len(b: FileBackend, n: int) -> int:
    return -(-n // ALIGN) * ALIGN if b.aligned else n


def test_write_read_round_trip(backend, tmp_path):
    path = str(tmp_path / "f.distcp")
    n = 5 * ALIGN
    data = _pattern(n)
    fd = backend.open_write(path)
    # disjoint aligned pieces, written out of order (as worker threads do)
    for k in [3, 0, 4, 1, 2]:
        piece = _buf(data[k * ALIGN : (k + 1) * ALIGN])
        backend.pwrite(fd, memoryview(piece), k * ALIGN, path)
    backend.finish_write(fd, n, path, True)
    assert Path(path).read_bytes() == data
    out = _buf(b"", n)
    fd = backend.open_read(path)
    try:
        assert backend.pread_into(fd, memoryview(out), 0, path) == n
        assert out[:n] == data
        part = _buf(b"", 2 * ALIGN)
        assert backend.pread_into(fd, memoryview(part), 2 * ALIGN, path) == 2 * ALIGN
        assert part[:] == data[2 * ALIGN : 4 * ALIGN]
    finally:
        backend.close(fd)


def test_finish_write_truncates_padded_tail(backend, tmp_path):
    """The last chunk is padded to alignment for O_DIRECT; finish_write cuts the file to its real size."""
    path = str(tmp_path / "f.distcp")
    real = 2 * ALIGN + 1234
    data = _pattern(real, seed=1)
    padded = _buf(data, _io_len(backend, real))
    fd = backend.open_write(path)
    backend.pwrite(fd, memoryview(padded)[: _io_len(backend, real)], 0, path)
    backend.finish_write(fd, real, path, False)
    assert os.path.getsize(path) == real
    assert Path(path).read_bytes() == data


def test_open_write_truncates_existing_file(backend, tmp_path):
    path = tmp_path / "f.distcp"
    path.write_bytes(b"x" * (3 * ALIGN))
    fd = backend.open_write(str(path))
    backend.pwrite(fd, memoryview(_buf(b"y" * ALIGN)), 0, str(path))
    backend.finish_write(fd, ALIGN, str(path), True)
    assert path.read_bytes() == b"y" * ALIGN


def test_short_read_at_eof(backend, tmp_path):
    path = tmp_path / "f.distcp"
    real = ALIGN + 1000
    data = _pattern(real, seed=2)
    path.write_bytes(data)
    fd = backend.open_read(str(path))
    try:
        out = _buf(b"", 2 * ALIGN)
        got = backend.pread_into(fd, memoryview(out), 0, str(path))
        assert got == real
        assert out[:real] == data
        tail = _buf(b"", ALIGN)
        assert backend.pread_into(fd, memoryview(tail), ALIGN, str(path)) == 1000
        assert tail[:1000] == data[ALIGN:]
        beyond = _buf(b"", ALIGN)
        assert backend.pread_into(fd, memoryview(beyond), 4 * ALIGN, str(path)) == 0
    finally:
        backend.close(fd)


def test_empty_file(backend, tmp_path):
    path = str(tmp_path / "empty.distcp")
    fd = backend.open_write(path)
    backend.finish_write(fd, 0, path, True)
    assert os.path.getsize(path) == 0
    fd = backend.open_read(path)
    try:
        assert backend.pread_into(fd, memoryview(_buf(b"", ALIGN)), 0, path) == 0
    finally:
        backend.close(fd)


def test_large_write_crosses_many_blocks(backend, tmp_path):
    path = str(tmp_path / "big.distcp")
    n = 3 * 1024 * 1024 + 7
    data = os.urandom(n)
    fd = backend.open_write(path)
    buf = _buf(data, _io_len(backend, n))
    backend.pwrite(fd, memoryview(buf)[: _io_len(backend, n)], 0, path)
    backend.finish_write(fd, n, path, True)
    out = _buf(b"", _io_len(backend, n))
    fd = backend.open_read(path)
    try:
        assert backend.pread_into(fd, memoryview(out), 0, path) == n
    finally:
        backend.close(fd)
    assert out[:n] == data


def test_open_read_missing_file_names_path(backend, tmp_path):
    path = str(tmp_path / "nope.distcp")
    with pytest.raises(StorageIOError) as ei:
        backend.open_read(path)
    e = ei.value
    assert isinstance(e, OSError)
    assert path in str(e) and e.path == path and e.filename == path
    assert e.errno == errno.ENOENT


def test_open_write_in_missing_directory_names_path(backend, tmp_path):
    path = str(tmp_path / "no-such-dir" / "f.distcp")
    with pytest.raises(StorageIOError) as ei:
        backend.open_write(path)
    assert path in str(ei.value) and ei.value.errno == errno.ENOENT


def test_pwrite_error_names_path_and_offset(backend, tmp_path):
    path = tmp_path / "ro.distcp"
    path.write_bytes(bytes(2 * ALIGN))
    fd = backend.open_read(str(path))  # read-only descriptor: pwrite fails with EBADF
    try:
        with pytest.raises(StorageIOError) as ei:
            backend.pwrite(fd, memoryview(_buf(b"z" * ALIGN)), ALIGN, str(path))
    finally:
        backend.close(fd)
    e = ei.value
    assert isinstance(e, OSError)
    assert e.errno == errno.EBADF
    assert e.path == str(path) and e.offset == ALIGN and e.nbytes == ALIGN
    assert str(path) in str(e) and f"offset {ALIGN}" in str(e)
    assert isinstance(e.__cause__, OSError)


def test_pread_error_names_path_and_offset(backend, tmp_path):
    path = str(tmp_path / "wo.distcp")
    fd = backend.open_write(path)  # write-only descriptor: pread fails with EBADF
    try:
        with pytest.raises(StorageIOError) as ei:
            backend.pread_into(fd, memoryview(_buf(b"", ALIGN)), 2 * ALIGN, path)
    finally:
        backend.close(fd)
    e = ei.value
    assert e.errno == errno.EBADF and e.path == path and e.offset == 2 * ALIGN
    assert path in str(e) and f"offset {2 * ALIGN}" in str(e)


def test_finish_write_error_names_path(backend, tmp_path):
    path = tmp_path / "f.distcp"
    path.write_bytes(b"")
    fd = backend.open_read(str(path))  # ftruncate on a read-only descriptor fails
    with pytest.raises(StorageIOError) as ei:
        backend.finish_write(fd, 10, str(path), True)
    assert str(path) in str(ei.value)
    with pytest.raises(OSError):  # finish_write closed the descriptor even though it failed
        os.fstat(fd)


def test_close_is_idempotent(backend, tmp_path):
    path = tmp_path / "f.distcp"
    path.write_bytes(b"abc")
    fd = backend.open_read(str(path))
    backend.close(fd)
    backend.close(fd)  # a second close of a closed descriptor does not raise


def test_direct_backend_rejects_misaligned_io_with_storage_io_error(tmp_path):
    why = _o_direct_refusal(tmp_path)
    if why:
        pytest.skip(why)
    b = get_backend("direct", tmp_path, ALIGN)
    assert b.aligned
    path = str(tmp_path / "f.distcp")
    fd = b.open_write(path)
    try:
        with pytest.raises(StorageIOError) as ei:
            b.pwrite(fd, memoryview(_buf(b"q" * 100)), 7, path)
        assert ei.value.errno == errno.EINVAL
        assert path in str(ei.value) and ei.value.offset == 7
    finally:
        b.close(fd)
