"""Throttling (S3's ``503 SlowDown``), against the real server behind a throttling proxy
(``cpuckpt.testing.throttle``: real HTTP on 127.0.0.1, the server's own answers for everything it does not
throttle).

- A few throttled part uploads: the client retries them with backoff, each one is logged naming the object and
  the attempt, the save succeeds within its bounds and loads bit-exact.
- Throttling that outlasts ``s3.max_attempts``: the save fails on both ranks with the same ``StorageIOError``
  (``EAGAIN``) that says *throttled* and names the object, within seconds; nothing is committed and no
  multipart upload is left behind.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Iterator

import pytest
import torch

from cpuckpt.testing.throttle import ThrottlingProxy

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
CFG = {"io": {"chunk_bytes": "5MiB", "threads": 2}, "s3": {"max_attempts": 3}, "timeout_s": 60}


def _state(seed: int, rank: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"w{rank}": torch.randn(3 * MiB, generator=g), f"b{rank}": torch.arange(100) + seed}  # 12 MiB: 3 parts


@pytest.fixture
def proxy(s3_server) -> Iterator[ThrottlingProxy]:
    p = ThrottlingProxy(s3_server.endpoint, n=0)
    p.start()
    try:
        yield p
    finally:
        p.stop()


def _via(proxy: ThrottlingProxy, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    return env


def test_a_few_throttled_parts_are_retried_and_logged(s3_server, s3_env, s3_url, proxy, monkeypatch, caplog):
    import cpuckpt
    from cpuckpt.paths import S3Url

    _via(proxy, s3_env, monkeypatch)
    proxy.remaining = 2
    state = _state(1)
    caplog.set_level(logging.WARNING, logger="cpuckpt.transfer.objstore")
    t0 = time.monotonic()
    cpuckpt.save(state, s3_url, CFG, step=1)
    assert time.monotonic() - t0 < 30
    assert proxy.throttled == 2 and proxy.remaining == 0
    warned = [r.getMessage() for r in caplog.records if "throttled" in r.getMessage()]
    assert len(warned) == 2, warned
    for line in warned:
        assert line.startswith(f"UploadPart {s3_url}/__0_0.distcp throttled by {proxy.endpoint} (SlowDown, HTTP "
                               "503) on attempt "), line
        assert line.endswith("of 3: retrying with backoff"), line
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    cpuckpt.load(out, s3_url, CFG)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert s3_server.store().list_uploads(S3Url.parse(s3_url)) == []


def rank_save(url: str) -> tuple[str, str, int | None] | None:
    import torch.distributed as dist

    import cpuckpt

    try:
        cpuckpt.save(_state(2, dist.get_rank()), url, {**CFG, "s3": {"max_attempts": 2}}, step=2)
    except cpuckpt.CpuckptError as e:
        return type(e).__name__, str(e), getattr(e, "errno", None)
    return None


def test_throttling_past_the_attempts_fails_on_every_rank(run_ranks, s3_server, s3_env, s3_url, proxy,
                                                          monkeypatch):
    import cpuckpt
    from cpuckpt.paths import S3Url

    env = _via(proxy, s3_env, monkeypatch)
    proxy.remaining = None  # every part upload, every attempt
    t0 = time.monotonic()
    results = run_ranks(2, rank_save, s3_url, env=env, timeout_s=120)
    took = time.monotonic() - t0
    assert results[0] is not None and results[0] == results[1], results  # one error, the same on both ranks
    name, message, err = results[0]
    assert name == "StorageIOError" and err == errno.EAGAIN, results
    assert f"{s3_url}/__" in message and ".distcp: throttled by " in message, message
    assert "(SlowDown, HTTP 503) on 2 attempt(s) with backoff (s3.max_attempts is 2)" in message, message
    assert took < 60, took
    assert proxy.throttled >= 4  # each rank's first part, twice
    store = s3_server.store()
    prefix = S3Url.parse(s3_url)
    assert store.head(prefix / ".metadata") is None
    assert store.list_uploads(prefix) == [], "the failed save left a multipart upload"
    assert [c for c in cpuckpt.list_checkpoints(s3_url.rsplit("/", 1)[0]) if str(c.path) == s3_url
            and c.complete] == []
