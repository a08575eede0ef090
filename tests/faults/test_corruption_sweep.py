"""Damage sweep: every flipped byte, truncation, deletion, extension or swap of a data file is caught.

One real checkpoint (two data files, 64 KiB chunks) is damaged in place, one fault at a time, and
loaded with ``cpuckpt.load``. Every fault must raise ``CheckpointCorrupt`` whose message names the
damaged file and, for flips, a byte range ``[lo, hi)`` that contains the flipped offset. The
offsets are seeded (``CPUCKPT_SWEEP_SEED``); ``CPUCKPT_LONG_SWEEP=1`` flips 5x more bytes. By
default (``representative``) 40 seeded flips plus the flips at each file's chunk edges run; the
``full`` flip sweep (240) is ``slow`` (``-m slow`` or ``CPUCKPT_SLOW=1``).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import _helpers as H  # tests/dist is on sys.path (tests/conftest.py)
import pytest
import torch

import cpuckpt
from cpuckpt import CheckpointCorrupt, IntegrityError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SEED = int(os.environ.get("CPUCKPT_SWEEP_SEED", "20261129"))
NFLIPS = 1200 if os.environ.get("CPUCKPT_LONG_SWEEP") == "1" else 240
NFLIPS_REPRESENTATIVE = 40
CHUNK = 64 * 1024
CFG = {"io": {"chunk_bytes": CHUNK, "threads": 2, "backend": "buffered"}, "timeout_s": 30}
FILES = ["__0_0.distcp", "__0_1.distcp"]


def _sd() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randint(0, 256, (4 * 90_000,), generator=g, dtype=torch.uint8).view(torch.float32),
        "v": torch.randn(300, 301, generator=g),
        "h": torch.randn(999, generator=g).to(torch.bfloat16),
        "i": torch.randint(-5, 5, (3000,), generator=g),
        "step": 3,
        "note": "hello",
    }


def _targets(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("pristine") / "ckpt"
    sd = _sd()
    with H.files_per_rank(2):  # two files, as written before io.files_per_rank was removed
        cpuckpt.save(sd, path, CFG, step=3)
    assert sorted(p.name for p in path.glob("*.distcp")) == FILES
    out = _targets(sd)
    cpuckpt.load(out, path, CFG)
    assert _same(out, sd)
    return path, sd


def _same(out: dict, sd: dict) -> bool:
    """``out`` holds ``sd``'s tensors bit for bit (and its other values)."""
    return all(torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)) if isinstance(v, torch.Tensor)
               else out[k] == v for k, v in sd.items())


@contextlib.contextmanager
def _flipped(f: Path, off: int, mask: int) -> Iterator[None]:
    """Byte ``off`` of ``f`` XORed with ``mask`` for the block, restored after it."""
    with open(f, "r+b") as fh:
        fh.seek(off)
        old = fh.read(1)[0]
        fh.seek(off)
        fh.write(bytes([old ^ mask]))
    try:
        yield
    finally:
        with open(f, "r+b") as fh:
            fh.seek(off)
            fh.write(bytes([old]))


@pytest.fixture
def ckpt(pristine, tmp_path) -> tuple[Path, dict]:
    path, sd = pristine
    shutil.copytree(path, tmp_path / "ckpt")
    return tmp_path / "ckpt", sd


def _load_error(path: Path, sd: dict) -> CheckpointCorrupt | None:
    try:
        cpuckpt.load(_targets(sd), path, CFG)
    except CheckpointCorrupt as e:
        return e
    return None


@pytest.mark.parametrize("sweep", ["representative", pytest.param("full", marks=pytest.mark.slow)])
def test_flipped_bytes_are_all_detected(ckpt, capsys, sweep):
    path, sd = ckpt
    rng = random.Random(SEED)
    sizes = {n: (path / n).stat().st_size for n in FILES}
    total = sum(sizes.values())
    flips = []
    # offsets spread over both files in proportion to their size
    for _ in range(NFLIPS if sweep == "full" else NFLIPS_REPRESENTATIVE):
        x = rng.randrange(total)
        name = FILES[0] if x < sizes[FILES[0]] else FILES[1]
        flips.append((name, x if name == FILES[0] else x - sizes[FILES[0]], 1 << rng.randrange(8)))
    flips += [(n, off, 0xFF) for n in FILES for off in (0, CHUNK - 1, CHUNK, sizes[n] - 1)]
    missed, badmsg = [], []
    for name, off, mask in flips:
        f = path / name
        with _flipped(f, off, mask):
            err = _load_error(path, sd)
        if err is None:
            missed.append((name, off))
            continue
        m = re.search(r"\[(\d+), (\d+)\)", str(err))
        if str(f) not in str(err) or not m or not int(m.group(1)) <= off < int(m.group(2)):
            badmsg.append(f"{name}@{off}: {err}")
    with capsys.disabled():
        print(f"\ncorruption sweep ({sweep}, seed {SEED}): {len(flips)} single-byte flips in {len(FILES)} data files, "
              f"{len(flips) - len(missed)} detected, {len(missed)} missed, {len(badmsg)} unclear messages")
    assert len(flips) >= (200 if sweep == "full" else NFLIPS_REPRESENTATIVE)
    assert not missed, f"undetected flips: {missed}"
    assert not badmsg, "\n".join(badmsg[:5])
    cpuckpt.load(_targets(sd), path, CFG)  # restored: loads again


def test_flipped_bytes_of_the_metadata_are_all_detected(ckpt, capsys):
    """Every single-byte flip of ``.metadata`` fails the load with ``CheckpointCorrupt`` naming ``.metadata`` and
    makes the checkpoint incomplete: refused by the unpickler (or its structure check), or (a flip it still unpickles:
    a name, an offset, a size) by the crc32c the manifest recorded at the commit, or (a flip inside the save id: the
    manifest is then another save's) as a cpuckpt ``.metadata`` without its manifest. A flip that made the pickle
    another save's that is not cpuckpt's (none here) would read as stock, with the saved values. ``cpuckpt verify``
    reports every one as damage of ``.metadata`` (exit 1): before, most flips made it give up ("cannot verify", exit
    2) and one in the save id blamed the intact manifest."""
    from cpuckpt.backend.committed import check_complete, parse_metadata, read_manifest
    from cpuckpt.tools.verification import verify_checkpoint

    path, sd = ckpt
    save_id = read_manifest(path).save_id
    f = path / ".metadata"
    size = f.stat().st_size
    rng = random.Random(SEED + 3)
    flips = [(rng.randrange(size), 1 << rng.randrange(8)) for _ in range(NFLIPS_REPRESENTATIVE)]
    flips += [(0, 0xFF), (size // 2, 0x01), (size - 1, 0xFF)]
    missed, unclear, by_crc, renamed, not_named = [], [], 0, 0, []
    for off, mask in flips:
        with _flipped(f, off, mask):
            err = _load_error(path, sd)
            complete = check_complete(path).complete
            try:
                damage = verify_checkpoint(path).damage
            except cpuckpt.CpuckptError as e:
                damage = [e]
            if [getattr(d, "file", None) for d in damage] != [".metadata"]:
                not_named.append(f"@{off}: {damage}")
            if err is None and parse_metadata(f.read_bytes(), f).storage_meta.save_id != save_id:
                out = _targets(sd)
                cpuckpt.load(out, path, CFG)
                assert _same(out, sd), f"save id flipped @{off}: other values"
                renamed += 1
                continue
        if err is None or complete:
            missed.append((off, mask, err is None, complete))
        elif ".metadata" not in str(err):
            unclear.append(f"@{off}: {err}")
        by_crc += err is not None and "not the one committed with the manifest" in str(err)
    with capsys.disabled():
        print(f"\n.metadata sweep (seed {SEED + 3}): {len(flips)} single-byte flips of {size} bytes, "
              f"{len(flips) - len(missed) - renamed} detected ({by_crc} by its crc32c alone), {renamed} in the save id "
              f"(read as stock, the saved values), {len(missed)} missed")
    assert not missed, f"undetected flips (offset, mask, loaded, complete): {missed}"
    assert not unclear, "\n".join(unclear[:5])
    assert not not_named, "\n".join(not_named[:5])
    assert by_crc > 0  # some flips still unpickle: only the crc32c catches those
    cpuckpt.load(_targets(sd), path, CFG)  # restored: loads again


def test_truncated_deleted_extended_and_swapped_files_are_detected(ckpt, capsys):
    path, sd = ckpt
    rng = random.Random(SEED + 7)
    backup = path.parent / "backup"
    shutil.copytree(path, backup)
    cases = []
    for name in FILES:
        size = (path / name).stat().st_size
        for keep in sorted({0, 1, CHUNK, size - 1, *(rng.randrange(size) for _ in range(4))}):
            cases.append((f"truncate {name} to {keep}", name, lambda f, k=keep: os.truncate(f, k), str(keep)))
        cases.append((f"delete {name}", name, lambda f: f.unlink(), "missing"))
        cases.append((f"extend {name}", name, lambda f: f.open("ab").write(b"\0" * 3), str(size + 3)))
        other = FILES[1 - FILES.index(name)]
        cases.append((f"replace {name} with {other}", name,
                      lambda f, o=other: shutil.copy(backup / o, f), ""))
        zeroed = bytearray((backup / name).read_bytes())
        zeroed[CHUNK : CHUNK + 4096] = bytes(4096)  # a lost page: same size, zeros
        cases.append((f"zero a page of {name}", name, lambda f, z=bytes(zeroed): f.write_bytes(z), str(CHUNK)))
    missed = []
    for what, name, damage, fragment in cases:
        f = path / name
        damage(f)
        err = _load_error(path, sd)
        shutil.copy(backup / name, f)
        if err is None or str(f) not in str(err) or fragment not in str(err):
            missed.append(f"{what}: {err}")
    with capsys.disabled():
        print(f"\nfile damage sweep: {len(cases)} truncations/deletions/extensions/swaps/lost pages, "
              f"{len(cases) - len(missed)} detected naming file and offset, {len(missed)} missed")
    assert not missed, "\n".join(missed)


@pytest.mark.parametrize("damage", ["delete", "empty", "garbage", "flip-in-pickle"])
def test_damaged_metadata_is_refused(ckpt, damage):
    path, sd = ckpt
    md = path / ".metadata"
    if damage == "delete":
        md.unlink()
    elif damage == "empty":
        md.write_bytes(b"")
    elif damage == "garbage":
        md.write_bytes(os.urandom(256))
    else:
        raw = bytearray(md.read_bytes())
        raw[1] ^= 0xFF  # the pickle protocol / first opcode
        md.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError) as ei:
        cpuckpt.load(_targets(sd), path, CFG)
    assert str(path) in str(ei.value)
    assert cpuckpt.find_latest(path.parent) is None or damage not in ("delete", "empty")
