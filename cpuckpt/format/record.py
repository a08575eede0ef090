"""torch.save-compatible tensor records without pickling tensor data. Pure: no file I/O, no threads.

A record is what stock DCP stores per tensor: the bytes ``torch.save(tensor)`` produces, a small zip
archive holding a pickle, a few marker entries and the tensor's raw bytes, stored uncompressed. We
build the record *skeleton* (everything but the data) once per (dtype, shape), with ``torch.save``
under ``skip_data()`` into a sink that keeps the written pieces and skips the data region, then drop
the raw bytes in. ``torch.load(weights_only=True)`` reads the result bit-exact; it does not check the
zip CRC field of the data entry, which we therefore leave as ``torch.save`` wrote it.

The mirror, :func:`parse_record`, recognises a single-tensor record (ours or stock) from its zip
directory and pickle with a restricted unpickler, so a reader can take the data bytes in place.
"""

from __future__ import annotations

import bisect
import functools
import io
import logging
import pickle
import secrets
import struct
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from cpuckpt.format.dtypes import tensor_nbytes
from cpuckpt.format.zipheader import LOCAL_HEADER, LOCAL_SIG, entry_data_offset, written_entries

__all__ = ["RecordTemplate", "SparseSink", "TensorRecordInfo", "parse_record", "record_template"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecordTemplate:
    """Skeleton of one tensor record: ``head + <data_nbytes raw bytes> + tail``."""

    head: bytes
    tail: bytes
    data_nbytes: int

    @property
    def data_offset(self) -> int:
        """Offset of the raw tensor bytes from the start of the record."""
        return len(self.head)

    @property
    def record_nbytes(self) -> int:
        return len(self.head) + self.data_nbytes + len(self.tail)


class SparseSink(io.RawIOBase):
    """A seekable write-only stream that keeps written pieces and leaves skipped ranges unwritten."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[tuple[int, bytes]] = []
        self.pos = 0
        self.end = 0
        self._index: tuple[list[int], list[tuple[int, int, bytes]], int] | None = None  # see ``read_at``

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        if data:
            self.pieces.append((self.pos, data))
            self._index = None
        self.pos += len(data)
        self.end = max(self.end, self.pos)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.end + offset
        self.end = max(self.end, self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read_at(self, start: int, stop: int) -> bytes:
        """Bytes [start, stop) as written (a later write over an earlier one wins); unwritten gaps read as zeros.

        The pieces are indexed by offset once (after the last write), so reading every entry name of an
        archive of thousands of pieces is not quadratic (it had cost ~0.5 ms per read at 1,000 pieces).
        """
        if self._index is None:
            order = sorted((pos, seq, data) for seq, (pos, data) in enumerate(self.pieces))
            self._index = ([p for p, _, _ in order], order, max((len(d) for _, _, d in order), default=0))
        starts, order, longest = self._index
        found = order[bisect.bisect_left(starts, start - longest + 1) : bisect.bisect_left(starts, stop)]
        out = bytearray(stop - start)
        for pos, _, data in sorted(found, key=lambda e: e[1]):  # in write order
            lo, hi = max(pos, start), min(pos + len(data), stop)
            if lo < hi:
                out[lo - start : hi - start] = data[lo - pos : hi - pos]
        return bytes(out)


@lru_cache(maxsize=65536)
def record_template(dtype: torch.dtype, shape: tuple[int, ...]) -> RecordTemplate:
    """Return the (cached) skeleton of a contiguous CPU tensor record of this dtype and shape.

    Built by our own zip writer around torch's own tensor pickle (~30 us per new (dtype, shape)).
    The first call checks it against ``torch.save`` under ``skip_data`` byte for byte (all but the
    random serialization id); should a torch version write differently, every skeleton is taken
    from ``torch.save`` instead (~0.2 ms each), so files stay exactly what stock torch writes.
    """
    if _fast_matches_torch():
        return _fast_template(dtype, shape)
    return _torch_template(dtype, shape)


def _torch_template(dtype: torch.dtype, shape: tuple[int, ...]) -> RecordTemplate:
    """The skeleton as ``torch.save`` writes it, data region skipped (never materialised)."""
    nbytes = tensor_nbytes(dtype, shape)
    # torch.empty only reserves address space for large shapes; skip_data never reads it.
    proto = torch.empty(shape, dtype=dtype)
    sink = SparseSink()
    with torch.serialization.skip_data():
        torch.save(proto, sink)
    del proto
    data_start = _data_start(sink, nbytes)
    data_end = data_start + nbytes
    if nbytes and any(p < data_end and p + len(d) > data_start for p, d in sink.pieces):
        raise RuntimeError(f"torch.save wrote into the data region of a {dtype} {shape} skeleton")
    return RecordTemplate(
        head=sink.read_at(0, data_start), tail=sink.read_at(data_end, sink.end), data_nbytes=nbytes
    )


# ------------------------------------------------------------------------- our own record writer
# torch.save's archive: entries stored uncompressed, each local header carrying an "FB" extra field
# that pads its data to a 64-byte boundary, sizes and CRC in a data descriptor (flag bit 3), then
# the central directory, a zip64 end record and locator, and the classic end record.

_ALIGN = 64
_DESC = struct.Struct("<4sIII")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<4sQHHIIQQQQ")
_ZIP64_LOC = struct.Struct("<4sIQI")
_END = struct.Struct("<4sHHHHIIH")
_FLAGS = 0x0808
_SMALL_ENTRIES_BEFORE = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))


class _TensorPickler(pickle.Pickler):
    """Pickles a tensor exactly as torch.save does, naming its single storage '0' on 'cpu'."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            return ("storage", getattr(torch, obj._pickle_storage_type()), "0", "cpu", obj._size())
        if isinstance(obj, torch.UntypedStorage):
            return ("storage", torch.UntypedStorage, "0", "cpu", obj.nbytes())
        return None


def _entry(out: bytearray, central: list[bytes], name: str, data: bytes | None, nbytes: int, crc: int, *,
           base: int = 0) -> None:
    """Append a local entry to ``out``, whose first byte is at file offset ``base``; ``data`` None leaves
    an ``nbytes`` hole (the tensor's bytes)."""
    raw = f"archive/{name}".encode()
    offset = base + len(out)
    pad = -(offset + LOCAL_HEADER.size + len(raw) + 4) % _ALIGN
    flags = _FLAGS if nbytes else _FLAGS & ~0x8  # miniz clears "descriptor follows" for empty entries
    out += LOCAL_HEADER.pack(LOCAL_SIG, 0, flags, 0, 0, 0, 0, 0, 0, len(raw), 4 + pad)
    out += raw + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    if data is not None:
        out += data
    central.append(_CENTRAL.pack(b"PK\x01\x02", 0, 0, flags, 0, 0, 0, crc, nbytes, nbytes, len(raw), 0, 0, 0,
                                 0, 0, offset) + raw)


def _stored(out: bytearray, central: list[bytes], name: str, data: bytes, *, base: int = 0) -> None:
    """Append an entry holding ``data``, then its data descriptor (sizes and CRC)."""
    crc = zlib.crc32(data)
    _entry(out, central, name, data, len(data), crc, base=base)
    out += _DESC.pack(b"PK\x07\x08", crc, len(data), len(data))


def _fast_template(dtype: torch.dtype, shape: tuple[int, ...]) -> RecordTemplate:
    nbytes = tensor_nbytes(dtype, shape)
    if nbytes >= 0xFFFFFFFF:  # zip64 sizes: leave those rare giants to torch.save
        return _torch_template(dtype, shape)
    buf = io.BytesIO()
    _TensorPickler(buf, protocol=2).dump(torch.empty(shape, dtype=dtype))
    pkl = buf.getvalue()
    head = bytearray()
    central: list[bytes] = []
    _stored(head, central, "data.pkl", pkl)
    for name, data in _SMALL_ENTRIES_BEFORE:
        _stored(head, central, name, data)
    _entry(head, central, "data/0", None, nbytes, 0)
    # The tail is laid out as if it followed the data: offsets count the data bytes.
    # miniz writes no data descriptor after an empty entry
    tail = bytearray(_DESC.pack(b"PK\x07\x08", 0, nbytes, nbytes) if nbytes else b"")
    base = len(head) + nbytes
    for name, data in (("version", b"3\n"), (".data/serialization_id", _serialization_id())):
        _stored(tail, central, name, data, base=base)
    cd_offset = base + len(tail)
    cd = b"".join(central)
    n = len(central)
    tail += cd
    z64 = base + len(tail)
    tail += _ZIP64_END.pack(b"PK\x06\x06", 44, 0x031E, 0x2D, 0, 0, n, n, len(cd), cd_offset)
    tail += _ZIP64_LOC.pack(b"PK\x06\x07", 0, z64, 1)
    tail += _END.pack(b"PK\x05\x06", 0, 0, n, n, len(cd), cd_offset if cd_offset < 0xFFFFFFFF else 0xFFFFFFFF, 0)
    return RecordTemplate(head=bytes(head), tail=bytes(tail), data_nbytes=nbytes)


def _serialization_id() -> bytes:
    return f"{secrets.randbits(128):040d}".encode()


@lru_cache(maxsize=1)
def _fast_matches_torch() -> bool:
    """Does our writer produce what this torch's ``torch.save`` produces (serialization id aside)?"""
    for dtype, shape in ((torch.float32, (3, 4)), (torch.bfloat16, ()), (torch.float8_e4m3fn, (5,)),
                         (torch.bool, (0, 2))):
        ours, theirs = _fast_template(dtype, shape), _torch_template(dtype, shape)
        if ours.head != theirs.head or _mask_id(ours.tail) != _mask_id(theirs.tail):
            logger.warning("record skeletons: this torch writes a different archive; using torch.save (slower)")
            return False
    return True


def _mask_id(tail: bytes) -> bytes:
    """Blank the 40-digit serialization id and every CRC field that depends on it."""
    i = tail.find(b"archive/.data/serialization_id")
    if i < 0:
        return tail
    masked = bytearray(tail)
    j = tail.index(b"FB", i) + 4
    j += struct.unpack_from("<H", tail, j - 2)[0]
    masked[j : j + 40] = b"0" * 40
    masked[j + 44 : j + 48] = b"\0" * 4  # descriptor CRC
    k = tail.rfind(b"PK\x01\x02", 0, tail.rfind(b"archive/.data/serialization_id"))
    masked[k + 16 : k + 20] = b"\0" * 4  # central directory CRC
    return bytes(masked)


def _data_start(sink: SparseSink, nbytes: int) -> int:
    """Find where the storage's bytes begin: the local header named ``*/data/<key>``."""
    for name, data_start in written_entries(sink.pieces, sink.read_at):
        if "/data/" in name and not name.rsplit("/", 1)[-1].startswith("."):
            return data_start
    raise RuntimeError(f"no storage entry found in a torch.save skeleton ({nbytes} data bytes)")


# ----------------------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class TensorRecordInfo:
    """Where a single-tensor record keeps its bytes, and how to view them."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements
    data_offset: int  # bytes from the record start to the storage's first byte
    storage_nbytes: int
    data_crc32: int = 0  # the data entry's zip CRC-32 (0 in cpuckpt's own records: FORMAT.md 3.2)


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype | None
    numel: int


@dataclass(frozen=True)
class _TensorDesc:
    storage: _StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _rebuild_v2(storage, offset, size, stride, requires_grad, hooks, metadata=None):
    if storage.dtype is None:
        raise pickle.UnpicklingError("untyped storage without a dtype")
    return _TensorDesc(storage, offset, tuple(size), tuple(stride), storage.dtype)


def _rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    return _TensorDesc(storage, offset, tuple(size), tuple(stride), dtype)


# Legacy typed storage classes named in tensor pickles (read by name: touching them warns).
_TYPED_STORAGES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


class _StorageType:
    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype


class _RecordUnpickler(pickle.Unpickler):
    """Allows only what a plain tensor's pickle needs; anything else means 'not a layout we know'."""

    def find_class(self, module: str, name: str) -> Any:
        # A fresh callable per pickle: BUILD on a global changes the object itself, and ours would stay changed
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return functools.partial(_rebuild_v2)
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return functools.partial(_rebuild_v3)
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageType(None)
        if module == "torch" and name in _TYPED_STORAGES:
            return _StorageType(_TYPED_STORAGES[name])
        if module == "torch" and name == "UntypedStorage":
            return _StorageType(None)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a tensor record")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, stype, key, _location, numel = pid
        dtype = stype.dtype if isinstance(stype, _StorageType) else None
        return _StorageRef(str(key), dtype, int(numel))


def parse_record(record: bytes | bytearray | memoryview) -> TensorRecordInfo | None:
    """Describe a single-tensor, uncompressed torch.save record, or return None if it is not one.

    Never executes pickled code: only the few globals of a plain tensor pickle are resolved.
    None means "use torch.load(weights_only=True) on the whole record instead".
    """
    buf = bytes(record) if not isinstance(record, bytes) else record
    try:
        zf = zipfile.ZipFile(io.BytesIO(buf))
        infos = {i.filename: i for i in zf.infolist()}
        pkl_name = next((n for n in infos if n.endswith("/data.pkl")), None)
        if pkl_name is None:
            return None
        prefix = pkl_name[: -len("data.pkl")]
        desc = _RecordUnpickler(io.BytesIO(zf.read(pkl_name))).load()
    except Exception:  # any damage (bad zip, unknown compression, hostile pickle, ...) means "not ours"
        return None
    if not isinstance(desc, _TensorDesc) or not isinstance(desc.dtype, torch.dtype):
        return None
    info = infos.get(f"{prefix}data/{desc.storage.key}")
    if info is None or info.compress_type != zipfile.ZIP_STORED:
        return None
    data_offset = entry_data_offset(info, lambda start, stop: buf[start:stop])
    if data_offset is None or data_offset + info.file_size > len(buf):
        return None
    return TensorRecordInfo(
        dtype=desc.dtype,
        shape=desc.shape,
        stride=desc.stride,
        storage_offset=desc.offset,
        data_offset=data_offset,
        storage_nbytes=info.file_size,
        data_crc32=info.CRC,
    )
