"""files: backend selection by name and the registry, the test-suite's fault injector and its spec, error
types, fsync_dir; and that nothing a user can set injects a fault without ``cpuckpt.testing.faults.install()``."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
import textwrap

import pytest

from cpuckpt import ConfigError, CpuckptError, StorageIOError, faultpoint
from cpuckpt.testing import faults
from cpuckpt.testing.faults import FaultInjectingBackend
from cpuckpt.transfer import files as fileio
from cpuckpt.transfer.files import (
    BufferedFileBackend,
    DirectFileBackend,
    fsync_dir,
    get_backend,
    register_backend,
    unregister_backend,
)

faults.install()


@pytest.fixture
def no_faults():
    """This process as a user's: the ``fault`` backends and any stage handler removed, then restored."""
    factory, handler = unregister_backend("fault"), faultpoint.set_handler(None)
    yield
    if factory is not None:
        register_backend("fault", factory)
    faultpoint.set_handler(handler)


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


@pytest.mark.parametrize("name", ["nvme", "Buffered", "", "direct ", "fault", "fault:ENOSPC@0", "fault:KILL@0",
                                  "o_direct"])
def test_unknown_backend_is_config_error(tmp_path, name, no_faults):
    with pytest.raises(ConfigError) as ei:
        get_backend(name, tmp_path)
    msg = str(ei.value)
    assert "io.backend" in msg and repr(name) in msg
    assert msg.endswith("known: auto, buffered, direct")  # lists the registered ones, nothing else


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
    with pytest.raises(ConfigError, match="known: auto, buffered, custom, direct"):
        get_backend("nvme", tmp_path)
    assert unregister_backend("custom") is Custom and unregister_backend("custom") is None
    with pytest.raises(ConfigError, match="unknown backend 'custom'"):
        get_backend("custom", tmp_path)


def test_register_backend_prefix_gets_the_whole_spec(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "_BACKENDS", dict(fileio._BACKENDS))
    calls = []

    def factory(*args):
        calls.append(args)
        return BufferedFileBackend()

    register_backend("mine", factory)
    get_backend("mine:a:b@1", tmp_path)
    get_backend("mine", tmp_path)
    get_backend("mine:", tmp_path)
    assert calls == [("mine:a:b@1",), (), ("mine:",)]
    for bad in ("", "auto", "a:b"):
        with pytest.raises(ValueError, match="bad backend name"):
            register_backend(bad, factory)
    with pytest.raises(ConfigError, match=r"backend 'buffered' takes no spec \('buffered'\), got 'buffered:x'"):
        get_backend("buffered:x", tmp_path)
    register_backend("spec_only", lambda spec: BufferedFileBackend())
    with pytest.raises(ConfigError, match=r"backend 'spec_only' needs a spec \('spec_only:<spec>'\)"):
        get_backend("spec_only", tmp_path)


def test_fault_backends_need_install(tmp_path, no_faults):
    with pytest.raises(ConfigError, match="unknown backend 'fault:EIO@0'"):
        get_backend("fault:EIO@0", tmp_path)
    faults.install("clear-commit:done=raise")
    try:
        assert isinstance(get_backend("fault:EIO@0", tmp_path), FaultInjectingBackend)
        with pytest.raises(RuntimeError, match="fault point: raise at clear-commit:done"):
            faultpoint.hit("clear-commit:done")
        faultpoint.hit("commit:parts-deleted")  # other stages: nothing
    finally:
        faults.uninstall()
    assert faultpoint.get_handler() is None
    faultpoint.hit("clear-commit:done")
    with pytest.raises(ConfigError, match="unknown backend"):
        get_backend("fault:EIO@0", tmp_path)


def test_stage_actions_spec_and_pickling():
    import pickle

    h = faults.StageActions("a=sleep:0;b=raise; c=raise ;b=kill")
    h("a")
    h("zzz")
    with pytest.raises(RuntimeError, match="raise at c"):
        h("c")
    again = pickle.loads(pickle.dumps(h))
    assert isinstance(again, faults.StageActions) and again.spec == h.spec
    with pytest.raises(RuntimeError, match="raise at b"):  # entries run in order: raise before kill
        again("b")
    for bad in ("a", "=kill", "a=boom", "a=sleep:soon", "a=sleep"):
        with pytest.raises(ConfigError, match="CPUCKPT_TEST_HOOK"):
            faults.StageActions(bad)


def test_install_reads_the_environment_once(monkeypatch, no_faults):
    monkeypatch.setenv("CPUCKPT_TEST_HOOK", "x=raise")
    faults.install()
    try:
        monkeypatch.setenv("CPUCKPT_TEST_HOOK", "y=raise")
        faultpoint.hit("y")  # read at install time, not at each fault point
        with pytest.raises(RuntimeError):
            faultpoint.hit("x")
        faults.install("")  # an empty spec: no handler
        assert faultpoint.get_handler() is None
    finally:
        faults.uninstall()


_USER_PROCESS = textwrap.dedent("""
    import os, signal, sys
    os.environ["CPUCKPT_IO_BACKEND"] = "fault:KILL@0"
    os.environ["CPUCKPT_TEST_HOOK"] = "clear-commit:done=kill;before-rename:.metadata=kill;after-rename:.metadata=raise"
    import torch
    import cpuckpt
    from cpuckpt import faultpoint
    from cpuckpt.transfer.files import get_backend

    root = sys.argv[1]
    sd = {"w": torch.arange(1000, dtype=torch.float32)}
    # the environment override reaches the config and is refused, not obeyed
    assert cpuckpt.Config.from_dict(None).io.backend == "fault:KILL@0"
    for i, cfg in enumerate([None, {"io": {"backend": "fault:KILL@0"}}, {"io": {"backend": "fault:ENOSPC@0"}},
                             {"io": {"backend": "fault:KILL@fsync"}}]):
        try:
            cpuckpt.save(sd, os.path.join(root, f"bad{i}"), cfg)
        except cpuckpt.ConfigError as e:
            assert "unknown backend" in str(e) and "fault" not in str(e).split("known:")[1], e
        else:
            raise AssertionError(f"config {cfg}: a fault backend was accepted")
    for name in ("fault:KILL@0", "fault:KILL@fsync", "fault:EIO@0"):
        try:
            get_backend(name, root)
        except cpuckpt.ConfigError:
            pass
        else:
            raise AssertionError(name)
    # CPUCKPT_TEST_HOOK does nothing: a real save passes every stage it names
    del os.environ["CPUCKPT_IO_BACKEND"]
    assert faultpoint.get_handler() is None
    path = os.path.join(root, "good")
    cpuckpt.save(sd, path, {"io": {"backend": "buffered"}})
    out = {"w": torch.zeros(1000)}
    cpuckpt.load(out, path)
    assert torch.equal(out["w"], sd["w"])
    assert os.path.exists(os.path.join(path, ".metadata"))
    assert "cpuckpt.testing.faults" not in sys.modules, "the product imported the test machinery"
    print("SURVIVED")
""")


def test_nothing_a_user_sets_injects_faults(tmp_path):
    """Without ``cpuckpt.testing.faults.install()``, ``io.backend: fault:...`` (YAML/dict or
    ``CPUCKPT_IO_BACKEND``) is an unknown backend, and ``CPUCKPT_TEST_HOOK`` is ignored."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPUCKPT_")}
    proc = subprocess.run([sys.executable, "-c", _USER_PROCESS, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip().endswith("SURVIVED"), proc.stdout


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


@pytest.mark.parametrize("withdraw", [True, False])
def test_write_atomic_withdraws_a_marker_whose_directory_fsync_failed(tmp_path, withdraw):
    """A commit marker (``withdraw``) is removed again when its directory's fsync fails after the rename; any
    other file (a pointer) stays as renamed. The error is raised either way."""
    faults.install("fsync-dir:marker=eio")
    try:
        with pytest.raises(OSError, match="fault point: EIO at fsync-dir:marker"):
            fileio.write_atomic(tmp_path / "marker", b"x", withdraw=withdraw)
    finally:
        faults.install("")
    assert (tmp_path / "marker").exists() is not withdraw
    assert not (tmp_path / "marker.tmp").exists()
    fileio.write_atomic(tmp_path / "other", b"y", withdraw=True)  # no fault: written
    assert (tmp_path / "other").read_bytes() == b"y"
