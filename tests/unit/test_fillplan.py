"""Fill programs copy exactly the bytes ``fill_chunk`` copies segment by segment, over many random layouts.

Random records (skeletons, tensor data of random lengths, non-tensor payloads, aligned and packed),
random chunk sizes that cut records anywhere, some tensors copied afresh every save (placeholders),
and payloads that change between saves of the same layout. Plain RNG, no hypothesis.
"""

from __future__ import annotations

import dataclasses
import random
from array import array

import pytest
import torch

from cpuckpt.format.layout import FileLayout, LayoutItem, plan_files
from cpuckpt.transfer.fillplan import MIN_PIECES, RUN_BYTES, bind_programs, build_programs
from cpuckpt.transfer.staging import Slot, fill_chunk

N_CASES = 60


def _case(rng: random.Random) -> tuple[list[LayoutItem], list[torch.Tensor | None], set[int], dict]:
    items: list[LayoutItem] = []
    sources: list[torch.Tensor | None] = []
    payload_items: set[int] = set()
    for i in range(rng.choice([1, 5, 30, 120])):
        if rng.random() < 0.2:
            n = rng.choice([1, 17, 300, 5000])
            items.append(LayoutItem(data_nbytes=n, payload=rng.randbytes(n)))
            sources.append(None)
            payload_items.add(i)
            continue
        n = rng.choice([0, 1, 4, 48, 256, 1000, 3 * 4096 + 5, RUN_BYTES + 3])
        head, tail = rng.randbytes(rng.choice([0, 64, 700])), rng.randbytes(rng.choice([0, 300, 825]))
        items.append(LayoutItem(data_nbytes=n, head=head, tail=tail))
        sources.append(torch.randint(0, 256, (n,), dtype=torch.uint8))
    params = {"num_files": rng.choice([1, 2, 3]), "chunk_bytes": 512 * rng.choice([1, 3, 8, 64]),
              "align_bytes": 512, "align_data_min_bytes": rng.choice([0, 1000, 4096])}
    return items, sources, payload_items, params


def _fill_all(files, sources) -> list[bytes]:
    out = []
    for layout in files:
        for chunk in layout.chunks:
            buf = torch.full((chunk.nbytes,), 0xAB, dtype=torch.uint8)  # no byte may be left as it was
            fill_chunk(Slot(0, 1, buf, memoryview(buf.numpy())), layout, chunk, sources)
            out.append(bytes(buf.numpy()))
    return out


@pytest.mark.parametrize("seed", range(N_CASES))
def test_programs_fill_the_same_bytes_as_segments(seed: int) -> None:
    rng = random.Random(seed)
    items, sources, payload_items, params = _case(rng)
    files, _ = plan_files(items, **params)
    expected = _fill_all(files, sources)  # segment by segment: no programs yet
    dynamic = {i for i, s in enumerate(sources) if s is not None and rng.random() < 0.3}
    build_programs(files, sources, dynamic=dynamic, payload_items=payload_items)
    used = [p for f in files for p in (f.fill_programs or {}).values()]
    assert all(len(p.pieces) >= MIN_PIECES and p.device is None for p in used)

    # the next save: new bytes for the copied-afresh tensors and the payloads (same lengths), same layout
    fresh = list(sources)
    for i in dynamic:
        fresh[i] = torch.randint(0, 256, sources[i].shape, dtype=torch.uint8)  # type: ignore[union-attr]
    payloads = {i: torch.randint(0, 256, (items[i].data_nbytes,), dtype=torch.uint8) for i in payload_items}
    new_items = [LayoutItem(data_nbytes=it.data_nbytes, payload=bytes(payloads[i].numpy()))
                 if i in payload_items else it for i, it in enumerate(items)]
    plain, _ = plan_files(new_items, **params)  # the same layout, bound to the new payloads
    bound = bind_programs([_with_payload_segments(f, p) for f, p in zip(files, plain)], fresh, payloads)
    assert _fill_all(bound, fresh) == _fill_all(plain, fresh)
    if not dynamic and not payload_items:  # nothing to bind: the programs as built
        assert _fill_all(files, sources) == expected


def test_many_small_records_use_programs() -> None:
    """The case programs exist for: one chunk of many small records (one skeleton piece between two tensors)."""
    items = [LayoutItem(data_nbytes=256, head=b"H" * 300, tail=b"T" * 500) for _ in range(100)]
    sources = [torch.randint(0, 256, (256,), dtype=torch.uint8) for _ in items]
    files, _ = plan_files(items, num_files=1, chunk_bytes=1 << 20, align_bytes=512, align_data_min_bytes=0)
    expected = _fill_all(files, sources)
    build_programs(files, sources, dynamic=set(), payload_items=set())
    program = files[0].fill_programs[0]  # type: ignore[index]
    assert len(program.pieces) == 201 and len(program.runs) > 1
    assert _fill_all(files, sources) == expected
    sources[7].fill_(3)  # pieces are views: a later save copies the tensors' current bytes
    assert _fill_all(files, sources) == _fill_all([dataclasses.replace(files[0], fill_programs=None)], sources)


def _with_payload_segments(programmed: FileLayout, plain: FileLayout) -> FileLayout:
    """``programmed``'s programs over ``plain``'s segments (what a reusing save binds)."""
    return dataclasses.replace(plain, fill_programs=programmed.fill_programs)


def test_unbound_program_refuses_to_fill() -> None:
    items = [LayoutItem(data_nbytes=3, payload=b"abc")] + [LayoutItem(data_nbytes=4, head=b"h", tail=b"t")] * 9
    sources = [None] + [torch.arange(4, dtype=torch.uint8)] * 9
    files, _ = plan_files(items, num_files=1, chunk_bytes=4096, align_bytes=512, align_data_min_bytes=0)
    build_programs(files, sources, dynamic=set(), payload_items={0})
    program = files[0].fill_programs[0]  # type: ignore[index]
    with pytest.raises(RuntimeError, match="bind_programs"):
        program.fill(torch.empty(files[0].nbytes, dtype=torch.uint8))


@pytest.mark.parametrize("seed", range(0, N_CASES, 4))
def test_offload_ops_describe_exactly_the_device_bytes(seed: int) -> None:
    """The copy process's path (``memory.copy_process`` with a device snapshot): ``fill_chunk`` writes the host
    bytes and describes each run of a "device" source (here: views of one buffer, standing for the snapshot) as
    an op; applying the ops as the copy process does yields the same image as a fill segment by segment."""
    from cpuckpt.transfer.sinks import OP_FIELDS

    rng = random.Random(seed)
    items, sources, _, params = _case(rng)
    files, _ = plan_files(items, **params)
    expected = _fill_all(files, sources)
    on_device = {i for i, s in enumerate(sources) if s is not None and rng.random() < 0.5}
    views, snapshot = _snapshot_views(sources, on_device, 0)  # the rest stay host tensors
    images, ops = _segment_fill(files, views, snapshot.data_ptr())
    chunks = [c for layout in files for c in layout.chunks]
    for i in range(len(ops) // OP_FIELDS):  # as the copy process applies them
        k, src, f, dst, n = ops[i * OP_FIELDS : (i + 1) * OP_FIELDS]
        chunk = chunks[k]  # the copy process keys its events and checksums by chunk: the op must lie in it
        assert f == chunk.file and chunk.offset <= dst and dst + n <= chunk.offset + chunk.nbytes, (i, k, f, dst, n)
        images[f][dst : dst + n] = snapshot[src : src + n]
    got = [bytes(images[layout.index][c.offset : c.offset + c.nbytes].numpy())
           for layout in files for c in layout.chunks]
    assert got == expected
    assert (len(ops) > 0) == any(v.numel() for v in views if isinstance(v, _OnDevice))  # device bytes went as ops


class _OnDevice:
    """A source standing for a view of the device snapshot: the offload path only asks where its bytes are."""

    is_cuda = True

    def __init__(self, view: torch.Tensor) -> None:
        self.view = view

    def data_ptr(self) -> int:
        return self.view.data_ptr()

    def numel(self) -> int:
        return self.view.numel()


def _segment_fill(files, sources, base):
    """``fill_chunk`` as the save engine calls it for the copy process: the images with their host bytes written
    (0xAB where the ops' bytes go), and the ops of the device bytes."""
    from cpuckpt.transfer.staging import offload_ops

    ops = array("q")
    described = offload_ops(ops, base)
    images = [torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8) for layout in files]
    k = 0
    for layout in files:
        for chunk in layout.chunks:
            buf = images[layout.index][chunk.offset : chunk.offset + chunk.nbytes]
            pairs: list = []
            fill_chunk(Slot(0, 1, buf, memoryview(buf.numpy())), layout, chunk, sources, deferred=pairs,
                       described=described(k, layout.index))
            for dst, src in pairs:
                dst.copy_(src)
            k += 1
    return images, ops


def _offload_by_segments(files, sources, base):
    images, ops = _segment_fill(files, sources, base)
    return [bytes(i.numpy()) for i in images], list(ops)


def _offload_by_program(files, sources, base):
    ops = array("q")
    images = [torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8) for layout in files]
    first = 0
    for layout in files:
        program = layout.offload_program
        assert program is not None and program.applies(sources)
        img = images[layout.index]
        views = [img[c.offset : c.offset + c.nbytes] for c in layout.chunks]
        slots = [Slot(0, 1, v, memoryview(v.numpy())) for v in views]
        program.fill(slots, layout, sources)
        ops.frombytes(program.ops(sources, base, first))
        first += len(layout.chunks)
    return [bytes(i.numpy()) for i in images], list(ops)


def _snapshot_views(sources, on_device: set[int], gap: int, snapshot: torch.Tensor | None = None):
    """The device sources as views of one buffer (``gap`` bytes before each: where they lie changes with it)."""
    total = sum(s.numel() + gap for s in sources if s is not None)
    if snapshot is None:
        snapshot = torch.randint(0, 256, (total + 1,), dtype=torch.uint8)
    out, at = [], 0
    for i, s in enumerate(sources):
        if s is not None and i in on_device:
            at += gap
            snapshot[at : at + s.numel()] = s
            out.append(_OnDevice(snapshot[at : at + s.numel()]))
            at += s.numel()
        else:
            out.append(s)
    return out, snapshot


@pytest.mark.parametrize("seed", range(0, N_CASES, 3))
def test_offload_programs_write_and_describe_what_segments_do(seed: int) -> None:
    """A save repeating a layout with its device bytes copied by another process: the prepared program writes the
    same host bytes (skeletons, gaps, payloads, CPU tensors) and returns the same ops as ``fill_chunk``; in the next
    save (new payloads, new CPU bytes) too, and its ops follow the sources when they lie elsewhere in the buffer."""
    from cpuckpt.transfer.fillplan import build_offload_programs

    rng = random.Random(seed)
    items, sources, payload_items, params = _case(rng)
    files, _ = plan_files(items, **params)
    on_device = {i for i, s in enumerate(sources) if s is not None and rng.random() < 0.6}
    views, snapshot = _snapshot_views(sources, on_device, 0)
    base = snapshot.data_ptr()
    expected = _offload_by_segments(files, views, base)
    build_offload_programs(files, views, payload_items=payload_items)
    assert _offload_by_program(files, views, base) == expected

    # the next save: the same layout bound to new payloads, new bytes in the CPU tensors
    payloads = {i: rng.randbytes(items[i].data_nbytes) for i in payload_items}
    new_items = [LayoutItem(data_nbytes=it.data_nbytes, payload=payloads[i]) if i in payload_items else it
                 for i, it in enumerate(items)]
    plain, _ = plan_files(new_items, **params)
    bound = [dataclasses.replace(p, offload_program=f.offload_program) for f, p in zip(files, plain)]
    for i, s in enumerate(views):
        if isinstance(s, torch.Tensor):
            s.copy_(torch.randint(0, 256, s.shape, dtype=torch.uint8))
    assert _offload_by_program(bound, views, base) == _offload_by_segments(plain, views, base)
    program = next((f.offload_program for f in bound if f.offload_program.device), None)
    if program is not None:  # the sources lie where they did: the last save's ops, not built again
        assert program.ops(views, base, 0) is program.ops(views, base, 0)
        moved, snap2 = _snapshot_views(sources, on_device, 512)
        assert _offload_by_program(bound, moved, snap2.data_ptr()) == _offload_by_segments(plain, moved,
                                                                                           snap2.data_ptr())
        assert not program.applies([s.view if isinstance(s, _OnDevice) else s for s in moved])  # now on the host
        # the same buffer, the sources elsewhere in it: new ops, not the cached ones
        big = torch.zeros(snap2.numel() + 4096, dtype=torch.uint8)
        here, _ = _snapshot_views(sources, on_device, 0, big)
        there, _ = _snapshot_views(sources, on_device, 512, big)
        for views_now in (here, there, here):
            assert _offload_by_program(bound, views_now, big.data_ptr()) == _offload_by_segments(plain, views_now,
                                                                                                 big.data_ptr())
        # the ops of each buffer kept apart: two buffers alternating reuse their own ops
        a, b = program.ops(here, big.data_ptr(), 0), program.ops(moved, snap2.data_ptr(), 0)
        assert program.ops(here, big.data_ptr(), 0) is a and program.ops(moved, snap2.data_ptr(), 0) is b
        # the file's first chunk in another save's numbering
        shifted = array("q")
        shifted.frombytes(program.ops(here, big.data_ptr(), 5))
        plain_ops = array("q")
        plain_ops.frombytes(a)
        assert list(shifted[0::5]) == [k + 5 for k in plain_ops[0::5]] and list(shifted[1::5]) == list(plain_ops[1::5])
    hosted = [i for i in program_host_items(bound)]
    if hosted:  # a CPU source that is now on the device: not this program's save
        on_gpu = list(views)
        on_gpu[hosted[0]] = _OnDevice(views[hosted[0]])
        assert not all(f.offload_program.applies(on_gpu) for f in bound)


def program_host_items(files) -> list[int]:
    return [i for f in files for i in f.offload_program.host_items]


def test_offload_program_refuses_a_layout_without_its_payload() -> None:
    items = [LayoutItem(data_nbytes=3, payload=b"abc"), LayoutItem(data_nbytes=4, head=b"h", tail=b"t")]
    from cpuckpt.transfer.fillplan import build_offload_programs

    sources = [None, torch.arange(4, dtype=torch.uint8)]
    files, _ = plan_files(items, num_files=1, chunk_bytes=4096, align_bytes=512, align_data_min_bytes=0)
    build_offload_programs(files, sources, payload_items={0})
    emptied = dataclasses.replace(files[0], segments=[dataclasses.replace(files[0].segments[0], payload=b"")]
                                  + files[0].segments[1:])
    buf = torch.empty(files[0].nbytes, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="no payload"):
        files[0].offload_program.fill([Slot(0, 1, buf, memoryview(buf.numpy()))], emptied, sources)


def test_a_device_snapshot_save_drops_the_device_programs() -> None:
    """A device program gathers from views of the tensors its layout was prepared for: a save that copies from a
    device snapshot must not use it (the trainer writes those tensors once the snapshot is made); host programs stay,
    and a layout without device programs is passed as it is."""
    from cpuckpt.transfer.fillplan import FillProgram, without_device_programs

    host = FillProgram([torch.zeros(4, dtype=torch.uint8)], None)
    device = FillProgram([torch.zeros(4, dtype=torch.uint8)], torch.device("cuda", 0))  # only its device is read
    mixed = FileLayout(0, fill_programs={0: host, 1: device})
    only_device = FileLayout(1, fill_programs={0: device})
    plain = FileLayout(2, fill_programs={0: host})
    out = without_device_programs([mixed, only_device, plain])
    assert out[0].fill_programs == {0: host} and out[1].fill_programs is None and out[2] is plain
    assert mixed.fill_programs == {0: host, 1: device}  # the cached layout keeps them for saves without a snapshot
