"""Fills a model directory from a model repository over HTTP(S): what the chart's `model-fetch` init container runs.

    python -m services.model_fetch --repo-url https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct \
        --dest /models/SmolLM2-135M-Instruct [--revision main] [--include '*.json' --include '*.safetensors']

The repository speaks the Hugging Face Hub's HTTP API (the Hub, its mirrors, a self-hosted one): the file list from
`GET <endpoint>/api/models/<repo>/tree/<revision>?recursive=true`, each file from
`GET <endpoint>/<repo>/resolve/<revision>/<path>`. The token (`--token-file`, which the chart mounts from a Secret, or
`HF_TOKEN`) is sent as a Bearer token to the repository's own host only, never along a redirect to a CDN.

Every file is checked against what the listing gives: its size, and its SHA-256 (LFS files) or git blob SHA-1 (the
others). A file is written under `<dest>/.partial/` and renamed into place once verified, so a reader never sees a
half-written or corrupt file; a manifest (`<dest>/.model_fetch.json`) records what was verified, so a restarted
pod skips the files already there. Limits (file count, total bytes, path shape) are checked on the listing, before
any download.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import http.client
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

import structlog

from services.common.logs import configure_logging

log = structlog.get_logger(__name__)

MANIFEST = ".model_fetch.json"
PARTIAL = ".partial"
CHUNK = 1 << 20
MAX_FILES = 10_000
MAX_TOTAL_BYTES = 1 << 40  # 1 TiB: above any single model's weights
TIMEOUT_S = 60.0
ATTEMPTS = 3


class FetchError(RuntimeError):
    """A fetch that cannot succeed as asked (bad listing, limit, checksum, refused token); names the file."""


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int
    sha256: str = ""  # LFS files: the content's SHA-256
    git_sha1: str = ""  # other files: the git blob id (SHA-1 of "blob <size>\0" + content)


@dataclass(frozen=True)
class FetchConfig:
    repo_url: str  # <endpoint>/<owner>/<name>
    dest: Path
    revision: str = "main"
    include: tuple[str, ...] = ()  # glob patterns on the repository path; empty: every file
    token: str | None = None
    max_files: int = MAX_FILES
    max_total_bytes: int = MAX_TOTAL_BYTES
    timeout_s: float = TIMEOUT_S
    # NOTE: wins over `token` (the chart mounts the Secret as a file: a token in the environment shows in
    # `kubectl describe` and crash dumps); read when the fetch starts.
    token_file: Path | None = None

    @property
    def endpoint_and_repo(self) -> tuple[str, str]:
        url = urllib.parse.urlsplit(self.repo_url.rstrip("/"))
        parts = [p for p in url.path.split("/") if p]
        if url.scheme not in ("http", "https") or not url.netloc or len(parts) < 2:
            raise FetchError(f"--repo-url must be http(s)://<host>[/<prefix>]/<owner>/<name>, got {self.repo_url!r}")
        prefix = "/".join(parts[:-2])
        endpoint = f"{url.scheme}://{url.netloc}" + (f"/{prefix}" if prefix else "")
        return endpoint, "/".join(parts[-2:])


@dataclass(frozen=True)
class FetchResult:
    downloaded: list[str]
    skipped: list[str]


def _safe_path(path: str) -> str:
    """A relative path that stays inside the destination (the listing is input: `..` or `/x` would escape it)."""
    p = PurePosixPath(path)
    if not path or p.is_absolute() or any(part in ("", ".", "..") for part in path.split("/")) or "\\" in path:
        raise FetchError(f"the repository lists an unsafe path {path!r}")
    if p.parts[0] in (PARTIAL, MANIFEST):
        raise FetchError(f"the repository lists a reserved path {path!r}")
    return path


class ModelFetcher:
    def __init__(self, config: FetchConfig) -> None:
        self.config = config
        self.endpoint, self.repo = config.endpoint_and_repo
        self.host = urllib.parse.urlsplit(self.endpoint).netloc
        self.token = config.token
        if config.token_file is not None:
            try:
                self.token = config.token_file.read_text().strip() or None
            except OSError as e:
                raise FetchError(f"--token-file {config.token_file}: {e.strerror}") from e

    def _open(self, url: str) -> http.client.HTTPResponse:
        request = urllib.request.Request(url, headers={"User-Agent": "pagoda-model-fetch"})
        if self.token and urllib.parse.urlsplit(url).netloc == self.host:
            # NOTE: unredirected: a redirect (the Hub sends LFS files to a CDN) never carries the token along.
            request.add_unredirected_header("Authorization", f"Bearer {self.token}")
        try:
            return urllib.request.urlopen(request, timeout=self.config.timeout_s)
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                hint = "HF_TOKEN is refused" if self.token else "the repository needs HF_TOKEN"
                raise FetchError(f"{url}: HTTP {e.code}: {hint}") from e
            if e.code == 404:
                raise FetchError(f"{url}: HTTP 404: no such repository, revision or file") from e
            raise

    def list_files(self) -> list[RepoFile]:
        """The files of the revision that match `include`, checked against the limits."""
        revision = urllib.parse.quote(self.config.revision, safe="")
        url = f"{self.endpoint}/api/models/{self.repo}/tree/{revision}?recursive=true"
        with self._open(url) as resp:
            body = resp.read(64 << 20)  # NOTE: a listing bigger than 64 MiB is not a model's
        try:
            entries = json.loads(body)
        except ValueError as e:
            raise FetchError(f"{url}: not a JSON file list") from e
        if not isinstance(entries, list):
            raise FetchError(f"{url}: expected a JSON list of files")
        files = []
        for entry in entries:
            if not isinstance(entry, dict) or entry.get("type") != "file":
                continue
            path = _safe_path(str(entry.get("path", "")))
            if self.config.include and not any(fnmatch.fnmatch(path, pat) for pat in self.config.include):
                continue
            lfs = entry.get("lfs") if isinstance(entry.get("lfs"), dict) else None
            size = int(lfs["size"] if lfs else entry.get("size", -1))
            if size < 0:
                raise FetchError(f"the repository gives no size for {path!r}")
            files.append(RepoFile(path, size, str(lfs.get("oid", "")) if lfs else "", str(entry.get("oid", ""))))
        if not files:
            raise FetchError(f"{self.repo}@{self.config.revision}: no file matches {list(self.config.include)}")
        if len(files) > self.config.max_files:
            raise FetchError(f"{self.repo}: {len(files)} files, above the limit of {self.config.max_files}")
        total = sum(f.size for f in files)
        if total > self.config.max_total_bytes:
            raise FetchError(f"{self.repo}: {total} bytes, above the limit of {self.config.max_total_bytes}")
        return files

    def fetch(self) -> FetchResult:
        dest = self.config.dest
        files = self.list_files()
        dest.mkdir(parents=True, exist_ok=True)
        manifest = self._read_manifest()
        downloaded, skipped = [], []
        for f in files:
            target = dest / f.path
            if manifest.get(f.path) == asdict(f) and target.is_file() and target.stat().st_size == f.size:
                skipped.append(f.path)
                continue
            self._download(f, target)
            manifest[f.path] = asdict(f)
            self._write_manifest(manifest)
            downloaded.append(f.path)
        log.info("model fetched", repo=self.repo, revision=self.config.revision, downloaded=len(downloaded),
                 skipped=len(skipped), dest=str(dest))  # fmt: skip
        return FetchResult(downloaded, skipped)

    def _download(self, f: RepoFile, target: Path) -> None:
        partial = self.config.dest / PARTIAL / (f.path.replace("/", "%2F") + ".tmp")
        partial.parent.mkdir(parents=True, exist_ok=True)
        path = urllib.parse.quote(f.path)
        url = f"{self.endpoint}/{self.repo}/resolve/{urllib.parse.quote(self.config.revision, safe='')}/{path}"
        for attempt in range(1, ATTEMPTS + 1):
            try:
                self._download_once(url, f, partial)
                break
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                partial.unlink(missing_ok=True)
                if isinstance(e, urllib.error.HTTPError) and e.code < 500:
                    raise FetchError(f"{f.path}: HTTP {e.code}") from e
                if attempt == ATTEMPTS:
                    raise FetchError(f"{f.path}: {e} after {ATTEMPTS} attempts") from e
                log.warning("download failed, retrying", file=f.path, attempt=attempt, error=str(e))
            except BaseException:
                partial.unlink(missing_ok=True)
                raise
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, target)

    def _download_once(self, url: str, f: RepoFile, partial: Path) -> None:
        sha256 = hashlib.sha256()
        sha1 = hashlib.sha1(f"blob {f.size}\0".encode(), usedforsecurity=False)
        written = 0
        with self._open(url) as resp, partial.open("wb") as out:
            while chunk := resp.read(CHUNK):
                written += len(chunk)
                if written > f.size:  # NOTE: never write more than the listing promised
                    raise FetchError(f"{f.path}: more than the {f.size} bytes the repository lists")
                sha256.update(chunk)
                sha1.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if written != f.size:
            raise FetchError(f"{f.path}: {written} bytes, the repository lists {f.size}")
        if f.sha256 and sha256.hexdigest() != f.sha256:
            raise FetchError(f"{f.path}: SHA-256 {sha256.hexdigest()} differs from the repository's {f.sha256}")
        if not f.sha256 and f.git_sha1 and sha1.hexdigest() != f.git_sha1:
            raise FetchError(f"{f.path}: git blob id {sha1.hexdigest()} differs from the repository's {f.git_sha1}")

    def _read_manifest(self) -> dict[str, dict[str, object]]:
        try:
            data = json.loads((self.config.dest / MANIFEST).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_manifest(self, manifest: dict[str, dict[str, object]]) -> None:
        tmp = self.config.dest / PARTIAL / (MANIFEST + ".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, self.config.dest / MANIFEST)


def parse_args(argv: list[str] | None = None) -> FetchConfig:
    p = argparse.ArgumentParser(prog="python -m services.model_fetch", description=__doc__.split("\n\n")[0])
    p.add_argument("--repo-url", required=True, help="http(s)://<host>[/<prefix>]/<owner>/<name>")
    p.add_argument("--dest", required=True, type=Path, help="the model directory to fill")
    p.add_argument("--revision", default="main", help="branch, tag or commit")
    p.add_argument("--include", action="append", default=[], help="glob of repository paths to fetch (repeatable)")
    p.add_argument("--max-files", type=int, default=MAX_FILES)
    p.add_argument("--max-total-bytes", type=int, default=MAX_TOTAL_BYTES)
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per HTTP read")
    p.add_argument("--token-file", type=Path, default=None, help="a file holding the token (else $HF_TOKEN)")
    a = p.parse_args(argv)
    token = os.environ.get("HF_TOKEN") or None
    return FetchConfig(
        a.repo_url, a.dest, a.revision, tuple(a.include), token, a.max_files, a.max_total_bytes, a.timeout, a.token_file
    )


def main(argv: list[str] | None = None) -> int:
    configure_logging("model-fetch")
    config = parse_args(argv)
    try:
        ModelFetcher(config).fetch()
    except FetchError as e:
        log.error("model fetch failed", error=str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
