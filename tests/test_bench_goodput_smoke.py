"""benchmarks/bench_goodput.py without a GPU: its log arithmetic and its command lines (asserting no speed)."""

from __future__ import annotations

from benchmarks import bench_goodput


def test_self_test_arithmetic():
    assert bench_goodput.self_test() == 0


def test_dry_run_prints_every_variant(capsys, tmp_path):
    assert bench_goodput.main(["--dry-run", "--out", str(tmp_path), "--floor", "overlap_floor.py"]) == 0
    out = capsys.readouterr().out
    for name in bench_goodput.VARIANTS:
        assert f"# {name}\n" in out
    assert "--non-persistent-save-interval 1 " in out and "--non-persistent-save-interval 8 " in out
    assert "# floor" in out
