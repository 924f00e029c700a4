"""The checkpoint files: a `CheckpointManager` writes them atomically (in the background), prunes them
and loads them back verified. What a resume does with them is engine/checkpoint.py's `Checkpointer`.

One checkpoint is a directory `root/step-XXXXXXXX/` (8-digit, zero-padded step):

    model.safetensors    trainable weights only (LoRA stages: the adapter)
    optimizer.pt.zst     torch.save(optimizer.state_dict()), zstandard level 3 (absent in model-only saves)
    rng.json             python / numpy / torch CPU / CUDA generator states (see engine/checkpoint.py's capture_rng)
    trainer_state.json   the TrainState fields + config, config_hash, code_version, max_steps, epoch
    manifest.json        written last: sha256 + size of every file above, the optimizer's raw and
                         compressed sizes, and a checksum of the manifest itself

Beside them, `root/best/` holds the trainable weights with the best validation loss so far (when
the stage validates): `model.safetensors` + a `manifest.json` of the same kind (sha256, step,
validation loss), published the same atomic way and verified on load.

Crash safety: a save is written into `root/.tmp-step-XXXXXXXX-<pid>/`, every file and the directory
fsynced, then renamed into place in one step, so a reader sees a whole checkpoint or none; a kill -9
mid-save leaves only a temp dir that the next `latest()` removes.

Async: `save()` copies every tensor to host memory (the only part the caller waits for) and a
background thread serialises, compresses, hashes and writes. One write is in flight at a time;
the next save() first waits for it. An error in the thread is raised by the next save/wait/close.

Loading never unpickles: weights through safetensors, optimizer state through
`torch.load(weights_only=True)`, everything else is JSON.

Several processes (torchrun, engine/dist.py): rank 0 decides, verifies and publishes; every rank
contributes its own RNG states and data position (`ranks.json`: one {rng, data_state} per rank,
beside rank 0's in rng.json / trainer_state.json). DDP (replicated weights): rank 0 writes the
layout above. FSDP2 (sharded weights): `torch.distributed.checkpoint` (DCP) writes each rank's
shards of the trainable weights and optimizer state, then rank 0 the rest:

    dcp/.metadata, dcp/__<rank>_0.distcp   DCP's files: {"model": trainable weights, "optim": optimizer
                                           state}, keyed by parameter name (any world size can load them)
    rng.json, ranks.json, trainer_state.json
    manifest.json                          written last by rank 0, once every rank's shards are on disk:
                                           sha256 + size of every file above (dcp/ included), world_size

in the same temp dir + rename (the temp dir is named by rank 0's pid, which every rank is told).
With checkpoint.async_save DCP's async_save copies the shards to host memory and writes them in a
thread over a gloo group of its own; rank 0's writer thread then hashes, writes the manifest and
renames. Plain and sharded saves end the same way (`CheckpointManager._publish_step`).
"""
from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import zstandard

from glm_lora.artifacts.manifest import fsync, sha256_file, sha256_json, swap_into_place
from glm_lora.artifacts.lock import pid_alive
from glm_lora.configs.errors import UserError

MODEL, OPTIMIZER, RNG, TRAINER_STATE, MANIFEST = (
    "model.safetensors", "optimizer.pt.zst", "rng.json", "trainer_state.json", "manifest.json")
RANKS, DCP_DIR = "ranks.json", "dcp"       # several processes: per-rank states; FSDP2's sharded files
BEST = "best"
FORMAT = "glm-lora-checkpoint/1"
FORMAT_SHARDED = "glm-lora-checkpoint-dcp/1"
ZSTD_LEVEL = 3          # the choice; fp32 moments barely compress at any level, so stay fast
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_SCRATCH_DIR = re.compile(r"^\.(?:tmp|old)-(?:step-\d{8,}|best)-(\d+)$")     # our temp / replaced dirs, by pid


class CheckpointError(RuntimeError):
    pass


class CorruptCheckpoint(CheckpointError):
    """A checkpoint that fails verification; the message starts with the offending file's path."""


class CheckpointUnusable(CheckpointError, UserError):
    """Checkpoints exist but none verifies, or the best weights don't: resuming would silently
    restart (and overwrite the good best weights), so the stage stops and says what to do."""


@dataclass
class Checkpoint:
    """What `latest()` loads back (all tensors on CPU)."""

    step: int
    path: Path
    weights: dict[str, torch.Tensor]      # trainable weights only (LoRA stages: the adapter)
    optimizer: dict | None                # optimizer.state_dict(); None for a model-only save
    rng: dict                             # as captured by engine.checkpoint.capture_rng()
    trainer_state: dict                   # exactly what the loop passed to save()
    manifest: dict = field(default_factory=dict)   # sizes, hashes, optimizer raw/compressed bytes
    ranks: list | None = None             # several processes: {rng, data_state} of every rank
    dcp: Path | None = None               # a sharded (DCP) checkpoint: its files; weights/optimizer then empty

    @property
    def has_optimizer(self) -> bool:
        return self.optimizer is not None or (self.dcp is not None and bool(self.manifest.get("optimizer")))


# ---------------------------------------------------------------- host snapshot

def _to_host(obj: Any, cuda_devices: set) -> Any:
    """Deep copy with every tensor copied to (pinned, when from CUDA) CPU memory.

    CUDA copies are only enqueued here (non_blocking); the caller synchronises once for all.
    Pinned buffers come from torch's caching host allocator, so repeated saves reuse them.
    """
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.is_cuda:
            cuda_devices.add(t.device)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)
        return t.to("cpu", copy=True, memory_format=torch.contiguous_format)   # safetensors needs contiguous
    if isinstance(obj, dict):
        return {k: _to_host(v, cuda_devices) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v, cuda_devices) for v in obj)
    return copy.deepcopy(obj)


def _snapshot(weights: dict, optimizer: dict | None) -> tuple[dict, dict | None]:
    devices: set = set()
    w = _to_host(weights, devices)
    o = _to_host(optimizer, devices) if optimizer is not None else None
    for d in devices:
        torch.cuda.synchronize(d)
    return w, o


# ---------------------------------------------------------------- files

def _write_file(path: Path, data: bytes) -> None:
    """Write and fsync one file (a module-level hook: tests slow it down or make it fail)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_manifest(step_dir: Path, manifest: dict) -> bytes:
    """Seal `manifest` with its own checksum and write it into the step directory; return the bytes written."""
    manifest["manifest_sha256"] = _manifest_checksum(manifest)
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    _write_file(step_dir / MANIFEST, data)
    return data


def _manifest_checksum(manifest: dict) -> str:
    return sha256_json({k: v for k, v in manifest.items() if k != "manifest_sha256"})


def _file_entry(path: Path) -> dict:
    """A file's manifest entry."""
    return {"sha256": sha256_file(path), "size": path.stat().st_size}


def _fresh_dir(path: Path) -> None:
    """An empty directory at `path` (a stale one of an earlier attempt removed first)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir()


def _write_states(tmp: Path, rng_json: str, ranks_json: str | None, state_json: str) -> None:
    """The JSON files of a save (ranks.json only with several processes)."""
    _write_file(tmp / RNG, rng_json.encode())
    if ranks_json is not None:
        _write_file(tmp / RANKS, ranks_json.encode())
    _write_file(tmp / TRAINER_STATE, state_json.encode())


def _write_optimizer(tmp: Path, optimizer: dict) -> dict:
    """optimizer.pt.zst; the manifest's "optimizer" entry (raw and compressed sizes)."""
    buf = io.BytesIO()
    torch.save(optimizer, buf)
    raw = buf.getbuffer()
    packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)   # records content size
    _write_file(tmp / OPTIMIZER, packed)      # (the buffers are freed on return, before the hashing)
    return {"raw_bytes": len(raw), "compressed_bytes": len(packed),
            "ratio": len(raw) / max(len(packed), 1), "zstd_level": ZSTD_LEVEL}


def _write_plain_files(tmp: Path, weights: dict, optimizer: dict | None, rng_json: str, ranks_json: str | None,
                       state_json: str) -> dict:
    """Every file of a plain (one-writer) checkpoint but the manifest; its manifest fields."""
    _fresh_dir(tmp)
    safetensors.torch.save_file(weights, str(tmp / MODEL), metadata={"format": "pt"})
    fsync(tmp / MODEL)
    opt_sizes = _write_optimizer(tmp, optimizer) if optimizer is not None else None
    _write_states(tmp, rng_json, ranks_json, state_json)
    return {"format": FORMAT, "optimizer": opt_sizes}


def _step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


# ---------------------------------------------------------------- verified reading

def _bad(path: Path, name: str, why: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{path / name}: {why}")


def _step_manifest(path: Path, step: int) -> dict:
    """The manifest of step dir `path` if it is intact, is step `step`'s and lists every file a load needs."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise _bad(path, MANIFEST, "missing (the save did not finish)") from None
    except (OSError, ValueError) as e:
        raise _bad(path, MANIFEST, f"unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("manifest_sha256") != _manifest_checksum(manifest):
        raise _bad(path, MANIFEST, "its checksum does not match its content")
    if manifest.get("step") != step:
        raise _bad(path, MANIFEST, f"says step {manifest.get('step')}, the directory name says {step}")
    files = manifest.get("files", {})
    required = ((RNG, TRAINER_STATE, RANKS, f"{DCP_DIR}/.metadata") if manifest.get("format") == FORMAT_SHARDED else
                (MODEL, RNG, TRAINER_STATE) + ((OPTIMIZER,) if manifest.get("optimizer") else ()))
    for name in required:
        if name not in files:
            raise _bad(path, name, "not listed in the manifest")
    return manifest


def _check_entry(path: Path, name: str, entry: dict, size: int, sha256: Callable[[], str]) -> None:
    """Raise unless a file's size and sha256 (computed only if the size matches) are its manifest entry's."""
    if size != entry["size"]:
        raise _bad(path, name, f"size {size} != {entry['size']} in the manifest (truncated?)")
    if sha256() != entry["sha256"]:
        raise _bad(path, name, "sha256 does not match the manifest (corrupted)")


def _read_checked(path: Path, name: str, entry: dict, verify: bool) -> bytes:
    """A file's bytes, checked against its manifest entry when `verify`."""
    try:
        data = (path / name).read_bytes()
    except OSError as e:
        raise _bad(path, name, f"unreadable ({e})") from None
    if verify:
        _check_entry(path, name, entry, len(data), lambda: hashlib.sha256(data).hexdigest())
    return data


def _check_streamed(path: Path, name: str, entry: dict) -> None:
    """Check a file against its manifest entry without holding it in memory (DCP's files can be large)."""
    try:
        size, digest = (path / name).stat().st_size, sha256_file(path / name)
    except OSError as e:
        raise _bad(path, name, f"unreadable ({e})") from None
    _check_entry(path, name, entry, size, lambda: digest)


def _parsed(path: Path, name: str, parse: Callable[[bytes], Any], data: bytes, errors: type = ValueError) -> Any:
    """parse(data), the bytes of file `name`; a failure (`errors`) reported as that file not loadable."""
    try:
        return parse(data)
    except errors as e:
        raise _bad(path, name, f"not loadable ({e})") from None


def _load_sharded(step: int, path: Path, manifest: dict, verify: bool) -> Checkpoint:
    """A DCP checkpoint: its files verified (DCP's are loaded later, into the model) and the JSON files read."""
    files = manifest.get("files", {})
    for name, entry in files.items():
        if name.startswith(f"{DCP_DIR}/") and verify:
            _check_streamed(path, name, entry)
    blobs = {name: _read_checked(path, name, files[name], verify) for name in (RNG, TRAINER_STATE, RANKS)}
    parsed = {name: _parsed(path, name, json.loads, blob) for name, blob in blobs.items()}
    return Checkpoint(step=step, path=path, weights={}, optimizer=None, rng=parsed[RNG],
                      trainer_state=parsed[TRAINER_STATE], manifest=manifest, ranks=parsed[RANKS],
                      dcp=path / DCP_DIR)


def _read_optimizer(data: bytes) -> dict:
    return torch.load(io.BytesIO(zstandard.ZstdDecompressor().decompress(data)), weights_only=True)


def _load_plain(step: int, path: Path, manifest: dict, verify: bool) -> Checkpoint:
    # Hash everything before parsing anything: a model-only fallback must verify as a whole.
    blobs = {name: _read_checked(path, name, entry, verify) for name, entry in manifest.get("files", {}).items()}
    weights = _parsed(path, MODEL, safetensors.torch.load, blobs[MODEL], Exception)
    optimizer = _parsed(path, OPTIMIZER, _read_optimizer, blobs[OPTIMIZER], Exception) if OPTIMIZER in blobs else None
    rng = _parsed(path, RNG, json.loads, blobs[RNG])
    trainer_state = _parsed(path, TRAINER_STATE, json.loads, blobs[TRAINER_STATE])
    ranks = _parsed(path, RANKS, json.loads, blobs[RANKS]) if RANKS in blobs else None
    return Checkpoint(step=step, path=path, weights=weights, optimizer=optimizer, rng=rng,
                      trainer_state=trainer_state, manifest=manifest, ranks=ranks)


# ---------------------------------------------------------------- manager

class CheckpointManager:
    """Save, prune and find checkpoints under `root`; one per process writing (rank 0).

    Pruning keeps the `keep_last` newest complete checkpoints plus the newest one holding
    optimizer state (with model-only saves in between, that one is what an exact resume needs).
    `keep_last >= 2` also guards against a newest checkpoint that rots on disk later: pruning
    checks sizes only, `latest()` checks hashes.
    """

    def __init__(self, root: Path, *, keep_last: int = 2, async_save: bool = True,
                 log: logging.Logger = logging.getLogger("glm_lora.checkpoint"), dist=None):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_last, self.async_save, self.log = keep_last, async_save, log
        self.dist = dist                         # engine.dist.Dist for sharded saves (save_sharded)
        self.stats: list[dict] = []
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self._writing: Path | None = None        # temp dir of the write in flight
        self._closed = False
        self._future = None                      # a sharded async save in flight on a rank other than 0
        self._pid0: int | None = None            # rank 0's pid: names a sharded save's temp dir on every rank
        self._group = None                       # gloo group of sharded async saves (apart from training's)

    # ---- saving

    def save(self, step: int, *, weights: dict[str, torch.Tensor], optimizer: dict | None,
             trainer_state: dict, rng: dict, ranks: list | None = None) -> float:
        """Snapshot to host memory now, write in the background; return the seconds the caller waited.

        After this returns the caller may change every tensor it passed. The stall includes waiting
        for the previous write, if it is still running. JSON-incompatible trainer_state/rng values
        raise here, in the caller, not later in the thread.
        """
        t0, waited = self._begin()
        state_json = json.dumps(trainer_state, indent=1)   # also a snapshot: later changes don't leak in
        rng_json = json.dumps(rng)
        ranks_json = json.dumps(ranks) if ranks is not None else None
        w, o = _snapshot(weights, optimizer)
        stat = {"step": step, "wait_prev_s": waited, "copy_s": time.perf_counter() - t0 - waited}
        self.stats.append(stat)
        args = (step, w, o, rng_json, state_json, stat, ranks_json)
        if self.async_save:
            stat["stall_s"] = time.perf_counter() - t0     # set before the thread can log it
            self._in_background(step, self._write, *args)
        else:
            self._write(*args)
            stat["stall_s"] = time.perf_counter() - t0
        return stat["stall_s"]

    def save_sharded(self, step: int, state: dict, *, trainer_state: dict, rng: dict, ranks: list,
                     with_optimizer: bool) -> float:
        """Every rank calls this at once with its shards, `state` = {"model": ..., ["optim": ...]} as
        torch.distributed.checkpoint.state_dict gives them (see the module docstring); the seconds this
        rank waited. Rank 0's trainer_state / rng / ranks are written; the other ranks' are ignored."""
        t0, waited = self._begin()
        d = self.dist
        if self._pid0 is None:
            self._pid0 = d.broadcast(os.getpid())
        tmp = self._tmp_dir(_step_dir_name(step), self._pid0)
        jsons = (json.dumps(rng), json.dumps(ranks), json.dumps(trainer_state, indent=1))
        if d.main:
            _fresh_dir(tmp)
            self._writing = tmp
        d.barrier()                  # the temp dir exists (and holds nothing stale) before anyone writes
        stat = {"step": step, "wait_prev_s": waited}
        self.stats.append(stat)
        try:
            self._save_shards(step, state, tmp, jsons, with_optimizer, stat, t0)
        except BaseException:
            if d.main:
                self._abandon(tmp)
            raise
        return stat["stall_s"]

    def _save_shards(self, step: int, state: dict, tmp: Path, jsons: tuple, with_optimizer: bool, stat: dict,
                     t0: float) -> None:
        """DCP writes every rank's shards into tmp/dcp/; rank 0 then finishes the checkpoint (in its writer
        thread with checkpoint.async_save, once the shards are on disk)."""
        import torch.distributed as tdist
        import torch.distributed.checkpoint as dcp

        d = self.dist
        if not self.async_save:
            dcp.save(state, checkpoint_id=str(tmp / DCP_DIR))   # returns once every rank's shards are written
            if d.main:
                self._finish_sharded(step, tmp, jsons, with_optimizer, stat)
            stat["stall_s"] = time.perf_counter() - t0
            return
        if self._group is None:
            self._group = tdist.new_group(backend="gloo")
        future = dcp.async_save(state, checkpoint_id=str(tmp / DCP_DIR), process_group=self._group)
        stat["stall_s"] = time.perf_counter() - t0      # the copy to host memory
        if d.main:
            self._in_background(step, self._finish_sharded, step, tmp, jsons, with_optimizer, stat, future)
        else:
            self._future = (step, future)

    def _finish_sharded(self, step: int, tmp: Path, jsons: tuple, with_optimizer: bool, stat: dict,
                        future=None) -> None:
        """Rank 0, after every rank's DCP files are written (an async save's `future` is waited for here):
        the JSON files, the manifest (last), rename."""
        if future is not None:
            try:
                future.result()          # rank 0's future: done when every rank's shards are on disk
            except BaseException:
                self._abandon(tmp)
                raise
        rng_json, ranks_json, state_json = jsons
        world = self.dist.world_size

        def write_files() -> dict:
            _write_states(tmp, rng_json, ranks_json, state_json)
            return {"format": FORMAT_SHARDED, "world_size": world,
                    "optimizer": {"sharded": True} if with_optimizer else None}

        def report(manifest: dict) -> None:
            self.log.info("checkpoint %s (sharded over %d ranks): finish %.3fs, %.2f MB%s", _step_dir_name(step),
                          world, stat["write_s"], stat["bytes"] / 1e6, "" if with_optimizer else ", model only")

        self._publish_step(step, tmp, write_files, stat, report)

    def _write(self, step: int, weights: dict, optimizer: dict | None, rng_json: str, state_json: str,
               stat: dict, ranks_json: str | None = None) -> None:
        """A plain checkpoint (one writer: the weights and optimizer state are whole), from its host snapshot."""
        tmp = self._tmp_dir(_step_dir_name(step), os.getpid())
        self._writing = tmp
        self._publish_step(step, tmp, lambda: _write_plain_files(tmp, weights, optimizer, rng_json, ranks_json,
                                                                 state_json),
                           stat, lambda manifest: self._report_plain(step, stat, manifest["optimizer"]))

    def _report_plain(self, step: int, stat: dict, opt_sizes: dict | None) -> None:
        stat.update(optimizer_raw_bytes=opt_sizes["raw_bytes"] if opt_sizes else 0,
                    optimizer_compressed_bytes=opt_sizes["compressed_bytes"] if opt_sizes else 0)
        opt_note = (f", optimizer {stat['optimizer_raw_bytes'] / 1e6:.2f} → "
                    f"{stat['optimizer_compressed_bytes'] / 1e6:.2f} MB (zstd ratio {opt_sizes['ratio']:.3f})"
                    if opt_sizes else ", model only")
        stall = f"stall {stat['stall_s']:.3f}s, " if "stall_s" in stat else "synchronous, "   # sync: stall = write
        self.log.info("checkpoint %s: %swrite %.3fs, %.2f MB%s", _step_dir_name(step), stall, stat["write_s"],
                      stat["bytes"] / 1e6, opt_note)

    def _publish_step(self, step: int, tmp: Path, write_files: Callable[[], dict], stat: dict,
                      report: Callable[[dict], None]) -> None:
        """How every checkpoint save ends, plain and sharded alike: `write_files()` writes the save's own
        files into `tmp` and returns its manifest fields; then the manifest, written last (sha256 + size of
        every file under tmp, sealed with its own checksum), fsync of every directory, one rename into place;
        then stat's write_s / bytes, `report(manifest)` (the log line) and pruning. A failure removes the temp dir;
        either way it is no longer the write in flight."""
        t0 = time.perf_counter()
        try:
            fields = write_files()
            files = {str(p.relative_to(tmp)): _file_entry(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
            manifest = {**fields, "step": step, "files": files,
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            manifest_bytes = _write_manifest(tmp, manifest)
            for sub in sorted(p for p in tmp.rglob("*") if p.is_dir()):    # a sharded save's dcp/
                fsync(sub)
            fsync(tmp)
            self._publish(tmp, self.root / _step_dir_name(step))
        except BaseException:
            self._abandon(tmp)
            raise
        self._writing = None
        stat.update(write_s=time.perf_counter() - t0,
                    bytes=sum(f["size"] for f in files.values()) + len(manifest_bytes))
        report(manifest)
        self._prune()

    def _begin(self) -> tuple[float, float]:
        """Start a save: when it started, and the seconds spent waiting for the write in flight."""
        if self._closed:
            raise CheckpointError("CheckpointManager is closed")
        t0 = time.perf_counter()
        self.wait()
        return t0, time.perf_counter() - t0

    def _tmp_dir(self, name: str, pid: int) -> Path:
        return self.root / f".tmp-{name}-{pid}"

    def _abandon(self, tmp: Path) -> None:
        """A save failed: its temp dir goes, and it is no longer in flight."""
        shutil.rmtree(tmp, ignore_errors=True)
        self._writing = None

    def _in_background(self, step: int, fn: Callable, *args) -> None:
        self._thread = threading.Thread(target=self._run, args=(step, fn, *args), name=f"checkpoint-step-{step}")
        self._thread.start()

    def _run(self, step: int, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:      # handed to the caller by the next save/wait/close
            self._error = (step, e)

    def wait(self) -> None:
        """Block until the write in flight is on disk; raise if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._future is not None:
            step, future = self._future
            self._future = None
            try:
                future.result()
            except BaseException as e:
                self._error = (step, e)
        if self._error is not None:
            step, err = self._error
            self._error = None
            raise CheckpointError(f"saving checkpoint step {step} under {self.root} failed: {err!r}") from err

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._closed = True

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _publish(self, tmp: Path, final: Path) -> None:
        """Rename into place. Re-saving an existing step (a model-only save, then the stop-signal
        save with optimizer state) swaps it through `.old-*`; a crash between those two renames
        loses that one step, never an older checkpoint."""
        swap_into_place(tmp, final, self.root / f".old-{final.name}-{os.getpid()}")

    def _prune(self) -> None:
        """Keep the keep_last newest complete checkpoints + the newest with optimizer state;
        drop every other step dir older than the newest kept (broken ones included)."""
        complete = [(s, p, m) for s, p in reversed(self._step_dirs()) if (m := self._quick_manifest(p))]
        if not complete:
            return
        keep = {p for _, p, _ in complete[:self.keep_last]}
        with_optimizer = [p for _, p, m in complete if m.get("optimizer")]
        keep.update(with_optimizer[:1])
        newest = complete[0][0]
        for s, p in self._step_dirs():
            if p not in keep and s < newest:
                self.log.info("pruning checkpoint %s", p.name)
                shutil.rmtree(p, ignore_errors=True)

    def _quick_manifest(self, path: Path) -> dict | None:
        """The manifest if it parses and every file has its recorded size (no hashing), else None."""
        try:
            m = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
            ok = m.get("manifest_sha256") == _manifest_checksum(m) and all(
                (path / name).stat().st_size == e["size"] for name, e in m["files"].items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return m if ok else None

    # ---- the best weights by validation loss (early stopping carries these forward)

    def save_best(self, weights: dict[str, torch.Tensor], *, step: int, val_loss: float) -> None:
        """Replace root/best/ atomically: model.safetensors + a verifiable manifest."""
        tmp = self._tmp_dir(BEST, os.getpid())
        try:
            _fresh_dir(tmp)
            safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / MODEL),
                                        metadata={"format": "pt"})
            fsync(tmp / MODEL)
            _write_manifest(tmp, {"format": FORMAT, "step": step, "val_loss": val_loss,
                                  "files": {MODEL: _file_entry(tmp / MODEL)}})
            fsync(tmp)
            self._publish(tmp, self.root / BEST)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def best_step(self) -> int | None:
        """The step the saved best weights claim (unverified), or None if there are none."""
        try:
            return json.loads((self.root / BEST / MANIFEST).read_text(encoding="utf-8"))["step"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def load_best(self, step: int) -> dict[str, torch.Tensor] | None:
        """The saved best weights if they are the ones recorded at `step` (None otherwise).

        Raises CheckpointUnusable if they fail verification: carrying a flipped byte forward as the
        stage's output is worse than stopping.
        """
        path = self.root / BEST
        if not path.is_dir():
            return None
        try:
            manifest = json.loads((path / MANIFEST).read_bytes().decode("utf-8"))
            ok = isinstance(manifest, dict) and manifest.get("manifest_sha256") == _manifest_checksum(manifest)
            entry = manifest["files"][MODEL] if ok else None
            data = (path / MODEL).read_bytes() if ok else b""
        except (OSError, ValueError, KeyError, TypeError) as e:
            ok, why = False, f"unreadable ({e})"
        else:
            why = "its manifest checksum does not match" if not ok else ""
            if ok and (len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]):
                ok, why = False, "sha256 does not match its manifest (corrupted)"
        if not ok:
            raise CheckpointUnusable(
                f"{path / MODEL}: the best weights of this stage fail verification: {why}. Delete {self.root} "
                "to train the stage again from the start")
        if manifest.get("step") != step:
            return None
        return safetensors.torch.load(data)

    # ---- finding and loading

    def list(self) -> list[Path]:
        """Published checkpoint dirs, oldest first (not verified; temp dirs excluded)."""
        return [p for _, p in self._step_dirs()]

    def _step_dirs(self) -> list[tuple[int, Path]]:
        out = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
        return sorted(out)

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies and holds optimizer state (an exact resume); if none
        does, the newest verified model-only one (`optimizer` None: the loop starts a fresh
        optimizer, and says so); None if nothing verifies.

        Verification re-hashes every file against the manifest. Checkpoints failing it are logged
        (naming the file) and skipped; if there are checkpoints and none verifies, CheckpointUnusable
        is raised rather than silently starting over. Leftover temp dirs of dead writers are removed.
        """
        self._remove_scratch()
        fallback: Checkpoint | None = None
        failures = []
        for step, path in reversed(self._step_dirs()):
            try:
                ckpt = self._load(step, path)
            except CorruptCheckpoint as e:
                self.log.warning("skipping checkpoint %s: %s", path, e)
                failures.append(str(e))
                continue
            if ckpt.has_optimizer:
                if fallback is not None:
                    self.log.info("newest verified checkpoint %s is model-only; using %s, the newest with "
                                  "optimizer state (exact resume)", fallback.path.name, path.name)
                return ckpt
            if fallback is None:
                fallback = ckpt
        if fallback is not None:
            self.log.warning("no verified checkpoint with optimizer state under %s; using model-only %s",
                             self.root, fallback.path.name)
        elif failures:
            raise CheckpointUnusable(
                f"none of the {len(failures)} checkpoints under {self.root} verifies ({'; '.join(failures[:3])}); "
                f"refusing to start over and overwrite them. Delete {self.root} (or set checkpoint.resume: never) "
                "to train the stage again from the start")
        return fallback

    def _remove_scratch(self) -> None:
        for p in self.root.iterdir():
            m = _SCRATCH_DIR.match(p.name)
            if not m or p == self._writing:
                continue
            pid = int(m.group(1))
            if pid == os.getpid() or not pid_alive(pid):
                self.log.info("removing leftover %s (an interrupted save)", p.name)
                shutil.rmtree(p, ignore_errors=True)

    def load(self, step: int, path: Path) -> Checkpoint:
        """A checkpoint another rank has verified (rank 0's `latest()`): read, not hashed again."""
        return self._load(step, Path(path), verify=False)

    def _load(self, step: int, path: Path, verify: bool = True) -> Checkpoint:
        """Step dir `path` read back, its files checked against the manifest when `verify`; raises
        CorruptCheckpoint naming the first file that fails."""
        manifest = _step_manifest(path, step)
        if manifest.get("format") == FORMAT_SHARDED:
            return _load_sharded(step, path, manifest, verify)
        return _load_plain(step, path, manifest, verify)
