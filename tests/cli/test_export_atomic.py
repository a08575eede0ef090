"""``cpuckpt convert`` publishes an output only once it is complete, on real checkpoints (no mocks).

Regressions. A convert wrote the safetensors header (or the ``torch.save`` skeleton) at the final path and
filled the tensor bytes in place, so a convert that failed midway (a flipped byte in the source: checksum
mismatch, exit 2) left a file that loads as tensors of zeros; with ``--overwrite`` the previous good file was
truncated before anything was read; sharded, the shards written before the failure stayed. And a non-tensor
item named ``format`` replaced the safetensors header's ``"format": "pt"`` (transformers refuses such a file).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import cpuckpt
from cpuckpt.tools.cli import cli
from cpuckpt.tools.export import export_checkpoint

CFG = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}}
EXT = {"safetensors": "safetensors", "torch": "bin"}


def _run(*args: object) -> tuple[int, str]:
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.output


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    # Four 64 KiB tensors: with a 100 KB shard size, one per shard, "d" (the damaged one) in the last.
    return {"a": torch.randn(128, 128, generator=g), "b": torch.randn(128, 128, generator=g),
            "c": torch.randn(128, 128, generator=g), "d": torch.randn(128, 128, generator=g), "step": 200}


def _flip_byte_of(ckpt: Path, tensor: torch.Tensor) -> None:
    """Flip one byte inside ``tensor``'s data in the checkpoint's data file (as a bad disk would)."""
    (data,) = ckpt.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    pos = raw.index(tensor.numpy().tobytes())
    raw[pos + 1000] ^= 0x01
    data.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> tuple[Path, Path]:
    """(good, damaged): the same checkpoint twice, the second with a flipped byte in tensor ``d``."""
    root = tmp_path_factory.mktemp("r")
    cpuckpt.save(_state(), root / "step_200", CFG, step=200)
    shutil.copytree(root / "step_200", root / "damaged")
    _flip_byte_of(root / "damaged", _state()["d"])
    return root / "step_200", root / "damaged"


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_failed_convert_leaves_no_file(ckpts, tmp_path, fmt):
    """A checksum mismatch midway leaves nothing at OUT (it used to leave a loadable file of zeros), nor a
    temporary file beside it."""
    _, damaged = ckpts
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, out = _run("convert", damaged, "--to", fmt, out_dir / f"model.{EXT[fmt]}")
    assert code == 2 and "checksum mismatch" in out, out
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_failed_overwrite_keeps_the_previous_file(ckpts, tmp_path, fmt):
    """``--overwrite`` replaces an existing output only with a complete one: a failed convert leaves the
    previous file byte for byte (it used to be truncated before anything was read)."""
    good, damaged = ckpts
    target = tmp_path / f"model.{EXT[fmt]}"
    code, out = _run("convert", good, "--to", fmt, target)
    assert code == 0, out
    before = _snapshot(tmp_path)
    code, out = _run("convert", damaged, "--to", fmt, target, "--overwrite")
    assert code == 2 and "checksum mismatch" in out, out
    assert _snapshot(tmp_path) == before
    code, out = _run("convert", good, "--to", fmt, target, "--overwrite")  # and a complete one does replace it
    assert code == 0 and _snapshot(tmp_path) == before, out


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_failed_sharded_convert_publishes_no_shard_and_no_index(ckpts, tmp_path, fmt):
    """Sharded, the damage is in the last shard: the earlier, complete shards are not published either, no
    index appears, a directory the convert created is removed, and a previous output in the directory
    (``--overwrite``) is left as it was."""
    good, damaged = ckpts
    fresh = tmp_path / "fresh"
    code, out = _run("convert", damaged, "--to", fmt, "--max-shard-size", "100KB", fresh)
    assert code == 2 and "checksum mismatch" in out, out
    assert not fresh.exists()

    out_dir = tmp_path / "hf"
    code, out = _run("convert", good, "--to", fmt, "--max-shard-size", "100KB", out_dir)
    assert code == 0, out
    before = _snapshot(out_dir)
    assert len(before) == 5 and any(name.endswith(".index.json") for name in before), sorted(before)
    code, out = _run("convert", damaged, "--to", fmt, "--max-shard-size", "100KB", out_dir, "--overwrite")
    assert code == 2 and "checksum mismatch" in out, out
    assert _snapshot(out_dir) == before


def test_interrupt_removes_the_partial_file(ckpts, tmp_path):
    """Ctrl-C midway (raised here from the progress callback, after the first batch) removes the partial file
    and keeps the previous output."""
    good, _ = ckpts
    target = tmp_path / "model.safetensors"
    export_checkpoint(good, target, memory_budget_bytes=64 * 1024)
    before = _snapshot(tmp_path)

    def interrupt(nbytes: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(good, target, memory_budget_bytes=64 * 1024, progress=interrupt, overwrite=True)
    assert _snapshot(tmp_path) == before
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(good, tmp_path / "hf", fmt="torch", max_shard_bytes=100_000, progress=interrupt)
    assert _snapshot(tmp_path) == before


def test_safetensors_metadata_key_format_is_refused(tmp_path):
    """A non-tensor item named ``format`` would replace the header's ``"format": "pt"`` (and a tensor named
    ``__metadata__`` the header's metadata): refused, naming the key, before any file is written. ``--to torch``
    keeps ``format`` as an ordinary item."""
    from safetensors import safe_open

    src = tmp_path / "step_1"
    cpuckpt.save({"w": torch.ones(4), "format": "tf"}, src, CFG, step=1)
    target = tmp_path / "model.safetensors"
    code, out = _run("convert", src, "--to", "safetensors", target)
    assert code == 2 and "'format'" in out and "Traceback" not in out, out
    assert not target.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]

    code, out = _run("convert", src, "--to", "torch", tmp_path / "model.bin")
    assert code == 0 and torch.load(tmp_path / "model.bin", weights_only=True)["format"] == "tf", out

    ok = tmp_path / "ok"
    cpuckpt.save({"w": torch.ones(4), "meta": {"format": "tf"}}, ok, CFG, step=1)  # flattened: meta.format
    code, out = _run("convert", ok, "--to", "safetensors", target)
    assert code == 0, out
    with safe_open(target, "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and json.loads(meta["meta.format"]) == "tf"

    clash = tmp_path / "clash"
    cpuckpt.save({"__metadata__": torch.ones(4)}, clash, CFG, step=1)
    code, out = _run("convert", clash, "--to", "safetensors", tmp_path / "clash.safetensors")
    assert code == 2 and "'__metadata__'" in out and not (tmp_path / "clash.safetensors").exists(), out


def test_outputs_get_the_mode_a_plain_create_gives(ckpts, tmp_path):
    """Written under a private temporary file (mode 0600) and renamed, the outputs kept 0600; they must get what
    creating them directly gives (0666 less the umask), single and sharded."""
    good, _ = ckpts
    old = os.umask(0o022)
    try:
        code, out = _run("convert", good, "--to", "safetensors", tmp_path / "one.safetensors")
        assert code == 0, out
        code, out = _run("convert", good, "--to", "safetensors", "--max-shard-size", "100KB", tmp_path / "sharded")
        assert code == 0, out
    finally:
        os.umask(old)
    files = [tmp_path / "one.safetensors", *(tmp_path / "sharded").iterdir()]
    assert len(files) > 2 and {f.stat().st_mode & 0o777 for f in files} == {0o644}, files
