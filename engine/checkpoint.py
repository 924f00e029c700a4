"""Checkpoints: the loop's `Checkpointer` (resume, scheduled saves, best weights) over the files of
a `CheckpointManager` (atomic, verified, written in the background).

The loop sees three calls: `restore(model, opt) -> TrainState | None` on start, `maybe_save(...)` at
each step boundary, `save_best(...)` / `restore_best(...)` around validation. Everything a resume
needs is behind them: the config compatibility check, weight matching, optimizer and RNG restore,
file verification. `Checkpointer.for_stage` is the one place that decides which directory a
stage's checkpoints live in and which settings a resume must match.

One checkpoint is a directory `root/step-XXXXXXXX/` (8-digit, zero-padded step):

    model.safetensors    trainable weights only (LoRA stages: the adapter)
    optimizer.pt.zst     torch.save(optimizer.state_dict()), zstandard level 3 (absent in model-only saves)
    rng.json             python / numpy / torch CPU / CUDA generator states (see capture_rng)
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
renames. Resume on another number of ranks M (1 included, without a process group): DCP reshards on
load into whatever the model is now (sharded, replicated or plain); a DDP / one-process checkpoint
loads into a sharded model as whole tensors. The RNG states and data position of the same rank come
back when M equals the saved world size (an exact resume); otherwise rank 0's RNG states and the
data position continue approximately (data/pipeline.py, `_continue_elsewhere`).
"""
from __future__ import annotations

import base64
import copy
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import zstandard

from artifacts import code_version, fsync, read_manifest, sha256_file, sha256_json, swap_into_place
from artifacts.lock import pid_alive
from configs.errors import UserError
from configs.schema import CheckpointConfig, Config, TrainConfig

MODEL, OPTIMIZER, RNG, TRAINER_STATE, MANIFEST = (
    "model.safetensors", "optimizer.pt.zst", "rng.json", "trainer_state.json", "manifest.json")
RANKS, DCP_DIR = "ranks.json", "dcp"       # several processes: per-rank states; FSDP2's sharded files
BEST = "best"
FORMAT = "glm-lora-checkpoint/1"
FORMAT_SHARDED = "glm-lora-checkpoint-dcp/1"
ZSTD_LEVEL = 3          # the choice; fp32 moments barely compress at any level, so stay fast
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_SCRATCH_DIR = re.compile(r"^\.(?:tmp|old)-(?:step-\d{8,}|best)-(\d+)$")     # our temp / replaced dirs, by pid
CODE_VERSION = code_version(("data", "engine", "kernels", "model"))


class CheckpointError(RuntimeError):
    pass


class CorruptCheckpoint(CheckpointError):
    """A checkpoint that fails verification; the message starts with the offending file's path."""


class CheckpointUnusable(CheckpointError, UserError):
    """Checkpoints exist but none verifies, or the best weights don't: resuming would silently
    restart (and overwrite the good best weights), so the stage stops and says what to do."""


class IncompatibleResumeError(UserError, RuntimeError):
    """The newest checkpoint was made with settings a resume must match (see Checkpointer.for_stage)."""


@dataclass
class Checkpoint:
    """What `latest()` loads back (all tensors on CPU)."""

    step: int
    path: Path
    weights: dict[str, torch.Tensor]      # trainable weights only (LoRA stages: the adapter)
    optimizer: dict | None                # optimizer.state_dict(); None for a model-only save
    rng: dict                             # as captured by capture_rng()
    trainer_state: dict                   # exactly what the loop passed to save()
    manifest: dict = field(default_factory=dict)   # sizes, hashes, optimizer raw/compressed bytes
    ranks: list | None = None             # several processes: {rng, data_state} of every rank
    dcp: Path | None = None               # a sharded (DCP) checkpoint: its files; weights/optimizer then empty

    @property
    def has_optimizer(self) -> bool:
        return self.optimizer is not None or (self.dcp is not None and bool(self.manifest.get("optimizer")))


# ---------------------------------------------------------------- random generators

def capture_rng() -> dict:
    """Every global generator the loop draws from, as JSON-ready values.

    CUDA generators are captured only once CUDA is initialised: querying them earlier would
    create a context on every visible GPU (bad under torchrun), and an unused generator still
    holds exactly what the next run's seeding gives it.
    """
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": _b64(torch.get_rng_state()),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict, log: logging.Logger = logging.getLogger("glm_lora.checkpoint")) -> None:
    """Put every generator back so the next draws equal those the saving run would have made."""
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    cuda = state.get("cuda") or []
    if cuda:
        if not torch.cuda.is_available():
            log.warning("checkpoint holds %d CUDA generator states but no CUDA device is visible; "
                        "GPU-side randomness (dropout) will differ from the saved run", len(cuda))
            return
        n = torch.cuda.device_count()
        if n != len(cuda):
            log.warning("checkpoint holds %d CUDA generator states, %d devices visible; restoring the first %d",
                        len(cuda), n, min(n, len(cuda)))
        for i, s in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(_unb64(s), device=i)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


# ---------------------------------------------------------------- resume compatibility

def config_diff(saved: dict, current: dict, keys: list[str]) -> list[str]:
    """Dotted keys whose values differ between two configs (for refusing an incompatible resume).

    A key naming a sub-dict is compared leaf by leaf and reported as its differing leaves
    (`model` → `model.hidden_size`). Missing on one side counts as a difference; missing on both
    does not. Values are compared after a JSON round trip, so a tuple equals the list the saved
    JSON gives back, and a Path its string.
    """
    saved, current = _jsonable(saved), _jsonable(current)
    out: list[str] = []
    for key in keys:
        for k in _diff(_get(saved, key), _get(current, key), key):
            if k not in out:
                out.append(k)
    return out


_MISSING = object()


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def _get(d: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return _MISSING
        d = d[part]
    return d


def _diff(a: Any, b: Any, prefix: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for sub in sorted(a.keys() | b.keys())
                for k in _diff(a.get(sub, _MISSING), b.get(sub, _MISSING), f"{prefix}.{sub}")]
    return [] if a == b else [prefix]


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


def _step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


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
        if self._closed:
            raise CheckpointError("CheckpointManager is closed")
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        state_json = json.dumps(trainer_state, indent=1)   # also a snapshot: later changes don't leak in
        rng_json = json.dumps(rng)
        ranks_json = json.dumps(ranks) if ranks is not None else None
        w, o = _snapshot(weights, optimizer)
        stat = {"step": step, "wait_prev_s": waited, "copy_s": time.perf_counter() - t0 - waited}
        self.stats.append(stat)
        if self.async_save:
            self._thread = threading.Thread(target=self._run, args=(step, w, o, rng_json, state_json, stat,
                                                                    ranks_json), name=f"checkpoint-step-{step}")
            stat["stall_s"] = time.perf_counter() - t0     # set before the thread can log it
            self._thread.start()
        else:
            self._write(step, w, o, rng_json, state_json, stat, ranks_json)
            stat["stall_s"] = time.perf_counter() - t0
        return stat["stall_s"]

    def save_sharded(self, step: int, state: dict, *, trainer_state: dict, rng: dict, ranks: list,
                     with_optimizer: bool) -> float:
        """Every rank calls this at once with its shards, `state` = {"model": ..., ["optim": ...]} as
        torch.distributed.checkpoint.state_dict gives them (see the module docstring); the seconds this
        rank waited. Rank 0's trainer_state / rng / ranks are written; the other ranks' are ignored."""
        import torch.distributed as tdist
        import torch.distributed.checkpoint as dcp

        if self._closed:
            raise CheckpointError("CheckpointManager is closed")
        d = self.dist
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        if self._pid0 is None:
            self._pid0 = d.broadcast(os.getpid())
        tmp = self.root / f".tmp-{_step_dir_name(step)}-{self._pid0}"
        jsons = (json.dumps(rng), json.dumps(ranks), json.dumps(trainer_state, indent=1))
        if d.main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            self._writing = tmp
        d.barrier()                  # the temp dir exists (and holds nothing stale) before anyone writes
        stat = {"step": step, "wait_prev_s": waited}
        self.stats.append(stat)
        try:
            if self.async_save:
                if self._group is None:
                    self._group = tdist.new_group(backend="gloo")
                future = dcp.async_save(state, checkpoint_id=str(tmp / DCP_DIR), process_group=self._group)
                stat["stall_s"] = time.perf_counter() - t0      # the copy to host memory
                if d.main:
                    self._thread = threading.Thread(target=self._run_sharded, args=(future, step, tmp, jsons,
                                                    with_optimizer, stat), name=f"checkpoint-step-{step}")
                    self._thread.start()
                else:
                    self._future = (step, future)
            else:
                dcp.save(state, checkpoint_id=str(tmp / DCP_DIR))   # returns once every rank's shards are written
                if d.main:
                    self._finish_sharded(step, tmp, jsons, with_optimizer, stat)
                stat["stall_s"] = time.perf_counter() - t0
        except BaseException:
            if d.main:
                shutil.rmtree(tmp, ignore_errors=True)
                self._writing = None
            raise
        return stat["stall_s"]

    def _run_sharded(self, future, step: int, tmp: Path, jsons: tuple, with_optimizer: bool, stat: dict) -> None:
        try:
            future.result()              # rank 0's future: done when every rank's shards are on disk
            self._finish_sharded(step, tmp, jsons, with_optimizer, stat)
        except BaseException as e:       # handed to the caller by the next save/wait/close
            shutil.rmtree(tmp, ignore_errors=True)
            self._writing = None
            self._error = (step, e)

    def _finish_sharded(self, step: int, tmp: Path, jsons: tuple, with_optimizer: bool, stat: dict) -> None:
        """Rank 0, after every rank's DCP files are written: the JSON files, the manifest (last), rename."""
        t0 = time.perf_counter()
        rng_json, ranks_json, state_json = jsons
        try:
            _write_file(tmp / RNG, rng_json.encode())
            _write_file(tmp / RANKS, ranks_json.encode())
            _write_file(tmp / TRAINER_STATE, state_json.encode())
            files = {str(p.relative_to(tmp)): {"sha256": sha256_file(p), "size": p.stat().st_size}
                     for p in sorted(tmp.rglob("*")) if p.is_file()}
            manifest = {"format": FORMAT_SHARDED, "step": step, "files": files, "world_size": self.dist.world_size,
                        "optimizer": {"sharded": True} if with_optimizer else None,
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            manifest_bytes = _write_manifest(tmp, manifest)
            fsync(tmp / DCP_DIR)
            fsync(tmp)
            self._publish(tmp, self.root / _step_dir_name(step))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            self._writing = None
        stat.update(write_s=time.perf_counter() - t0, bytes=sum(f["size"] for f in files.values()) + len(manifest_bytes))
        self.log.info("checkpoint %s (sharded over %d ranks): finish %.3fs, %.2f MB%s", _step_dir_name(step),
                      self.dist.world_size, stat["write_s"], stat["bytes"] / 1e6,
                      "" if with_optimizer else ", model only")
        self._prune()

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

    def _run(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as e:      # handed to the caller by the next save/wait/close
            self._error = (args[0], e)

    def _write(self, step: int, weights: dict, optimizer: dict | None, rng_json: str, state_json: str,
               stat: dict, ranks_json: str | None = None) -> None:
        t0 = time.perf_counter()
        tmp = self.root / f".tmp-{_step_dir_name(step)}-{os.getpid()}"
        self._writing = tmp
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            safetensors.torch.save_file(weights, str(tmp / MODEL), metadata={"format": "pt"})
            fsync(tmp / MODEL)
            opt_sizes = None
            if optimizer is not None:
                buf = io.BytesIO()
                torch.save(optimizer, buf)
                raw = buf.getbuffer()
                packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)   # records content size
                _write_file(tmp / OPTIMIZER, packed)
                opt_sizes = {"raw_bytes": len(raw), "compressed_bytes": len(packed),
                             "ratio": len(raw) / max(len(packed), 1), "zstd_level": ZSTD_LEVEL}
                del raw, buf, packed
            _write_file(tmp / RNG, rng_json.encode())
            if ranks_json is not None:
                _write_file(tmp / RANKS, ranks_json.encode())
            _write_file(tmp / TRAINER_STATE, state_json.encode())
            files = {p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
                     for p in sorted(tmp.iterdir())}
            manifest = {"format": FORMAT, "step": step, "files": files, "optimizer": opt_sizes,
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            manifest_bytes = _write_manifest(tmp, manifest)
            fsync(tmp)
            self._publish(tmp, self.root / _step_dir_name(step))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            self._writing = None
        stat.update(write_s=time.perf_counter() - t0,
                    bytes=sum(f["size"] for f in files.values()) + len(manifest_bytes),
                    optimizer_raw_bytes=opt_sizes["raw_bytes"] if opt_sizes else 0,
                    optimizer_compressed_bytes=opt_sizes["compressed_bytes"] if opt_sizes else 0)
        opt_note = (f", optimizer {stat['optimizer_raw_bytes'] / 1e6:.2f} → "
                    f"{stat['optimizer_compressed_bytes'] / 1e6:.2f} MB (zstd ratio {opt_sizes['ratio']:.3f})"
                    if opt_sizes else ", model only")
        stall = f"stall {stat['stall_s']:.3f}s, " if "stall_s" in stat else "synchronous, "   # sync: stall = write
        self.log.info("checkpoint %s: %swrite %.3fs, %.2f MB%s", _step_dir_name(step), stall, stat["write_s"],
                      stat["bytes"] / 1e6, opt_note)
        self._prune()

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
        tmp = self.root / f".tmp-{BEST}-{os.getpid()}"
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / MODEL),
                                        metadata={"format": "pt"})
            fsync(tmp / MODEL)
            manifest = {"format": FORMAT, "step": step, "val_loss": val_loss,
                        "files": {MODEL: {"sha256": sha256_file(tmp / MODEL), "size": (tmp / MODEL).stat().st_size}}}
            manifest["manifest_sha256"] = _manifest_checksum(manifest)
            _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
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
        def bad(name: str, why: str) -> CorruptCheckpoint:
            return CorruptCheckpoint(f"{path / name}: {why}")

        try:
            manifest = json.loads((path / MANIFEST).read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise bad(MANIFEST, "missing (the save did not finish)") from None
        except (OSError, ValueError) as e:
            raise bad(MANIFEST, f"unreadable ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("manifest_sha256") != _manifest_checksum(manifest):
            raise bad(MANIFEST, "its checksum does not match its content")
        if manifest.get("step") != step:
            raise bad(MANIFEST, f"says step {manifest.get('step')}, the directory name says {step}")
        files = manifest.get("files", {})
        sharded = manifest.get("format") == FORMAT_SHARDED
        required = ((RNG, TRAINER_STATE, RANKS, f"{DCP_DIR}/.metadata") if sharded else
                    (MODEL, RNG, TRAINER_STATE) + ((OPTIMIZER,) if manifest.get("optimizer") else ()))
        for name in required:
            if name not in files:
                raise bad(name, "not listed in the manifest")

        def read(name: str) -> bytes:
            entry = files[name]
            try:
                data = (path / name).read_bytes()
            except OSError as e:
                raise bad(name, f"unreadable ({e})") from None
            if verify and len(data) != entry["size"]:
                raise bad(name, f"size {len(data)} != {entry['size']} in the manifest (truncated?)")
            if verify and hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise bad(name, "sha256 does not match the manifest (corrupted)")
            return data

        if sharded:     # DCP's files are hashed as streams (they can be large) and loaded later, into the model
            for name, entry in files.items():
                if name.startswith(f"{DCP_DIR}/") and verify:
                    try:
                        size, digest = (path / name).stat().st_size, sha256_file(path / name)
                    except OSError as e:
                        raise bad(name, f"unreadable ({e})") from None
                    if size != entry["size"]:
                        raise bad(name, f"size {size} != {entry['size']} in the manifest (truncated?)")
                    if digest != entry["sha256"]:
                        raise bad(name, "sha256 does not match the manifest (corrupted)")
            blobs = {name: read(name) for name in (RNG, TRAINER_STATE, RANKS)}
            parsed = {}
            for name, blob in blobs.items():
                try:
                    parsed[name] = json.loads(blob)
                except ValueError as e:
                    raise bad(name, f"not loadable ({e})") from None
            return Checkpoint(step=step, path=path, weights={}, optimizer=None, rng=parsed[RNG],
                              trainer_state=parsed[TRAINER_STATE], manifest=manifest, ranks=parsed[RANKS],
                              dcp=path / DCP_DIR)

        # Hash everything before parsing anything: a model-only fallback must verify as a whole.
        blobs = {name: read(name) for name in files}
        try:
            weights = safetensors.torch.load(blobs[MODEL])
        except Exception as e:
            raise bad(MODEL, f"not loadable ({e})") from None
        optimizer = None
        if OPTIMIZER in blobs:
            try:
                raw = zstandard.ZstdDecompressor().decompress(blobs[OPTIMIZER])
                optimizer = torch.load(io.BytesIO(raw), weights_only=True)
            except Exception as e:
                raise bad(OPTIMIZER, f"not loadable ({e})") from None
        try:
            rng = json.loads(blobs[RNG])
        except ValueError as e:
            raise bad(RNG, f"not loadable ({e})") from None
        try:
            trainer_state = json.loads(blobs[TRAINER_STATE])
        except ValueError as e:
            raise bad(TRAINER_STATE, f"not loadable ({e})") from None
        try:
            ranks = json.loads(blobs[RANKS]) if RANKS in blobs else None
        except ValueError as e:
            raise bad(RANKS, f"not loadable ({e})") from None
        return Checkpoint(step=step, path=path, weights=weights, optimizer=optimizer, rng=rng,
                          trainer_state=trainer_state, manifest=manifest, ranks=ranks)


# ---------------------------------------------------------------- the loop's state

@dataclass
class TrainState:
    """The training loop's state: what a checkpoint's trainer_state.json holds (beside the config,
    code version, max_steps and epoch the Checkpointer adds) and a resume starts from."""

    step: int = 0                       # optimizer steps done
    tokens: int = 0                     # real (non-padding) tokens trained on
    losses: list[float] = field(default_factory=list)       # the loss of every step
    skipped: int = 0                    # batches skipped for a non-finite loss (nonfinite: skip)
    data_state: dict | None = None      # sampler + packer position after the last batch trained on
    val_losses: list[list] = field(default_factory=list)    # [step, validation loss] per validation
    best_val_loss: float | None = None
    best_step: int | None = None
    bad_evals: int = 0                  # validations in a row without improvement
    stopped_early: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "TrainState":
        """From a trainer_state.json; the extra keys (config, epoch, ...) are the Checkpointer's."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def advance(self, loss: float, tokens: int, data_state: dict | None) -> int:
        """Count one optimizer step (its loss, tokens, the data position after it); the new step."""
        self.step += 1
        self.tokens += tokens
        self.losses.append(loss)
        self.data_state = data_state
        return self.step

    def validated(self, val_loss: float, min_delta: float, patience: int) -> bool:
        """Record a validation at this step; True if it is the new best (lower by more than min_delta).
        After `patience` validations in a row without one (0 = never), stopped_early is set."""
        self.val_losses.append([self.step, val_loss])
        if self.best_val_loss is None or val_loss < self.best_val_loss - min_delta:
            self.best_val_loss, self.best_step, self.bad_evals = val_loss, self.step, 0
            return True
        self.bad_evals += 1
        self.stopped_early = bool(patience) and self.bad_evals >= patience
        return False


# ---------------------------------------------------------------- the loop's checkpointer

def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def _copy_into(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in weights.items():
            params[n].copy_(t)


def _sharded_state(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> dict:
    """What DCP saves and loads: the trainable weights and (optionally) the optimizer state, keyed by
    parameter name — this rank's shards for a sharded model, whole tensors for a plain one."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    state = {"model": get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))}
    if opt is not None:
        state["optim"] = get_optimizer_state_dict(model, opt)
    return state


def _load_dcp(model: torch.nn.Module, opt: torch.optim.Optimizer | None, path: Path) -> None:
    """Load a sharded checkpoint into `model` (and `opt`) as they are now: DCP reshards to this world size;
    without a process group it reads as one process (the no-dist path)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    state = _sharded_state(model, opt)
    dcp.load(state, checkpoint_id=str(path), no_dist=not torch.distributed.is_initialized())
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))   # frozen: not saved
    if opt is not None:
        set_optimizer_state_dict(model, opt, state["optim"])


def _dcp_weight_names(path: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k.removeprefix("model.") for k in keys if k.startswith("model.")}


def _optimizer_by_name(model: torch.nn.Module, opt: torch.optim.Optimizer, saved: dict) -> dict:
    """A torch optimizer state_dict (parameters numbered in `opt`'s order: build_optimizer makes the same
    order on every run) keyed by parameter name instead, as torch.distributed.checkpoint.state_dict wants."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    return {"state": {order[int(i)]: v for i, v in saved["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]]}


class Checkpointer:
    """What the training loop asks of checkpoints: resume, scheduled saves, the best weights.

    Files go through a CheckpointManager under `root`; without a root nothing is written, restore
    finds nothing and the best weights are kept in memory only. `run_config` is saved in every
    checkpoint and must match, key by key, for a resume (else IncompatibleResumeError names the keys).
    `name` (the stage) names it in messages. Close it (or use `with`) to wait for the last write.

    Under torchrun (`dist`, engine/dist.py) every rank calls every method at the same step; rank 0
    decides and writes, `sharded` (FSDP2) models are saved through DCP by all ranks (module docstring).
    """

    log = logging.getLogger("glm_lora.engine")      # its messages are the stage's, beside the loop's

    def __init__(self, root: Path | None = None, cfg: CheckpointConfig | None = None, *,
                 run_config: dict | None = None, name: str = "train", dist=None, sharded: bool = False):
        self.cfg, self.run_config, self.name = cfg or CheckpointConfig(), run_config or {}, name
        self.dist, self.sharded = dist, sharded
        self.store = (CheckpointManager(root, keep_last=self.cfg.keep_last, async_save=self.cfg.async_save, dist=dist)
                      if root is not None else None)
        self.root = self.store.root if self.store else None
        self._best: dict[str, torch.Tensor] | None = None      # of TrainState.best_step, on CPU (rank 0's if sharded)

    @property
    def main(self) -> bool:
        return self.dist is None or self.dist.main

    @classmethod
    def for_stage(cls, cfg: Config, stage: str, tc: TrainConfig, inputs: list[Path],
                  model: torch.nn.Module, *, dist=None, sharded: bool = False) -> "Checkpointer":
        """The one place that says whose checkpoints these are.

        A resume must match `run_config` (refused naming the key): the model's shape (`model.config`)
        when the stage trains all of it, else the LoRA settings; the input artifacts, seq_len,
        batch_size and packing. The directory is named by a hash of everything that shapes the run: the
        stage's section except max_steps/log_every (a changed max_steps resumes), the model section,
        device, precision, kernels, attention and the inputs; any other change starts a fresh directory.
        The number of processes (`dist`) is not part of it: a checkpoint of N ranks resumes on M.
        """
        digests = [read_manifest(p)["digest"] for p in inputs]
        lora = getattr(tc, "lora", None)
        # lora.quantization came later: while "none" it stays out of both, so earlier checkpoints still resume.
        new_lora_keys = {"quantization"} if lora is not None and lora.quantization == "none" else set()
        run_config = {"model": model.config.to_dict() if lora is None else None,
                      "lora": lora.model_dump(mode="json", exclude=new_lora_keys) if lora is not None else None,
                      "inputs": digests, "seq_len": tc.seq_len, "batch_size": tc.batch_size, "packing": tc.packing}
        # global_batch_size came later: while unset it stays out of the hash, so earlier directories are found.
        # compile is a speed setting (same learning up to fp32 rounding): a run resumes across it.
        unhashed = dict.fromkeys({"max_steps", "log_every", "compile"} |
                                 ({"global_batch_size"} if tc.global_batch_size is None else set()), True)
        if new_lora_keys:
            unhashed["lora"] = new_lora_keys
        key = sha256_json({"stage": stage, "section": tc.model_dump(mode="json", exclude=unhashed),
                           "model": cfg.model.model_dump(mode="json"), "device": cfg.device,
                           "precision": cfg.precision, "kernels": cfg.kernels, "attention": cfg.attention,
                           "inputs": digests})
        return cls(cfg.run_dir / "checkpoints" / f"{stage}-{key[:12]}", cfg.checkpoint, run_config=run_config,
                   name=stage, dist=dist, sharded=sharded)

    # ---- resume

    def restore(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> TrainState | None:
        """Load the newest verified checkpoint into `model` (trainable weights) and `opt`, restore every
        RNG and the best weights so far; None if there is none or checkpoint.resume is never.
        Several ranks: rank 0 picks and verifies it, every rank loads it (and raises what rank 0 raised)."""
        if self.store is None or self.cfg.resume != "auto":
            return None
        d = self.dist
        if d is None:
            c = self._newest(model)
        else:
            picked = d.on_main(lambda: self._newest(model), share=lambda c: c and (c.step, str(c.path)))
            c = picked if d.main or picked is None else self.store.load(*picked)
        if c is None:
            return None
        self._load_weights(model, opt, c)
        saved_world, world = len(c.ranks) if c.ranks else 1, d.world_size if d else 1
        mine = c.ranks[d.rank] if d is not None and c.ranks and saved_world == world else None
        restore_rng(mine["rng"] if mine else c.rng)
        self.log.info("%s: resumed from step %d (%s)", self.name, c.step, c.path)
        state = TrainState.from_dict(c.trainer_state)
        if mine is not None:
            state.data_state = mine["data_state"]
        elif saved_world != world:
            self.log.warning("%s: checkpoint %s was made by %d processes, resuming on %d: the data position "
                             "continues approximately and every rank starts from rank 0's random generators",
                             self.name, c.path, saved_world, world)
        if state.best_step is not None:     # raises CheckpointUnusable if they fail verification
            if self.sharded:                # kept (and broadcast when needed) by rank 0 only
                self._best = d.on_main(lambda: self.store.load_best(state.best_step), share=lambda b: None)
            else:
                self._best = self.store.load_best(state.best_step)
        return state

    def _newest(self, model: torch.nn.Module) -> Checkpoint | None:
        """The newest verified checkpoint if a resume may use it (None if there is none)."""
        c = self.store.latest()
        if c is None:
            if self.store.best_step() is not None:
                self.log.warning("%s: discarding the best weights of step %s under %s: there is no checkpoint to "
                                 "resume from, so the stage starts over", self.name, self.store.best_step(), self.root)
            return None
        diff = config_diff(c.trainer_state.get("config", {}), self.run_config, list(self.run_config))
        if diff:
            raise IncompatibleResumeError(
                f"{self.name}: the checkpoint in {c.path} was made with a different {', '.join(diff)}; "
                f"refusing to resume. Delete {c.path.parent} (or use checkpoint.resume: never) to start over.")
        saved = set(c.weights) if c.dcp is None else _dcp_weight_names(c.dcp)
        missing = sorted(saved ^ set(_trainable(model)))
        if missing:
            raise IncompatibleResumeError(
                f"{self.name}: checkpoint {c.path} weights differ from the model's: {missing[:5]}")
        return c

    def _load_weights(self, model: torch.nn.Module, opt: torch.optim.Optimizer, c: Checkpoint) -> None:
        if c.dcp is not None:                # sharded files: into a sharded, replicated or plain model alike
            _load_dcp(model, opt if c.has_optimizer else None, c.dcp)
        elif self.sharded:                   # whole tensors (DDP / one process) into a sharded model
            from engine.dist import load_full_state
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            load_full_state(model, c.weights, from_rank0=False)
            if c.optimizer is not None:
                set_optimizer_state_dict(model, opt, _optimizer_by_name(model, opt, c.optimizer),
                                         options=StateDictOptions(full_state_dict=True))
        else:
            _copy_into(model, c.weights)
            if c.optimizer is not None:
                opt.load_state_dict(c.optimizer)
        if not c.has_optimizer:
            self.log.warning("%s: checkpoint %s has no optimizer state; the optimizer restarts (resume is not exact)",
                             self.name, c.path)

    # ---- saving

    def maybe_save(self, state: TrainState, model: torch.nn.Module, opt: torch.optim.Optimizer, *,
                   stop: bool, max_steps: int) -> None:
        """At a step boundary: save every checkpoint.save_every steps, on a stop signal and when stopping
        early; with the optimizer state every checkpoint.save_optimizer_every steps and on a stop signal."""
        cfg = self.cfg
        if stop or state.stopped_early or (cfg.save_every and state.step % cfg.save_every == 0):
            self.save(state, model, opt, with_optimizer=stop or state.step % cfg.save_optimizer_every == 0,
                      max_steps=max_steps)

    def save(self, state: TrainState, model: torch.nn.Module, opt: torch.optim.Optimizer, *,
             with_optimizer: bool, max_steps: int) -> float:
        """Checkpoint `state.step` now (written in the background); the seconds the loop stalled."""
        if self.store is None:
            return 0.0
        trainer_state = {**vars(state), "config": self.run_config, "config_hash": sha256_json(self.run_config),
                         "code_version": CODE_VERSION, "max_steps": max_steps,
                         "epoch": ((state.data_state or {}).get("order") or {}).get("epoch")}
        d = self.dist
        if d is None:
            stall = self.store.save(state.step, weights=_trainable(model),
                                    optimizer=opt.state_dict() if with_optimizer else None, rng=capture_rng(),
                                    trainer_state=trainer_state)
        else:           # each rank's generators and data position, for an exact resume on as many ranks
            ranks = d.all_gather({"rng": capture_rng(), "data_state": state.data_state})
            if self.sharded:
                stall = self.store.save_sharded(state.step, _sharded_state(model, opt if with_optimizer else None),
                                                trainer_state=trainer_state, rng=ranks[0]["rng"], ranks=ranks,
                                                with_optimizer=with_optimizer)
            elif d.main:    # DDP: the weights and optimizer state are the same on every rank
                stall = self.store.save(state.step, weights=_trainable(model),
                                        optimizer=opt.state_dict() if with_optimizer else None, rng=ranks[0]["rng"],
                                        trainer_state=trainer_state, ranks=ranks)
            else:
                stall = 0.0
        self.log.info("%s: checkpoint at step %d (stall %.3f s%s)", self.name, state.step, stall,
                      ", with optimizer" if with_optimizer else "")
        return stall

    # ---- the best weights by validation loss

    def save_best(self, state: TrainState, model: torch.nn.Module) -> None:
        """Keep the model's trainable weights as those of state.best_step (in memory, and in root/best/).
        Sharded: gathered whole into rank 0's memory (collective); the others keep none."""
        if self.sharded:
            from engine.dist import full_state
            weights = full_state(model, trainable_only=True)
            self._best = weights if self.main else None
        else:
            self._best = {n: t.to("cpu", copy=True) for n, t in _trainable(model).items()}
        if self.store is not None and self.main:
            self.store.save_best(self._best, step=state.best_step, val_loss=state.best_val_loss)

    def restore_best(self, model: torch.nn.Module, state: TrainState) -> None:
        """Leave the best weights in the model, not the last step's (when those differ)."""
        if state.best_step is None or state.best_step == state.step:
            return
        have = self._best is not None if not self.sharded else self.dist.broadcast(self._best is not None)
        if not have:
            self.log.warning("%s: best weights of step %s are not available; keeping the last step's", self.name,
                             state.best_step)
            return
        if self.sharded:
            from engine.dist import load_full_state
            load_full_state(model, self._best if self.main else {}, from_rank0=True)
        else:
            _copy_into(model, self._best)
        self.log.info("%s: carrying forward the weights of step %d (validation loss %.4f), not step %d's", self.name,
                      state.best_step, state.best_val_loss, state.step)

    # ---- lifetime

    def metrics(self) -> dict:
        """Save count and worst stall, for the stage's metrics (empty if nothing was saved)."""
        saves = self.store.stats if self.store else []
        if not saves:
            return {}
        return {"checkpoint_saves": len(saves), "checkpoint_max_stall_s": max(x["stall_s"] for x in saves)}

    def wait(self) -> None:
        if self.store is not None:
            self.store.wait()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
