"""Record skeletons: torch.save-compatible records built without pickling data, and parse_record."""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from cpuckpt.format.record import parse_record, record_template

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (2, 3, 4), (1, 1, 1, 1), (33, 65)]


def _ids(v):
    return str(v).replace("torch.", "")


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random contents covering every bit pattern (NaNs, infs, denormals) except for bool (0/1 only)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _record(t: torch.Tensor) -> bytes:
    tpl = record_template(t.dtype, tuple(t.shape))
    raw = _raw(t)
    assert len(raw) == tpl.data_nbytes
    return tpl.head + raw + tpl.tail


def _assert_bit_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert _raw(got) == _raw(want)


# ------------------------------------------------------------------------------- template + load


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_template_plus_raw_bytes_loads_bit_exact(dtype, shape):
    t = _random_tensor(dtype, shape, seed=hash((str(dtype), shape)) & 0xFFFF)
    rec = _record(t)
    out = torch.load(io.BytesIO(rec), weights_only=True)
    _assert_bit_exact(out, t)
    assert out.is_contiguous()
    assert out.storage_offset() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_template_sizes(dtype):
    tpl = record_template(dtype, (3, 5))
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert tpl.data_nbytes == 15 * itemsize
    assert tpl.data_offset == len(tpl.head)
    assert tpl.record_nbytes == len(tpl.head) + tpl.data_nbytes + len(tpl.tail)
    assert tpl.head.startswith(b"PK\x03\x04")
    # torch.save aligns storage bytes (serialization config, 64 by default)
    align = getattr(getattr(torch.utils.serialization, "config", None), "save", None)
    align = getattr(align, "storage_alignment", 64)
    assert tpl.data_offset % align == 0


def test_template_is_cached_and_shape_specific():
    a = record_template(torch.float32, (4, 4))
    assert record_template(torch.float32, (4, 4)) is a
    b = record_template(torch.float32, (16,))
    assert b.data_nbytes == a.data_nbytes
    assert b.head != a.head or b.tail != a.tail  # the shape lives in the pickle


def test_large_shape_template_is_cheap_and_correct():
    """The data region is never materialised; a 256 MiB shape works like a small one."""
    n = 1 << 28
    tpl = record_template(torch.uint8, (n,))
    assert tpl.data_nbytes == n
    assert len(tpl.head) < 4096 and len(tpl.tail) < 4096
    info = parse_record(tpl.head + bytes(n) + tpl.tail)
    assert info is not None
    assert info.shape == (n,) and info.data_offset == tpl.data_offset and info.storage_nbytes == n


# ----------------------------------------------------------------------------------- golden bytes


def _crc_field_positions(buf: bytes, zf: zipfile.ZipFile, name: str) -> list[range]:
    """Byte ranges of ``name``'s CRC-32: local header, data descriptor (flag bit 3) and central directory."""
    info = zf.getinfo(name)
    out = [range(info.header_offset + 14, info.header_offset + 18)]
    if info.flag_bits & 0x8:
        n, m = struct.unpack_from("<2H", buf, info.header_offset + 26)
        end = info.header_offset + 30 + n + m + info.file_size
        assert buf[end : end + 4] == b"PK\x07\x08"
        out.append(range(end + 4, end + 8))
    pos = buf.find(b"PK\x01\x02")
    while pos != -1:
        n, m, k = struct.unpack_from("<3H", buf, pos + 28)
        if buf[pos + 46 : pos + 46 + n].decode() == name:
            out.append(range(pos + 16, pos + 20))
        pos = buf.find(b"PK\x01\x02", pos + 46 + n + m + k)
    assert len(out) == 2 + bool(info.flag_bits & 0x8), f"central directory entry of {name} not found"
    return out


def _serialization_id_mask(buf: bytes) -> tuple[set[int], str]:
    """Positions of the ``.data/serialization_id`` entry's content and CRCs (they may differ per save)."""
    zf = zipfile.ZipFile(io.BytesIO(buf))
    names = [n for n in zf.namelist() if n.endswith(".data/serialization_id")]
    assert len(names) == 1, zf.namelist()
    info = zf.getinfo(names[0])
    n, m = struct.unpack_from("<2H", buf, info.header_offset + 26)
    start = info.header_offset + 30 + n + m
    mask = set(range(start, start + info.file_size))
    for r in _crc_field_positions(buf, zf, names[0]):
        mask.update(r)
    return mask, names[0]


def _masked(buf: bytes, mask: set[int]) -> bytes:
    b = bytearray(buf)
    for i in mask:
        b[i] = 0
    return bytes(b)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4), (2, 3, 4)], ids=_ids)
def test_golden_head_tail_match_torch_save_skip_data_file(tmp_path, dtype, shape):
    # torch.save names the archive after the file (basename without extension); a buffer is "archive".
    path = tmp_path / "archive"
    with torch.serialization.skip_data():
        torch.save(torch.empty(shape, dtype=dtype), path)
    golden = path.read_bytes()
    tpl = record_template(dtype, shape)
    assert len(golden) == tpl.record_nbytes
    ours = tpl.head + bytes(tpl.data_nbytes) + tpl.tail
    mask, name = _serialization_id_mask(golden)
    mask_ours, name_ours = _serialization_id_mask(ours)
    assert name == name_ours and mask == mask_ours
    # skip_data leaves the data region unwritten (reads as zeros) in the real file
    assert golden[tpl.data_offset : tpl.data_offset + tpl.data_nbytes] == bytes(tpl.data_nbytes)
    g, o = _masked(golden, mask), _masked(ours, mask)
    assert g[: tpl.data_offset] == o[: tpl.data_offset], "head differs from torch.save's"
    assert g[tpl.data_offset + tpl.data_nbytes :] == o[tpl.data_offset + tpl.data_nbytes :], "tail differs"


def test_golden_mask_only_hides_the_serialization_id(tmp_path):
    """The masked region is small: just the id's bytes and its two CRC fields."""
    tpl = record_template(torch.float32, (3, 4))
    mask, _ = _serialization_id_mask(tpl.head + bytes(tpl.data_nbytes) + tpl.tail)
    assert len(mask) <= 64 + 12
    assert all(i >= tpl.data_offset + tpl.data_nbytes for i in mask)  # all in the tail


# ------------------------------------------------------------------------------------ parse_record


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("shape", [(), (0,), (6,), (3, 4), (2, 3, 4)], ids=_ids)
def test_parse_our_record(dtype, shape):
    t = _random_tensor(dtype, shape, seed=3)
    rec = _record(t)
    tpl = record_template(dtype, shape)
    info = parse_record(rec)
    assert info is not None
    assert info.dtype == dtype
    assert info.shape == tuple(shape)
    assert info.stride == torch.empty(shape).stride()
    assert info.storage_offset == 0
    assert info.data_offset == tpl.data_offset
    assert info.storage_nbytes == tpl.data_nbytes
    assert rec[info.data_offset : info.data_offset + info.storage_nbytes] == _raw(t)
    assert parse_record(bytearray(rec)) == info
    assert parse_record(memoryview(rec)) == info


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_parse_stock_record_of_contiguous_tensor(dtype):
    t = _random_tensor(dtype, (4, 6), seed=5)
    buf = io.BytesIO()
    torch.save(t, buf)
    rec = buf.getvalue()
    info = parse_record(rec)
    assert info is not None
    assert (info.dtype, info.shape, info.stride, info.storage_offset) == (dtype, (4, 6), (6, 1), 0)
    assert rec[info.data_offset : info.data_offset + info.storage_nbytes] == _raw(t)


@pytest.mark.parametrize(
    "make_view",
    [
        lambda b: b.t(),
        lambda b: b[1:, ::2],
        lambda b: b[2],
        lambda b: b[:, 3],
        lambda b: b[1:3, 2:5],
        lambda b: b.reshape(-1)[5:17],
        lambda b: b[0, 0],
    ],
    ids=["transpose", "step-slice", "row", "column", "block", "flat-offset", "scalar-element"],
)
def test_parse_stock_record_of_view(make_view):
    """torch.save of a view stores the whole storage plus offset and strides; we reconstruct it."""
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    view = make_view(base)
    buf = io.BytesIO()
    torch.save(view, buf)
    rec = bytearray(buf.getvalue())
    info = parse_record(rec)
    assert info is not None
    assert info.shape == tuple(view.shape)
    assert info.stride == view.stride()
    assert info.storage_offset == view.storage_offset()
    assert info.storage_nbytes == base.numel() * 4
    raw = torch.frombuffer(rec, dtype=torch.uint8, count=info.storage_nbytes, offset=info.data_offset)
    rebuilt = raw.view(info.dtype).as_strided(info.shape, info.stride, info.storage_offset)
    assert torch.equal(rebuilt, view)


def test_parse_record_inside_a_larger_file_slice():
    """DCP stores records back to back; a record sliced out of a file parses on its own."""
    parts, tensors = [], [torch.randn(3, 3), torch.arange(10), torch.ones(2, dtype=torch.bfloat16)]
    for t in tensors:
        b = io.BytesIO()
        torch.save(t, b)
        parts.append(b.getvalue())
    blob = b"".join(parts)
    off = 0
    for t, p in zip(tensors, parts):
        rec = blob[off : off + len(p)]
        info = parse_record(rec)
        assert info is not None and info.dtype == t.dtype and info.shape == tuple(t.shape)
        assert rec[info.data_offset : info.data_offset + info.storage_nbytes] == _raw(t)
        off += len(p)


def _saved(obj) -> bytes:
    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


@pytest.mark.parametrize(
    "obj",
    [
        {"a": 1},
        [torch.ones(2)],
        {"w": torch.ones(2)},
        (torch.ones(2), torch.zeros(2)),
        "a string",
        12345,
        None,
        torch.nn.Parameter(torch.ones(3)),
    ],
    ids=["dict", "list-of-tensor", "dict-of-tensor", "tuple", "str", "int", "none", "parameter"],
)
def test_parse_non_tensor_pickles_returns_none(obj):
    assert parse_record(_saved(obj)) is None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_parse_sparse_and_quantized_tensors_return_none():
    assert parse_record(_saved(torch.eye(3).to_sparse())) is None
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    assert parse_record(_saved(q)) is None


def test_parse_requires_grad_tensor_still_parses():
    t = torch.randn(3, requires_grad=True)
    info = parse_record(_saved(t.detach().requires_grad_()))
    # a plain tensor pickle with requires_grad=True is still a plain tensor record
    assert info is not None and info.shape == (3,)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00" * 100,
        b"PK\x03\x04" + b"\xff" * 200,
        b"not a zip file at all, just text",
        bytes(range(256)) * 8,
        pickle.dumps(torch.ones(3)),  # plain pickle, not a zip record
    ],
    ids=["empty", "zeros", "bad-zip", "text", "bytes", "legacy-pickle"],
)
def test_parse_garbage_returns_none(data):
    assert parse_record(data) is None


def test_parse_truncated_records_return_none():
    rec = _record(torch.randn(64))
    for cut in [1, 2, 21, len(rec) // 3, len(rec) // 2, len(rec) - 22, len(rec) - 1]:
        assert parse_record(rec[: len(rec) - cut]) is None, f"cut {cut}"


def test_parse_random_garbage_never_raises():
    import random

    rng = random.Random(1234)
    rec = _record(torch.randn(16))
    for _ in range(500):
        b = bytearray(rec)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        parse_record(b)  # may parse (flip in data) or return None, must not raise


class _Evil:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


class _EvalEvil:
    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return (eval, (self.code,))


class _HostileTensor:
    """Pickles as ``torch._utils._rebuild_tensor_v2(<hostile>, 0, (4,), (1,), False, OrderedDict())``."""

    def __init__(self, storage) -> None:
        self.storage = storage

    def __reduce__(self):
        from collections import OrderedDict

        return (torch._utils._rebuild_tensor_v2, (self.storage, 0, (4,), (1,), False, OrderedDict()))


def _hostile_storage_pickle(cmd: str) -> bytes:
    """A tensor pickle whose persistent storage id names ``os.system(cmd)`` as its storage type."""

    class _Marker:
        pass

    class _P(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, _Marker):
                return ("storage", _Evil(cmd), "0", "cpu", 4)
            return None

    b = io.BytesIO()
    _P(b, protocol=2).dump(_HostileTensor(_Marker()))
    return b.getvalue()


def _zip_record(pkl: bytes, extra: dict[str, bytes] | None = None) -> bytes:
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return b.getvalue()


def test_parse_malicious_pickles_execute_nothing(tmp_path):
    marker = tmp_path / "pwned"
    payloads = {
        "torch.save-os.system": _saved(_Evil(f"touch {marker}")),
        "zip-os.system": _zip_record(pickle.dumps(_Evil(f"touch {marker}"), protocol=2),
                                     {"archive/data/0": b"\0" * 16}),
        "zip-eval": _zip_record(pickle.dumps(_EvalEvil(f"open({str(marker)!r}, 'w')"), protocol=2)),
        "zip-stock-protocol": _zip_record(pickle.dumps(_Evil(f"touch {marker}"))),
    }
    # tensor-shaped pickles that smuggle a hostile global into the rebuild arguments or the storage id
    payloads["tensor-rebuild-with-hostile-arg"] = _zip_record(
        pickle.dumps(_HostileTensor(_Evil(f"touch {marker}")), protocol=2), {"archive/data/0": b"\0" * 16})
    payloads["tensor-with-hostile-storage-type"] = _zip_record(
        _hostile_storage_pickle(f"touch {marker}"), {"archive/data/0": b"\0" * 16})
    for name, rec in payloads.items():
        assert parse_record(rec) is None, name
    assert not marker.exists(), "parse_record executed pickled code"


def test_malicious_payload_is_real(tmp_path):
    """Control: the payload used above does run under a plain unpickler (so the test proves something)."""
    marker = tmp_path / "control"
    pickle.loads(pickle.dumps(_Evil(f"{sys.executable} -c \"open('{marker}', 'w')\"")))
    assert marker.exists()


def test_parse_record_missing_storage_entry_returns_none():
    good = _record(torch.ones(4))
    zf = zipfile.ZipFile(io.BytesIO(good))
    rebuilt = _zip_record(zf.read("archive/data.pkl"))  # no archive/data/0
    assert parse_record(rebuilt) is None


def test_parse_record_compressed_storage_returns_none():
    good = _saved(torch.ones(64))
    zf = zipfile.ZipFile(io.BytesIO(good))
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w") as out:
        out.writestr("archive/data.pkl", zf.read("archive/data.pkl"))
        out.writestr("archive/data/0", zf.read("archive/data/0"), compress_type=zipfile.ZIP_DEFLATED)
    assert parse_record(b.getvalue()) is None


def test_stock_loader_agrees_with_parse_on_path(tmp_path):
    """A record written to disk by our template loads with torch.load from a path too."""
    t = _random_tensor(torch.bfloat16, (5, 7), seed=9)
    p = Path(tmp_path) / "rec.pt"
    p.write_bytes(_record(t))
    _assert_bit_exact(torch.load(p, weights_only=True), t)


def test_own_skeleton_writer_is_used_on_this_torch():
    """Guard: if a torch release changes its archive layout, we fall back to torch.save (slower).

    This test makes that fallback visible instead of silent.
    """
    from cpuckpt.format import record

    assert record._fast_matches_torch()
    fast = record._fast_template(torch.bfloat16, (3, 5, 7))
    slow = record._torch_template(torch.bfloat16, (3, 5, 7))
    assert fast.head == slow.head and record._mask_id(fast.tail) == record._mask_id(slow.tail)


# ------------------------------------------------------------------------------ zip headers, dtypes


def test_zip_local_headers_give_every_entrys_data_offset():
    """``entry_data_offset`` (from the central directory) and ``written_entries`` (from the pieces a
    writer emits) agree with zipfile on where every stored entry's bytes are, in a torch.save archive."""
    from cpuckpt.format.record import SparseSink
    from cpuckpt.format.zipheader import LOCAL_HEADER, entry_data_offset, written_entries

    assert LOCAL_HEADER.size == 30
    obj = {"a": torch.arange(10.0), "b": [torch.ones(3, dtype=torch.int64)], "c": "text"}
    buf = io.BytesIO()
    torch.save(obj, buf)
    blob = buf.getvalue()
    zf = zipfile.ZipFile(io.BytesIO(blob))
    offsets = {}
    for info in zf.infolist():
        off = entry_data_offset(info, lambda start, stop: blob[start:stop])
        assert off is not None and blob[off : off + info.file_size] == zf.read(info.filename), info.filename
        offsets[info.filename] = off
    sink = SparseSink()
    torch.save(obj, sink)
    written = dict(written_entries(sink.pieces, sink.read_at))
    assert written.keys() == offsets.keys()
    for name, off in written.items():  # the serialization id differs between the two saves, not the layout
        assert off == offsets[name], name


def test_sparse_sink_reads_back_what_was_written_later_writes_winning():
    """``read_at`` equals a plain byte buffer given the same writes and seeks (gaps read as zeros), also
    when pieces overlap, a long piece covers many short ones, and after more writes than it indexed."""
    import random

    from cpuckpt.format.record import SparseSink

    rng = random.Random(7)
    sink = SparseSink()
    ref = bytearray()
    for k in range(600):
        if k % 50 == 49:  # read while writing: the index is rebuilt after each write
            a = rng.randrange(len(ref) + 1)
            b = rng.randrange(a, len(ref) + 1)
            assert sink.read_at(a, b) == bytes(ref[a:b])
        pos = rng.randrange(len(ref) + 64) if k % 7 else 0  # seeks back (overwrites) and past the end (gaps)
        data = bytes(rng.randrange(256) for _ in range(rng.choice((1, 3, 40, 900))))
        sink.seek(pos)
        sink.write(data)
        if len(ref) < pos + len(data):
            ref.extend(bytes(pos + len(data) - len(ref)))
        ref[pos : pos + len(data)] = data
    assert sink.end == len(ref)
    for _ in range(300):
        a = rng.randrange(len(ref) + 1)
        b = rng.randrange(a, min(len(ref), a + 2000) + 1)
        assert sink.read_at(a, b) == bytes(ref[a:b]), (a, b)
    assert sink.read_at(0, len(ref)) == bytes(ref)


def test_zip_local_header_refuses_short_or_foreign_bytes():
    from cpuckpt.format.zipheader import LOCAL_HEADER, LOCAL_SIG, local_header

    header = LOCAL_HEADER.pack(LOCAL_SIG, 0, 0, 0, 0, 0, 0, 0, 0, 5, 7)
    assert local_header(header, 100) == (130, 135, 142)
    assert local_header(header[:29], 100) is None
    assert local_header(b"PK\x01\x02" + header[4:], 100) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_tensor_nbytes_matches_element_size(dtype):
    from cpuckpt.format.dtypes import tensor_nbytes

    for shape in SHAPES:
        t = torch.empty(shape, dtype=dtype)
        assert tensor_nbytes(dtype, shape) == t.numel() * t.element_size()
        assert tensor_nbytes(dtype, torch.Size(shape)) == t.numel() * t.element_size()
