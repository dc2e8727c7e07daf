"""services/model_fetch.py against a model repository served on 127.0.0.1 (http.server in a thread) that speaks the
Hub's API: the listing, `resolve` downloads, an LFS file behind a redirect, a private repository behind a token."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from services.model_fetch import MANIFEST, PARTIAL, FetchConfig, FetchError, ModelFetcher, main

REPO = "acme/tiny-llm"
TOKEN = "hf_test_token"
FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 8}',
    "tokenizer.json": b'{"model": {"vocab": {}}}',
    "model.safetensors": bytes(range(256)) * 64,  # LFS: served through a redirect, checked by SHA-256
    "sub/extra.txt": b"nested file\n",
}
LFS = {"model.safetensors"}


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data, usedforsecurity=False).hexdigest()


@dataclass
class FakeHub:
    """What the fake repository serves and what it saw."""

    files: dict[str, bytes] = field(default_factory=lambda: dict(FILES))
    listing_extra: list[dict[str, object]] = field(default_factory=list)
    corrupt: set[str] = field(default_factory=set)  # served with one byte flipped
    listed_size: dict[str, int] = field(default_factory=dict)  # the listing's size instead of the real one
    private: bool = False
    downloads: list[str] = field(default_factory=list)
    auth_on_redirect: list[str | None] = field(default_factory=list)
    url: str = ""

    def listing(self) -> list[dict[str, object]]:
        out: list[dict[str, object]] = [{"type": "directory", "path": "sub", "oid": "0" * 40, "size": 0}]
        for path, data in self.files.items():
            size = self.listed_size.get(path, len(data))
            entry: dict[str, object] = {"type": "file", "path": path, "size": size, "oid": git_blob_sha1(data)}
            if path in LFS:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}
            out.append(entry)
        return out + self.listing_extra


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    state = FakeHub()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = unquote(urlsplit(self.path).path)
            if path.startswith("/cdn/"):  # NOTE: the redirect target: the token must not come along
                state.auth_on_redirect.append(self.headers.get("Authorization"))
                return self._serve_file(path.removeprefix("/cdn/"))
            if state.private and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._send(401, b"unauthorized")
            if path == f"/api/models/{REPO}/tree/main":
                return self._send(200, json.dumps(state.listing()).encode())
            prefix = f"/{REPO}/resolve/main/"
            if path.startswith(prefix):
                name = path.removeprefix(prefix)
                if name in LFS:
                    # NOTE: to another host name of the same server (localhost vs 127.0.0.1), as the Hub's CDN is.
                    port = self.server.server_address[1]
                    return self._send(302, b"", {"Location": f"http://localhost:{port}/cdn/{name}"})
                return self._serve_file(name)
            self._send(404, b"not found")

        def _serve_file(self, name: str) -> None:
            if name not in state.files:
                return self._send(404, b"not found")
            state.downloads.append(name)
            data = state.files[name]
            if name in state.corrupt:
                data = bytes([data[0] ^ 1]) + data[1:]
            self._send(200, data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}/{REPO}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


def _files_under(dest: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(dest)): p.read_bytes()
        for p in dest.rglob("*")
        if p.is_file() and p.name != MANIFEST and PARTIAL not in p.parts
    }


def test_fetches_every_file_verified_then_skips_them(hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    result = ModelFetcher(FetchConfig(hub.url, dest)).fetch()
    assert sorted(result.downloaded) == sorted(FILES) and result.skipped == []
    assert _files_under(dest) == FILES
    assert not any((dest / PARTIAL).iterdir())  # nothing half-written left behind
    # A restarted pod: nothing downloaded again.
    hub.downloads.clear()
    again = ModelFetcher(FetchConfig(hub.url, dest)).fetch()
    assert again.downloaded == [] and sorted(again.skipped) == sorted(FILES) and hub.downloads == []
    # A file changed upstream (a new revision of it) or removed locally is fetched again, alone.
    hub.files["config.json"] = b'{"hidden_size": 16}'
    (dest / "tokenizer.json").unlink()
    third = ModelFetcher(FetchConfig(hub.url, dest)).fetch()
    assert sorted(third.downloaded) == ["config.json", "tokenizer.json"]
    assert (dest / "config.json").read_bytes() == b'{"hidden_size": 16}'


def test_include_patterns_pick_files(hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "tok"
    ModelFetcher(FetchConfig(hub.url, dest, include=("*.json",))).fetch()
    assert set(_files_under(dest)) == {"config.json", "tokenizer.json"}


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])  # SHA-256 (LFS), git blob id (others)
def test_a_corrupt_file_fails_and_is_never_put_in_place(hub: FakeHub, tmp_path: Path, name: str) -> None:
    hub.corrupt.add(name)
    dest = tmp_path / "model"
    with pytest.raises(FetchError, match=name):
        ModelFetcher(FetchConfig(hub.url, dest)).fetch()
    assert not (dest / name).exists()
    assert not any((dest / PARTIAL).iterdir())
    manifest = json.loads((dest / MANIFEST).read_text()) if (dest / MANIFEST).exists() else {}
    assert name not in manifest


def test_private_repository_needs_the_token_which_never_follows_a_redirect(hub: FakeHub, tmp_path: Path) -> None:
    hub.private = True
    with pytest.raises(FetchError, match="needs HF_TOKEN"):
        ModelFetcher(FetchConfig(hub.url, tmp_path / "a")).fetch()
    with pytest.raises(FetchError, match="HF_TOKEN is refused"):
        ModelFetcher(FetchConfig(hub.url, tmp_path / "b", token="wrong")).fetch()
    ModelFetcher(FetchConfig(hub.url, tmp_path / "c", token=TOKEN)).fetch()
    assert _files_under(tmp_path / "c") == FILES
    assert hub.auth_on_redirect == [None]  # the LFS file's redirect went without the token


@pytest.mark.parametrize("path", ["../escape.txt", "/etc/passwd", "a/../../b", f"{PARTIAL}/x", "a//b"])
def test_unsafe_paths_in_the_listing_are_refused_before_any_download(hub: FakeHub, tmp_path: Path, path: str) -> None:
    hub.listing_extra.append({"type": "file", "path": path, "size": 1, "oid": "0" * 40})
    with pytest.raises(FetchError, match="path"):
        ModelFetcher(FetchConfig(hub.url, tmp_path / "model")).fetch()
    assert hub.downloads == [] and not (tmp_path / "escape.txt").exists()


def test_limits_are_checked_on_the_listing(hub: FakeHub, tmp_path: Path) -> None:
    total = sum(len(d) for d in FILES.values())
    with pytest.raises(FetchError, match="above the limit"):
        ModelFetcher(FetchConfig(hub.url, tmp_path / "a", max_total_bytes=total - 1)).fetch()
    with pytest.raises(FetchError, match="above the limit"):
        ModelFetcher(FetchConfig(hub.url, tmp_path / "b", max_files=len(FILES) - 1)).fetch()
    assert hub.downloads == []


def test_a_file_longer_than_listed_is_cut_off(hub: FakeHub, tmp_path: Path) -> None:
    hub.files["short.bin"] = b"0123456789"
    hub.listed_size["short.bin"] = 4  # the listing promises 4 bytes, the server sends 10
    with pytest.raises(FetchError, match=r"short\.bin: more than the 4 bytes"):
        ModelFetcher(FetchConfig(hub.url, tmp_path / "model")).fetch()
    assert not (tmp_path / "model" / "short.bin").exists()


def test_cli_exit_codes_and_bad_urls(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.private = True
    assert main(["--repo-url", hub.url, "--dest", str(tmp_path / "m"), "--include", "*.json"]) == 0
    assert set(_files_under(tmp_path / "m")) == {"config.json", "tokenizer.json"}
    assert main(["--repo-url", hub.url.replace(REPO, "acme/missing"), "--dest", str(tmp_path / "x")]) == 1
    # The token from a file (what the chart mounts) wins over the environment.
    monkeypatch.setenv("HF_TOKEN", "wrong")
    (tmp_path / "token").write_text(TOKEN + "\n")
    argv = ["--repo-url", hub.url, "--dest", str(tmp_path / "f"), "--include", "config.json"]
    assert main([*argv, "--token-file", str(tmp_path / "token")]) == 0
    assert main(argv) == 1  # the environment's token is refused
    for bad in ("ftp://127.0.0.1/acme/tiny", "http://127.0.0.1/only-one-part", "file:///etc/acme/x"):
        with pytest.raises(FetchError, match="--repo-url"):
            ModelFetcher(FetchConfig(bad, tmp_path / "y"))
