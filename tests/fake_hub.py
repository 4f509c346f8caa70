"""A local stand-in of the Hugging Face Hub: the few HTTP endpoints that uploads and ``load_dataset`` use.

The real clients (``huggingface_hub.HfApi``, ``datasets.DatasetDict.push_to_hub``, ``load_dataset``) talk to it
unchanged through ``HF_ENDPOINT=http://127.0.0.1:<port>``. Repositories are folders under ``root/<type>s/<id>/``,
with one branch (``main``) whose commit id changes on every commit. Implemented: repo creation and info, card
metadata validation, pre-upload (binary files go through LFS, as on the Hub; text files inline), the LFS batch API
with the basic transfer (one PUT per object), NDJSON commits (inline files, LFS files, deletions), tree listing,
paths-info, and file download (HEAD, GET, ranges). Clients must run with ``HF_HUB_DISABLE_XET=1`` (the Hub's newer
Xet transfer is not implemented).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # name or org/name: never a path


class FakeHub:
    """The stand-in server (a context manager): ``url`` is its endpoint, ``root`` its storage."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.lfs = self.root / ".lfs"  # uploaded LFS objects by sha256, until a commit places them
        self.commits: dict[str, int] = {}
        self.requests: list[str] = []
        self.lock = threading.Lock()
        handler = type("Handler", (HubHandler,), {"hub": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def folder(self, repo_type: str, repo_id: str) -> Path:
        return self.root / f"{repo_type}s" / repo_id

    def sha(self, repo_type: str, repo_id: str) -> str:
        count = self.commits.get(f"{repo_type}/{repo_id}", 0)
        return hashlib.sha1(f"{repo_type}/{repo_id}@{count}".encode()).hexdigest()

    def files(self, repo_type: str, repo_id: str) -> list[str]:
        folder = self.folder(repo_type, repo_id)
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _upload_mode(file: dict) -> str:
    """``lfs`` for binary samples (NUL bytes) and large files, else ``regular``: the Hub's rule, simplified."""
    sample = base64.b64decode(file.get("sample") or "")
    return "lfs" if b"\x00" in sample or file.get("size", 0) > 10_000_000 else "regular"


def _entry(folder: Path, path: str) -> dict:
    target = folder / path
    if target.is_dir():
        return {"type": "directory", "path": path, "oid": hashlib.sha1(path.encode()).hexdigest()}
    data = target.read_bytes()
    return {"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}


class HubHandler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    # ---------------------------------------------------------------- plumbing

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, payload, status: int = 200) -> None:
        self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json"})

    def _missing(self, what: str = "RepoNotFound") -> None:
        headers = {"X-Error-Code": what, "X-Error-Message": what}
        self._send(404, json.dumps({"error": what}).encode(), headers, head=self.command == "HEAD")

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _route(self, method: str) -> None:
        url = urlparse(self.path)
        path, query = unquote(url.path), parse_qs(url.query)
        self.hub.requests.append(f"{method} {path}")
        api = re.match(r"^/api/(models|datasets|spaces)/([^/]+/[^/]+)(?:/(.*))?$", path)
        if method == "POST" and path == "/api/repos/create":
            return self._create()
        if method == "POST" and path == "/api/validate-yaml":
            return self._validate_yaml()
        if method == "POST" and path.endswith(".git/info/lfs/objects/batch"):
            return self._lfs_batch()
        if method == "PUT" and path.startswith("/lfs-upload/"):
            return self._lfs_put(path.rsplit("/", 1)[1])
        if api:
            repo_type, repo_id, rest = TYPES[api.group(1)], api.group(2), api.group(3) or ""
            if not self.hub.folder(repo_type, repo_id).is_dir():
                return self._missing()
            return self._api(method, repo_type, repo_id, rest, query)
        resolve = re.match(r"^/(?:(datasets|spaces)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if resolve and method in ("GET", "HEAD"):
            repo_type = TYPES[resolve.group(1)] if resolve.group(1) else "model"
            return self._download(repo_type, resolve.group(2), resolve.group(4), head=method == "HEAD")
        return self._missing("EndpointNotFound")

    def do_GET(self) -> None:  # noqa: N802
        self._route("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._route("HEAD")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._route("PUT")

    # ---------------------------------------------------------------- endpoints

    def _create(self) -> None:
        body = json.loads(self._body() or b"{}")
        repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
        repo_type = body.get("type") or "model"
        self.hub.folder(repo_type, repo_id).mkdir(parents=True, exist_ok=True)
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        self._json({"url": f"{self.hub.url}/{prefix}{repo_id}", "name": repo_id, "id": repo_id})

    def _lfs_batch(self) -> None:
        objects = json.loads(self._body())["objects"]
        answer = []
        for obj in objects:
            action = {"upload": {"href": f"{self.hub.url}/lfs-upload/{obj['oid']}", "header": {}}}
            answer.append(obj | ({} if (self.hub.lfs / obj["oid"]).is_file() else {"actions": action}))
        self._json({"transfer": "basic", "objects": answer, "hash_algo": "sha256"})

    def _lfs_put(self, oid: str) -> None:
        data = self._body()
        if hashlib.sha256(data).hexdigest() != oid:
            return self._send(400, b"sha256 mismatch")
        self.hub.lfs.mkdir(parents=True, exist_ok=True)
        (self.hub.lfs / oid).write_bytes(data)
        return self._send(200)

    def _validate_yaml(self) -> None:
        """The card's YAML header: a mapping; ``base_model`` and ``datasets`` hub ids (as the Hub checks them)."""
        import yaml

        content = json.loads(self._body())["content"]
        header = re.match(r"^---\n(.*?)\n---", content, re.S)
        errors = []
        try:
            metadata = yaml.safe_load(header.group(1)) if header else {}
        except yaml.YAMLError as exc:
            metadata, errors = {}, [f"not valid YAML: {exc}"]
        if not isinstance(metadata, dict):
            errors.append("metadata must be a mapping")
            metadata = {}
        for key in ("base_model", "datasets"):
            values = metadata.get(key) or []
            for value in [values] if isinstance(values, str) else values:
                if not REPO_ID.match(str(value)):
                    errors.append(f"{key}: {value!r} is not a repository id")
        if errors:
            return self._json({"errors": [{"message": e} for e in errors]}, status=400)
        return self._json({"errors": [], "warnings": []})

    def _api(self, method: str, repo_type: str, repo_id: str, rest: str, query: dict) -> None:
        hub, folder = self.hub, self.hub.folder(repo_type, repo_id)
        if method == "GET" and (rest == "" or rest.startswith("revision/")):
            siblings = [{"rfilename": f} for f in hub.files(repo_type, repo_id)]
            info = {"id": repo_id, "sha": hub.sha(repo_type, repo_id), "siblings": siblings, "private": False}
            return self._json(info | {"lastModified": "2026-01-01T00:00:00.000Z", "tags": [], "disabled": False})
        if method == "POST" and rest.startswith("preupload/"):
            files = json.loads(self._body())["files"]
            modes = [{"path": f["path"], "uploadMode": _upload_mode(f), "shouldIgnore": False} for f in files]
            return self._json({"files": modes})
        if method == "POST" and rest.startswith("commit/"):
            return self._commit(repo_type, repo_id)
        if method == "GET" and rest.startswith("tree/"):
            inside = rest.split("/", 2)[2] if rest.count("/") >= 2 else ""
            base = folder / inside
            if not base.is_dir():
                return self._missing("EntryNotFound")
            deep = query.get("recursive", ["false"])[0].lower() == "true"
            children = base.rglob("*") if deep else base.iterdir()
            return self._json([_entry(folder, p.relative_to(folder).as_posix()) for p in sorted(children)])
        if method == "POST" and rest.startswith("paths-info/"):
            body = self._body()
            try:
                paths = json.loads(body)["paths"]
            except (json.JSONDecodeError, KeyError):
                paths = parse_qs(body.decode()).get("paths", [])
            return self._json([_entry(folder, p) for p in paths if (folder / p).exists()])
        return self._missing("EndpointNotFound")

    def _commit(self, repo_type: str, repo_id: str) -> None:
        folder = self.hub.folder(repo_type, repo_id)
        with self.hub.lock:
            for line in self._body().decode().splitlines():
                if not line.strip():
                    continue
                item = json.loads(line)
                key, value = item["key"], item["value"]
                if key in ("file", "lfsFile"):
                    target = folder / value["path"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    if key == "file":
                        target.write_bytes(base64.b64decode(value["content"]))
                    else:
                        target.write_bytes((self.hub.lfs / value["oid"]).read_bytes())
                elif key in ("deletedFile", "deletedFolder"):
                    (folder / value["path"]).unlink(missing_ok=True)
                elif key not in ("header",):
                    return self._send(400, f"unsupported commit operation {key}".encode())
            name = f"{repo_type}/{repo_id}"
            self.hub.commits[name] = self.hub.commits.get(name, 0) + 1
            sha = self.hub.sha(repo_type, repo_id)
        self._json({"commitUrl": f"{self.hub.url}/{repo_id}/commit/{sha}", "commitOid": sha, "success": True})

    def _download(self, repo_type: str, repo_id: str, path: str, head: bool) -> None:
        target = self.hub.folder(repo_type, repo_id) / path
        if not target.is_file():
            return self._missing("EntryNotFound")
        data = target.read_bytes()
        headers = {
            "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
            "X-Repo-Commit": self.hub.sha(repo_type, repo_id),
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        ranged = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if ranged and not head:
            start = int(ranged.group(1))
            end = int(ranged.group(2)) if ranged.group(2) else len(data) - 1
            part = data[start : end + 1]
            headers["Content-Range"] = f"bytes {start}-{start + len(part) - 1}/{len(data)}"
            return self._send(206, part, headers)
        if head:
            self.send_response(200)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return None
        return self._send(200, data, headers)
