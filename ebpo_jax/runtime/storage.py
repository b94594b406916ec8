"""One path type for every file a run reads or writes: a local folder or a `gs://` bucket.

Paths stay strings (the config's, the spec's, orbax's); the file operations go through
etils `epath`, which orbax already uses and which reaches `gs://` through gcsfs. Local
writes are atomic by a temporary file and a rename; an object store has no rename, but an
object PUT is atomic by itself (readers see the old object or the new one, never a part).
Transient storage errors are retried by the client libraries (gcsfs: 6 tries with
exponential backoff; tensorstore for orbax's arrays; google-cloud-storage for the lock).
"""

import base64
import hashlib
import logging
import os
from collections.abc import Iterator

import fsspec
from etils import epath

# Several hosts write one bucket: a cached listing would hide the others' objects.
fsspec.config.conf.setdefault("gs", {}).setdefault("use_listings_cache", False)

REMOTE_SCHEMES = ("gs://",)


def is_remote(path: str) -> bool:
    """Whether `path` names object storage (`gs://bucket/...`), not a local file."""
    remote = str(path).startswith(REMOTE_SCHEMES)
    if remote:
        _emulator_quirks()
    return remote


def _emulator_quirks() -> None:
    """Against an emulator (STORAGE_EMULATOR_HOST), before gcsfs is first used: it cannot
    answer gcsfs's gRPC bucket-type probe, which then waits 60 s per call and warns on every
    new client that it fell back (it has no credentials to probe with)."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        logging.getLogger("gcsfs").setLevel(logging.ERROR)


def require(p: str) -> None:
    """ImportError in one line when `p` is on gs:// and the GCS clients are not installed."""
    if not is_remote(p):
        return
    try:
        import gcsfs  # noqa: F401
        import google.cloud.storage  # noqa: F401
    except ImportError:
        raise ImportError(
            f"{p}: gs:// paths need gcsfs and google-cloud-storage: pip install 'ebpo-jax[gcs]'"
        ) from None


def absolute(path: str) -> str:
    """A local path made absolute (`~` expanded); a `gs://` one as given, without a trailing /."""
    path = str(path)
    if is_remote(path):
        return path.rstrip("/")
    return os.path.abspath(os.path.expanduser(path))


def join(base: str, *parts: str) -> str:
    """`base`/`parts` as a string (`os.path.join` keeps `gs://` intact)."""
    return os.path.join(str(base), *parts)


def host_local(workdir: str) -> str:
    """A folder on this host for what must be a local file (orbax's log): the workdir
    itself, or for `gs://` one under ~/.cache/ebpo_jax/runs named after it."""
    if not is_remote(workdir):
        return workdir
    local = os.path.join(os.path.expanduser("~/.cache/ebpo_jax/runs"), workdir.split("://", 1)[1])
    os.makedirs(local, exist_ok=True)
    return local


def path(p: str) -> epath.Path:
    """The epath of a local or `gs://` path."""
    return epath.Path(str(p))


def exists(p: str) -> bool:
    return path(p).exists()


def isdir(p: str) -> bool:
    """A folder (locally), or a prefix with objects under it (on `gs://`)."""
    return path(p).is_dir()


def isfile(p: str) -> bool:
    return exists(p) and not isdir(p)


def listdir(p: str) -> list[str]:
    """Names directly under `p`, sorted; [] if it does not exist."""
    try:
        return sorted(child.name for child in path(p).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def makedirs(p: str) -> None:
    """Create a local folder and its parents (object storage has no folders: nothing to do)."""
    if not is_remote(p):
        os.makedirs(p, exist_ok=True)


def read_bytes(p: str) -> bytes:
    return path(p).read_bytes()


def read_text(p: str) -> str:
    return path(p).read_text(encoding="utf-8")


def write_bytes(p: str, data: bytes) -> None:
    """Replace `p` with `data` atomically: local tmp + fsync + rename, or one object PUT."""
    if is_remote(p):
        path(p).write_bytes(data)
        return
    makedirs(os.path.dirname(p) or ".")
    tmp = f"{p}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)


def write_text(p: str, text: str) -> None:
    write_bytes(p, text.encode("utf-8"))


def remove(p: str) -> None:
    """Delete a file or object; nothing if it is gone already."""
    try:
        path(p).unlink()
    except FileNotFoundError:
        pass


def rmtree(p: str) -> None:
    """Delete a folder (or every object under a prefix); nothing if it is gone already."""
    if exists(p):
        path(p).rmtree()


def move(src: str, dst: str) -> None:
    """Move a file or folder (on `gs://` a copy of each object, then a delete)."""
    if not is_remote(src) and not is_remote(dst):
        os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        os.replace(src, dst)
        return
    fs = filesystem(src)  # copy + delete: gcsfs's moveTo is not on every server (the emulator)
    fs.copy(str(src), str(dst), recursive=True)
    fs.rm(str(src), recursive=True)


def upload(local: str, remote: str) -> None:
    """Copy a local file or folder to `remote` (a gs:// path, or another local one)."""
    if os.path.isdir(local):
        for rel in walk_files(local):
            write_bytes(join(remote, rel), read_bytes(os.path.join(local, rel)))
    else:
        write_bytes(remote, read_bytes(local))


def walk_files(top: str) -> Iterator[str]:
    """Every file under `top`, relative to it with / separators, in no set order."""
    if not is_remote(top):
        for folder, _, files in os.walk(top):
            for name in files:
                yield os.path.relpath(os.path.join(folder, name), top).replace(os.sep, "/")
        return
    fs = filesystem(top)
    root = fs._strip_protocol(str(top)).rstrip("/") + "/"
    for name in fs.find(str(top)):
        yield name.removeprefix(root)


def sha256(p: str) -> str:
    """The SHA-256 of a file's or object's bytes, read in chunks."""
    h = hashlib.sha256()
    with path(p).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def stored_crc32c(top: str) -> dict[str, str]:
    """{file relative to `top`: its CRC32C, base64 as GCS reports it} for every object under a
    `gs://` prefix, from one listing: the store computed each when the object was written, so
    nothing is read back (computed from the bytes only where a listing lacks one)."""
    import google_crc32c  # late: a dependency of the GCS clients, needed only on gs://

    fs = filesystem(top)
    root = fs._strip_protocol(str(top)).rstrip("/") + "/"
    out = {}
    for name, info in fs.find(str(top), detail=True).items():
        crc = info.get("crc32c")
        if crc is None:
            digest = google_crc32c.Checksum(read_bytes(f"gs://{name}")).digest()
            crc = base64.b64encode(digest).decode()
        out[name.removeprefix(root)] = crc
    return out


def filesystem(p: str) -> fsspec.AbstractFileSystem:
    """The fsspec filesystem of `p` (gcsfs for `gs://`), for libraries that want file objects."""
    return fsspec.core.url_to_fs(str(p))[0]


def open_file(p: str, mode: str = "rb"):
    """A file object on `p` (a local file, or a gcsfs one for `gs://`)."""
    return path(p).open(mode)


def local_copy(p: str, cache_root: str) -> str:
    """`p` itself when local, else a host-local copy of the `gs://` folder (or file) under
    `cache_root`, named after it and fetched again when an object's generation changes."""
    if not is_remote(p):
        return p
    fs = filesystem(p)
    root = fs._strip_protocol(p).rstrip("/")
    objects = fs.find(p, detail=True) or {root: fs.info(p)}
    is_file = list(objects) == [root]
    stamp = repr(sorted((k, v.get("generation"), v.get("size")) for k, v in objects.items()))
    dest = os.path.join(cache_root, hashlib.sha256(p.encode()).hexdigest()[:16])
    stamp_file = os.path.join(dest, ".source")
    if not (os.path.exists(stamp_file) and open(stamp_file).read() == stamp):
        for name in objects:
            rel = os.path.basename(root) if is_file else name.removeprefix(root + "/")
            target = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            part = f"{target}.part-{os.getpid()}"  # hosts sharing a disk copy side by side
            fs.get_file(name, part)
            os.replace(part, target)
        write_text(stamp_file, stamp)
    return os.path.join(dest, os.path.basename(root)) if is_file else dest
