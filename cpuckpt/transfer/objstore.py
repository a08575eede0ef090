"""Object storage: the :class:`ObjectStore` seam and its one implementation over S3 (boto3). Nothing else in
cpuckpt imports the client library.

Why boto3 (``benchmarks/bench_s3_clients.py``, 512 MiB in 32 MiB parts on 4 threads against the local
SeaweedFS on the 2-core box, median of 3): PUT boto3 0.168 GB/s, obstore 0.185, s3torchconnectorclient
0.162; ranged GET boto3 0.852, obstore 0.909, s3torchconnectorclient 0.442. The server bounds the PUTs, and
boto3 is within 10 % of the best on both. It is the only one of the three whose API has what the commit
protocol needs: parts uploaded by number from any thread (our chunks, from our staged slots, in any order),
an upload aborted by its id, multipart uploads listed (``cpuckpt clean``), and a conditional PUT
(``If-None-Match: *``). obstore has no part-level upload or listing of uploads; the CRT client has neither
conditional PUTs nor part-level uploads.

Endpoint, region and credentials follow the AWS conventions (boto3's own: ``AWS_ENDPOINT_URL_S3``,
``AWS_ENDPOINT_URL``, ``AWS_REGION``, the credential chain); ``s3.endpoint_url`` and ``s3.region`` override the
first two. Every failure becomes a :class:`StorageIOError` naming the ``s3://`` URL, with an errno that says
what kind (``ENOENT`` missing object or bucket, ``EACCES`` refused credentials, ``EEXIST`` a conditional PUT
that lost, ``ECONNREFUSED`` no server, ``EAGAIN`` throttled on every attempt, ``EIO`` anything else); the
client's own retries (``s3.max_attempts``, with backoff) run first.

Throttling (S3's ``503 SlowDown`` and its kin): botocore's standard retries retry it, waiting
``rand(0, 1) * min(2 ** (attempt - 1), 20)`` s before each retry, so one request waits at most about
``20 * (s3.max_attempts - 1)`` s in all, and a save stays bounded by ``timeout_s`` besides. Each throttled answer
is logged (WARNING, naming the object, the attempt and whether the client retries) and counted
(:attr:`S3Store.throttled`); when the throttling outlasts the attempts (or the client's retry quota), the error
says *throttled* and names the object and the attempts made.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from cpuckpt.config import S3Config
from cpuckpt.errors import ConfigError, StorageIOError
from cpuckpt.paths import S3Url
from cpuckpt.transfer.threads import run_parallel

__all__ = ["ObjectInfo", "ObjectReads", "ObjectStore", "S3Store", "Upload", "open_store", "upload_file"]

logger = logging.getLogger(__name__)

PART_MIN_BYTES = 5 << 20  # S3: every part but the last of a multipart upload has at least 5 MiB
PARTS_MAX = 10_000  # S3: at most 10,000 parts per upload


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    nbytes: int
    mtime: float


@dataclass(frozen=True)
class Upload:
    """A multipart upload in progress (``create_upload``)."""

    url: S3Url
    upload_id: str
    initiated: float = 0.0  # unix time the upload was started (from a listing; 0 when unknown)


class ObjectStore(Protocol):
    """What cpuckpt asks of an object store. Methods may be called from any thread; each call is bounded by the
    client's timeouts and retries. Every failure raises :class:`StorageIOError` naming the URL."""

    def put(self, url: S3Url, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        """Write a whole object. ``if_absent``: only if no object exists there (``If-None-Match: *``); returns
        False when one did (nothing written), True when written."""
        ...

    def get(self, url: S3Url) -> bytes | None:
        """A whole object's bytes, None when it does not exist."""
        ...

    def get_into(self, url: S3Url, offset: int, out: memoryview) -> int:
        """Read bytes ``[offset, offset + len(out))`` into ``out`` (a ranged GET); returns how many arrived
        (fewer at the end of the object)."""
        ...

    def head(self, url: S3Url) -> ObjectInfo | None:
        """Size and modification time of an object, None when it does not exist."""
        ...

    def list(self, prefix: S3Url) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix.key`` (keys in lexicographic order)."""
        ...

    def list_dirs(self, prefix: S3Url) -> list[str]:
        """The names of the "directories" directly under ``prefix`` (common prefixes at ``/``)."""
        ...

    def delete(self, url: S3Url) -> None:
        """Delete an object (no error when it is missing)."""
        ...

    def create_upload(self, url: S3Url) -> Upload: ...

    def upload_part(self, upload: Upload, number: int, data: memoryview) -> str:
        """Upload part ``number`` (1-based) from ``data``; returns its ETag. Any thread, any order."""
        ...

    def complete_upload(self, upload: Upload, etags: list[str]) -> None:
        """Make the object of parts 1..len(etags) visible."""
        ...

    def abort_upload(self, upload: Upload) -> None:
        """Discard an upload's parts (no error when it is gone)."""
        ...

    def list_uploads(self, prefix: S3Url) -> list[Upload]:
        """Multipart uploads in progress under ``prefix`` (a killed save's, for ``cpuckpt clean``)."""
        ...

    def check_bucket(self, url: S3Url) -> None:
        """Raise a :class:`StorageIOError` saying why when the bucket cannot be used (missing, refused)."""
        ...


class _PartReader:
    """A read-only file over a slot's bytes: boto3 takes bytes or a file as a body, never a memoryview.

    botocore reads it to checksum and to send; each ``read`` returns a copy of the bytes asked for (a
    memcpy, ~1 % of a part's upload time at the local server's speed).
    """

    def __init__(self, view: memoryview) -> None:
        self._view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self._pos = 0

    def read(self, n: int | None = -1) -> bytes:
        end = len(self._view) if n is None or n < 0 else min(self._pos + n, len(self._view))
        out = bytes(self._view[self._pos:end])
        self._pos = end
        return out

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, min(base + pos, len(self._view)))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


# botocore parses its service models (~3 MB of JSON, ~0.25 s on the 2-core box) once per session; sessions
# are per store (credentials are resolved per session, so a changed environment is seen by the next store),
# and they share this one loader: the models are parsed once per process.
_LOADER: Any = None
_LOADER_LOCK = threading.Lock()


def _session(credentials: tuple[str, str] | None) -> Any:
    global _LOADER
    import boto3
    import botocore.loaders
    import botocore.session

    with _LOADER_LOCK:
        if _LOADER is None:
            _LOADER = botocore.loaders.create_loader()
        core = botocore.session.Session()
        core.register_component("data_loader", _LOADER)
    key, secret = credentials or (None, None)
    return boto3.session.Session(key, secret, botocore_session=core)


_NOT_FOUND = {"NoSuchKey", "NotFound", "404"}


def _code(e: Any) -> str:
    """A botocore ``ClientError``'s error code (the HTTP status as a string when the response had no body)."""
    err = e.response.get("Error", {})
    return str(err.get("Code") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
# The error codes with which S3 and S3-compatible servers ask a client to slow down (S3's is SlowDown, HTTP 503).
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
              "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded",
              "BandwidthLimitExceeded"}


def _throttled(code: str, status: int | None) -> bool:
    return code in _THROTTLED or status in (429, 503)


_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "InvalidToken", "ExpiredToken"}


class S3Store:
    """:class:`ObjectStore` over boto3 (one client per store; boto3 clients are thread-safe).

    Args:
        cfg: the ``s3`` config section.
        threads: requests this process runs at once through the store (sizes the connection pool).
        credentials: (access key id, secret) for tools that hold their own (the test server); None, as
            every checkpoint path uses: the AWS credential chain.
    """

    def __init__(self, cfg: S3Config, *, threads: int = 16, credentials: tuple[str, str] | None = None) -> None:
        try:
            import botocore.config
            import botocore.exceptions
            session = _session(credentials)
        except ImportError as e:
            raise ConfigError(f"s3:// checkpoints need boto3: pip install 'cpuckpt[s3]' ({e})") from e
        self._exc = botocore.exceptions
        # botocore reads AWS_DEFAULT_REGION only; AWS_REGION (what the AWS SDKs and our docs name) is read here.
        self.region = cfg.region or os.environ.get("AWS_REGION") or session.region_name or "us-east-1"
        self.endpoint = cfg.endpoint_url or None  # None: boto3 reads AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
        client_cfg = botocore.config.Config(
            s3={"addressing_style": "path" if cfg.path_style else "virtual"},
            # total_max_attempts counts the first request too (botocore's max_attempts counts only retries).
            retries={"total_max_attempts": cfg.max_attempts, "mode": "standard"},
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.read_timeout_s,
            max_pool_connections=max(threads, 10),
            # A checksum only when an operation requires one: parts are checked by our crc32c at load, and
            # S3-compatible servers differ in which flexible checksums they accept.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._client = session.client("s3", region_name=self.region, endpoint_url=self.endpoint, config=client_cfg)
        self._lock = threading.Lock()
        self.max_attempts = cfg.max_attempts
        self.path_style = cfg.path_style
        self.throttled = 0  # throttled answers seen (retried or not)
        # After botocore's own retry handler (which decides whether to retry): watches, never decides.
        self._client.meta.events.register_last("needs-retry.s3", self._on_needs_retry)

    def _on_needs_retry(self, response: Any = None, attempts: int = 0, request_dict: Any = None,
                        operation: Any = None, **_: Any) -> None:
        """Log and count a throttled answer, so throttling that the client's retries absorb is still seen."""
        if response is None:
            return None
        http, parsed = response
        err = (parsed or {}).get("Error", {})
        code, status = str(err.get("Code", "")), getattr(http, "status_code", None)
        if not _throttled(code, status):
            return None
        with self._lock:
            self.throttled += 1
        meta = (parsed or {}).get("ResponseMetadata", {})
        if meta.get("RetryQuotaReached"):
            then = "not retried: the client's retry quota is spent"
        elif attempts < self.max_attempts:
            then = "retrying with backoff"
        else:
            then = "not retried: s3.max_attempts reached"
        logger.warning("%s %s throttled by %s (%s, HTTP %s) on attempt %d of %d: %s",
                       getattr(operation, "name", "request"), self._object_of(request_dict), self._endpoint_name(),
                       code or "no code", status, attempts, self.max_attempts, then)
        return None

    def _object_of(self, request_dict: Any) -> str:
        """The ``s3://bucket/key`` a botocore request is about (from its URL)."""
        try:
            parts = urllib.parse.urlsplit(request_dict["url"])
        except (KeyError, TypeError, ValueError):
            return "?"
        path = urllib.parse.unquote(parts.path).lstrip("/")
        if not self.path_style and parts.hostname:  # virtual-hosted: the bucket is the host's first label
            path = f"{parts.hostname.split('.', 1)[0]}/{path}"
        return f"s3://{path}"

    # -- errors ------------------------------------------------------------------------------------
    def _error(self, e: Exception, what: str, url: S3Url | str, *, offset: int | None = None,
               nbytes: int | None = None) -> StorageIOError:
        code, status = "", None
        if isinstance(e, self._exc.ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        where = f"{what} {url}"
        if code == "NoSuchBucket":
            return StorageIOError(f"{where}: bucket {getattr(url, 'bucket', url)!r} does not exist at "
                                  f"{self._endpoint_name()} (create it, or fix the path)", path=str(url),
                                  offset=offset, nbytes=nbytes, errno_=errno.ENOENT)
        if code in _NOT_FOUND or status == 404:
            return StorageIOError(f"{where}: no such object", path=str(url), offset=offset, nbytes=nbytes,
                                  errno_=errno.ENOENT)
        if code in _DENIED or status == 403:
            return StorageIOError(f"{where}: {self._endpoint_name()} refused the credentials ({code or status}): "
                                  "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the profile",
                                  path=str(url), offset=offset, nbytes=nbytes, errno_=errno.EACCES)
        if _throttled(code, status):
            meta = e.response.get("ResponseMetadata", {})
            attempts = int(meta.get("RetryAttempts", 0)) + 1
            why = "the client's retry quota was spent" if meta.get("RetryQuotaReached") else \
                f"s3.max_attempts is {self.max_attempts}"
            return StorageIOError(f"{where}: throttled by {self._endpoint_name()} ({code or 'no code'}, HTTP {status}) "
                                  f"on {attempts} attempt(s) with backoff ({why}): the store asks for fewer "
                                  "requests; raise s3.max_attempts, lower io.threads, or raise the store's request "
                                  "rate limit", path=str(url), offset=offset, nbytes=nbytes, errno_=errno.EAGAIN)
        if isinstance(e, self._exc.NoCredentialsError):
            return StorageIOError(f"{where}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                                  "AWS_SECRET_ACCESS_KEY, or a profile)", path=str(url), errno_=errno.EACCES)
        if isinstance(e, self._exc.EndpointConnectionError):
            return StorageIOError(f"{where}: cannot connect to {self._endpoint_name()}: {e}", path=str(url),
                                  offset=offset, nbytes=nbytes, errno_=errno.ECONNREFUSED)
        detail = f"{code} (HTTP {status})" if code else f"{type(e).__name__}: {e}"
        return StorageIOError(f"{where} failed at {self._endpoint_name()}: {detail}", path=str(url), offset=offset,
                              nbytes=nbytes, errno_=errno.EIO)

    def _endpoint_name(self) -> str:
        return self._client.meta.endpoint_url

    def _call(self, what: str, url: S3Url, op: str, **kwargs: Any) -> Any:
        try:
            return getattr(self._client, op)(**kwargs)
        except (self._exc.BotoCoreError, self._exc.ClientError) as e:
            raise self._error(e, what, url) from e

    # -- objects -----------------------------------------------------------------------------------
    def put(self, url: S3Url, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        body = _PartReader(memoryview(data))
        try:
            self._client.put_object(Bucket=url.bucket, Key=url.key, Body=body, ContentLength=len(memoryview(data)),
                                    **extra)
        except self._exc.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if if_absent and (code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)):
                return False
            raise self._error(e, "cannot write", url) from e
        except self._exc.BotoCoreError as e:
            raise self._error(e, "cannot write", url) from e
        return True

    def get(self, url: S3Url) -> bytes | None:
        try:
            return self._client.get_object(Bucket=url.bucket, Key=url.key)["Body"].read()
        except self._exc.ClientError as e:
            if _code(e) in _NOT_FOUND:  # the object (not the bucket: NoSuchBucket is an error)
                return None
            raise self._error(e, "cannot read", url) from e
        except self._exc.BotoCoreError as e:
            raise self._error(e, "cannot read", url) from e

    def get_into(self, url: S3Url, offset: int, out: memoryview) -> int:
        n = len(out)
        if n == 0:
            return 0
        try:
            body = self._client.get_object(Bucket=url.bucket, Key=url.key,
                                           Range=f"bytes={offset}-{offset + n - 1}")["Body"]
            got = 0
            while got < n:
                chunk = body.read(min(n - got, 8 << 20))
                if not chunk:
                    break
                out[got:got + len(chunk)] = chunk
                got += len(chunk)
            body.close()
            return got
        except self._exc.ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 416:  # the range starts past the end: nothing there
                return 0
            raise self._error(e, "cannot read", url, offset=offset, nbytes=n) from e
        except self._exc.BotoCoreError as e:
            raise self._error(e, "cannot read", url, offset=offset, nbytes=n) from e

    def head(self, url: S3Url) -> ObjectInfo | None:
        try:
            r = self._client.head_object(Bucket=url.bucket, Key=url.key)
        except self._exc.ClientError as e:
            if _code(e) in _NOT_FOUND:  # HEAD has no body: a missing bucket is a 404 too, found by check_bucket
                return None
            raise self._error(e, "cannot stat", url) from e
        except self._exc.BotoCoreError as e:
            raise self._error(e, "cannot stat", url) from e
        return ObjectInfo(url.key, int(r["ContentLength"]), r["LastModified"].timestamp())

    def list(self, prefix: S3Url) -> Iterator[ObjectInfo]:
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=prefix.bucket, Prefix=prefix.key)
        try:
            for page in pages:
                for o in page.get("Contents", []):
                    yield ObjectInfo(o["Key"], int(o["Size"]), o["LastModified"].timestamp())
        except (self._exc.BotoCoreError, self._exc.ClientError) as e:
            raise self._error(e, "cannot list", prefix) from e

    def list_dirs(self, prefix: S3Url) -> list[str]:
        key = f"{prefix.key}/" if prefix.key else ""
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=prefix.bucket, Prefix=key,
                                                                       Delimiter="/")
        try:
            return [p["Prefix"][len(key):].rstrip("/") for page in pages for p in page.get("CommonPrefixes", [])]
        except (self._exc.BotoCoreError, self._exc.ClientError) as e:
            raise self._error(e, "cannot list", prefix) from e

    def delete(self, url: S3Url) -> None:
        self._call("cannot delete", url, "delete_object", Bucket=url.bucket, Key=url.key)

    # -- multipart ---------------------------------------------------------------------------------
    def create_upload(self, url: S3Url) -> Upload:
        r = self._call("cannot start an upload of", url, "create_multipart_upload", Bucket=url.bucket, Key=url.key)
        return Upload(url, r["UploadId"])

    def upload_part(self, upload: Upload, number: int, data: memoryview) -> str:
        url = upload.url
        try:
            r = self._client.upload_part(Bucket=url.bucket, Key=url.key, UploadId=upload.upload_id,
                                         PartNumber=number, Body=_PartReader(data), ContentLength=len(data))
        except (self._exc.BotoCoreError, self._exc.ClientError) as e:
            raise self._error(e, f"cannot upload part {number} of", url, nbytes=len(data)) from e
        return r["ETag"]

    def complete_upload(self, upload: Upload, etags: list[str]) -> None:
        parts = [{"PartNumber": i + 1, "ETag": tag} for i, tag in enumerate(etags)]
        self._call("cannot complete the upload of", upload.url, "complete_multipart_upload",
                   Bucket=upload.url.bucket, Key=upload.url.key, UploadId=upload.upload_id,
                   MultipartUpload={"Parts": parts})

    def abort_upload(self, upload: Upload) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=upload.url.bucket, Key=upload.url.key,
                                                UploadId=upload.upload_id)
        except self._exc.ClientError as e:
            if _code(e) not in ("NoSuchUpload", *_NOT_FOUND):  # already gone: nothing to abort
                raise self._error(e, "cannot abort the upload of", upload.url) from e
        except self._exc.BotoCoreError as e:
            raise self._error(e, "cannot abort the upload of", upload.url) from e

    def list_uploads(self, prefix: S3Url) -> list[Upload]:
        pages = self._client.get_paginator("list_multipart_uploads").paginate(Bucket=prefix.bucket,
                                                                              Prefix=prefix.key)
        try:
            return [Upload(S3Url(prefix.bucket, u["Key"]), u["UploadId"],
                           u["Initiated"].timestamp() if u.get("Initiated") else 0.0)
                    for page in pages for u in page.get("Uploads", [])]
        except (self._exc.BotoCoreError, self._exc.ClientError) as e:
            raise self._error(e, "cannot list the uploads under", prefix) from e

    def check_bucket(self, url: S3Url) -> None:
        try:
            self._client.head_bucket(Bucket=url.bucket)
        except self._exc.ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 404:  # HEAD has no body: the status alone says the bucket is missing
                e.response.setdefault("Error", {})["Code"] = "NoSuchBucket"
            raise self._error(e, "cannot use", url) from e
        except self._exc.BotoCoreError as e:
            raise self._error(e, "cannot use", url) from e


def open_store(cfg: S3Config, *, threads: int = 16) -> ObjectStore:
    """The object store for ``s3://`` paths under ``cfg`` (a new client: cheap next to a save)."""
    return S3Store(cfg, threads=threads)


def upload_file(store: ObjectStore, path: str | os.PathLike, url: S3Url, *, part_bytes: int, threads: int,
                timeout_s: float) -> None:
    """Upload the local file ``path`` to the object ``url`` as one multipart upload, parts read with ``pread`` on
    ``threads`` threads (the object appears only when complete; on any failure the upload is aborted).

    ``part_bytes`` is raised to S3's 5 MiB minimum, and further so the file fits in 10,000 parts.

    Raises:
        StorageIOError: the file cannot be read, or a request failed (naming the object).
        CheckpointTimeoutError: not done within ``timeout_s``.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise StorageIOError(f"cannot open {path} to upload it to {url}: {e}", path=os.fspath(path),
                             errno_=e.errno) from e
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            store.put(url, b"")
            return
        part = max(part_bytes, PART_MIN_BYTES, -(-size // PARTS_MAX))
        offsets = list(range(0, size, part))
        upload = store.create_upload(url)

        def one(k: int, cancel: threading.Event) -> str:
            n = min(part, size - offsets[k])
            try:
                data = os.pread(fd, n, offsets[k])
            except OSError as e:
                raise StorageIOError(f"cannot read {path} to upload it to {url}: {e}", path=os.fspath(path),
                                     offset=offsets[k], nbytes=n, errno_=e.errno) from e
            if len(data) != n:
                raise StorageIOError(f"{path} shrank while it was uploaded to {url}", path=os.fspath(path),
                                     offset=offsets[k], nbytes=n, errno_=errno.EIO)
            return store.upload_part(upload, k + 1, memoryview(data))

        try:
            etags = run_parallel(one, range(len(offsets)), threads=threads, timeout_s=timeout_s,
                                 name="cpuckpt-upload")
            store.complete_upload(upload, etags)
        except BaseException:
            store.abort_upload(upload)
            raise
    finally:
        os.close(fd)


class ObjectReads:
    """The read half of a :class:`~cpuckpt.transfer.files.FileBackend` over object storage, for the reader:
    "files" are ``s3://`` URL strings, a ``pread`` is a ranged GET straight into the caller's buffer (a pool
    slot, a read slot, or the destination tensor's bytes)."""

    name = "s3"
    aligned = False

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._opened: dict[int, S3Url] = {}
        self._lock = threading.Lock()

    def open_read(self, path: str) -> int:
        url = S3Url.parse(path, "object")
        with self._lock:
            fd = len(self._opened)
            self._opened[fd] = url
        return fd

    def pread_into(self, fd: int, buf: memoryview, offset: int, path: str) -> int:
        view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        return self.store.get_into(self._opened[fd], offset, view)

    def close(self, fd: int) -> None:
        with self._lock:
            self._opened.pop(fd, None)
