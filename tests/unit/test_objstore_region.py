"""The client's region follows ``s3.region``, then ``AWS_REGION``, then botocore's own (``AWS_DEFAULT_REGION``, the
config file), then ``us-east-1``: botocore alone ignores ``AWS_REGION``, which the docs say is honoured."""

from __future__ import annotations

import pytest

from cpuckpt.config import S3Config
from cpuckpt.transfer.objstore import S3Store


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> pytest.MonkeyPatch:
    for k in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    return monkeypatch


def _region(cfg: S3Config) -> tuple[str, str]:
    store = S3Store(cfg, threads=1, credentials=("k", "s"))
    return store.region, store._client.meta.region_name


def test_aws_region_is_honoured(clean_env):
    cfg = S3Config(endpoint_url="http://127.0.0.1:9")
    assert _region(cfg) == ("us-east-1", "us-east-1")
    clean_env.setenv("AWS_DEFAULT_REGION", "eu-central-1")
    assert _region(cfg) == ("eu-central-1", "eu-central-1")
    clean_env.setenv("AWS_REGION", "eu-west-3")
    assert _region(cfg) == ("eu-west-3", "eu-west-3")
    assert _region(S3Config(endpoint_url="http://127.0.0.1:9", region="ap-south-1")) == ("ap-south-1", "ap-south-1")
