"""Stage outputs: a directory plus a `manifest.json` naming every file with its sha256.

Every stage writes into a fresh temporary sibling directory and renames it into place
only when complete, so a crash or a failed stage never replaces a good artifact.
Downstream stages refer to an artifact by `ArtifactRef` (path + content digest):
small, JSON-serialisable, and a cache key ingredient.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from glm_lora.configs.errors import UserError

MANIFEST = "manifest.json"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]    # src/glm_lora: code versions hash the sources below it


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_path(path: Path) -> str:
    """sha256 of a file, or of a directory's relative file names and contents (a saved dataset)."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(p.relative_to(path).as_posix().encode() + b"\0" + sha256_file(p).encode())
    return h.hexdigest()


def source_hash(root: Path, packages: tuple[str, ...]) -> str:
    """Short hash of the Python sources of `packages` under `root`: the code version of what they make."""
    h = hashlib.sha256()
    for pkg in packages:
        for f in sorted((Path(root) / pkg).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def code_version(packages: tuple[str, ...]) -> str:
    """The code version of what `packages` make (a stage, a token store, a checkpoint): one hash of
    their Python sources in this package, computed once per process."""
    return source_hash(PACKAGE_ROOT, packages)


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class ArtifactRef:
    """What a stage returns: where its output lives and a digest of its content."""

    stage: str
    path: str
    digest: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ArtifactRef":
        return cls(**d)

    def manifest(self) -> dict:
        return read_manifest(Path(self.path))


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def file_entry(p: Path) -> dict:
    """A file's manifest entry."""
    return {"sha256": sha256_file(p), "size": p.stat().st_size}


def _file_entries(root: Path) -> dict[str, dict]:
    return {p.relative_to(root).as_posix(): file_entry(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def content_digest(files: dict[str, dict]) -> str:
    """Digest over file names and hashes only: metrics and timestamps don't change it."""
    return sha256_json({k: v["sha256"] for k, v in files.items()})


def write_manifest(root: Path, stage: str, config: dict | None = None,
                   metrics: dict | None = None, inputs: list[ArtifactRef] | None = None) -> dict:
    root = Path(root)
    files = _file_entries(root)
    manifest = {
        "stage": stage,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "digest": content_digest(files),
        "files": files,
        "config": config or {},
        "metrics": metrics or {},
        "inputs": [r.to_dict() for r in (inputs or [])],
    }
    atomic_write_text(root / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True, default=str))
    return manifest


def read_manifest(root: Path) -> dict:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no manifest; the stage that writes {root} did not finish")
    return json.loads(path.read_text(encoding="utf-8"))


def verify(root: Path) -> dict:
    """Re-hash every file listed in the manifest; raise naming the first mismatch."""
    root = Path(root)
    manifest = read_manifest(root)
    for rel, entry in manifest["files"].items():
        p = root / rel
        if not p.is_file():
            raise ValueError(f"{p}: listed in {root / MANIFEST} but missing")
        if p.stat().st_size != entry["size"] or sha256_file(p) != entry["sha256"]:
            raise ValueError(f"{p}: content does not match {root / MANIFEST}")
    return manifest


def is_complete(root: Path) -> bool:
    try:
        verify(root)
        return True
    except (OSError, ValueError, KeyError, json.JSONDecodeError):
        return False


def still_published(ref: dict) -> bool:
    """Cheap check that a (possibly cached) reference still names what is on disk."""
    try:
        manifest = read_manifest(Path(ref["path"]))
    except (OSError, ValueError):
        return False
    root = Path(ref["path"])
    return manifest["digest"] == ref["digest"] and all(
        (root / rel).is_file() and (root / rel).stat().st_size == e["size"] for rel, e in manifest["files"].items())


def ref_for(root: Path) -> ArtifactRef:
    m = read_manifest(root)
    return ArtifactRef(stage=m["stage"], path=str(Path(root).resolve()), digest=m["digest"])


class NotOurs(UserError):
    """A path we were asked to replace holds something the project did not write."""


def stage_output(stage: str) -> Callable[[Path], bool]:
    """`owns(path)`: is `path` a published output of `stage` (a directory with its manifest)?"""
    def owns(path: Path) -> bool:
        try:
            return path.is_dir() and not path.is_symlink() and read_manifest(path).get("stage") == stage
        except (OSError, ValueError, AttributeError):
            return False
    owns.what = f"glm-lora '{stage}' output (with a {MANIFEST} for that stage)"
    return owns


def check_replaceable(final: Path, owns: Callable[[Path], bool]) -> None:
    """Refuse to replace `final` unless it is absent or `owns(final)` says it is ours.

    Guards every publish: a run_name or runs_dir that lands on somebody's directory (or on
    another stage's output) must fail, not swap that directory out and delete it.
    """
    final = Path(final)
    if (final.exists() or final.is_symlink()) and not owns(final):
        what = getattr(owns, "what", "glm-lora output")
        raise NotOurs(f"{final} exists and is not a {what}; refusing to replace it. "
                      "Move it away, or choose another runs_dir / run_name")


def scratch_name(final: Path, kind: str) -> str:
    """`.<name>.tmp-<pid>-<ns>` / `.<name>.old-<pid>-<ns>`: the pid tells a dead writer's leftovers."""
    return f".{Path(final).name}.{kind}-{os.getpid()}-{time.time_ns()}"


@contextlib.contextmanager
def staging_dir(final: Path, owns: Callable[[Path], bool]) -> Iterator[Path]:
    """Yield a temp dir next to `final`; on success replace `final` with it, on error drop it.

    Only an absent `final` or one that `owns(final)` accepts is ever replaced (checked before
    the work starts and again before the swap). The swap is two renames (old → trash, new → final); a
    crash between them leaves the old artifact in `.<name>.old-*` and `final` absent, which
    `artifacts.lock.clean_scratch` puts back on the next start.
    """
    final = Path(final).absolute()
    check_replaceable(final, owns)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / scratch_name(final, "tmp")
    tmp.mkdir()
    try:
        yield tmp
        check_replaceable(final, owns)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_into_place(tmp, final, final.parent / scratch_name(final, "old"))


def swap_into_place(tmp: Path, final: Path, old: Path) -> None:
    """Rename the finished `tmp` to `final`; an existing `final` is first renamed to `old` (removed
    after the swap). A crash between the two renames leaves `old` and no `final`, never half of one."""
    moved = final.exists()
    if moved:
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync(final.parent)
    if moved:
        shutil.rmtree(old, ignore_errors=True)


def fsync(path: Path) -> None:
    """fsync a file or a directory (a directory: so the renames in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build(final: Path, stage: str, fn, *, config: dict | None = None,
          inputs: list[ArtifactRef] | None = None) -> ArtifactRef:
    """Run `fn(tmp_dir) -> metrics` in a staging dir, write its manifest, publish it atomically."""
    with staging_dir(final, stage_output(stage)) as tmp:
        metrics = fn(tmp) or {}
        write_manifest(tmp, stage, config=config, metrics=metrics, inputs=inputs)
    return ref_for(final)
