"""Fixtures for object-storage tests: a real S3 server (SeaweedFS ``weed mini``) on 127.0.0.1.

``s3_server``: one server per test worker (session scope; pytest-xdist gives each worker its own session, and
each server its own free ports and data directory), shared by the tests that only need a bucket. Tests that
kill or restart the server take ``own_s3_server`` (a server of their own). ``s3_url`` is a fresh prefix in the
shared server's bucket, and ``s3_env`` sets the AWS variables (endpoint, credentials, region) for this process;
rank processes get the same variables through ``run_ranks(env=...)``. A missing ``weed`` binary fails the
test with the install hint: nothing here skips.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpuckpt.testing.seaweed import SeaweedServer


def _running(directory: Path) -> Iterator[SeaweedServer]:
    server = SeaweedServer(directory)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    yield from _running(tmp_path_factory.mktemp("seaweed"))


@pytest.fixture
def own_s3_server(tmp_path: Path) -> Iterator[SeaweedServer]:
    yield from _running(tmp_path / "seaweed")


@pytest.fixture
def s3_env(s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The shared server's AWS variables, set in this process (and to hand to ``run_ranks(env=...)``)."""
    env = s3_server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def s3_url(s3_server: SeaweedServer) -> str:
    """A prefix in the shared server's bucket that no other test uses."""
    return f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
