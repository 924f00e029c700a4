"""Checkpoints as the training loop sees them: the `Checkpointer` (resume, scheduled saves, best weights)
over the files of a `CheckpointManager` (engine/checkpoint_store.py: the on-disk format, atomic
publishing, verification, background writes).

The loop sees three calls: `restore(model, opt, max_steps) -> TrainState | None` on start, `maybe_save(...)` at
each step boundary, `save_best(...)` / `restore_best(...)` around validation. Everything a resume
needs is behind them: the config compatibility check, weight matching, optimizer and RNG restore,
file verification. `Checkpointer.for_stage` is the one place that decides which directory a
stage's checkpoints live in and which settings a resume must match.

Several processes (torchrun, engine/dist.py): rank 0 decides, verifies and publishes; every rank
contributes its own RNG states and data position (ranks.json). DDP (replicated weights) checkpoints
are rank 0's plain files; FSDP2 (sharded weights) ones are written by every rank through
`torch.distributed.checkpoint` (DCP). Resume on another number of ranks M (1 included, without a
process group): DCP reshards on load into whatever the model is now (sharded, replicated or plain); a
DDP / one-process checkpoint loads into a sharded model as whole tensors. The RNG states and data
position of the same rank come back when M equals the saved world size (an exact resume); otherwise
rank 0's RNG states and the data position continue approximately (data/pipeline.py,
`_continue_elsewhere`).
"""
from __future__ import annotations

import base64
import json
import logging
import random
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glm_lora.artifacts.manifest import code_version, read_manifest, sha256_json
from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import CheckpointConfig, Config, TrainConfig
from glm_lora.engine.checkpoint_store import (BEST, DCP_DIR, FORMAT, FORMAT_SHARDED, MANIFEST, MODEL, OPTIMIZER, RANKS,
                                     RNG, TRAINER_STATE, ZSTD_LEVEL, Checkpoint, CheckpointError, CheckpointManager,
                                     CheckpointUnusable, CorruptCheckpoint)

# The store's names stay importable from here (engine.checkpoint is where callers have always found them).
__all__ = ["BEST", "CODE_VERSION", "DCP_DIR", "FORMAT", "FORMAT_SHARDED", "MANIFEST", "MODEL", "OPTIMIZER", "RANKS",
           "RNG", "TRAINER_STATE", "ZSTD_LEVEL", "Checkpoint", "CheckpointError", "CheckpointManager",
           "CheckpointUnusable", "Checkpointer", "CorruptCheckpoint", "IncompatibleResumeError", "TrainState",
           "capture_rng", "config_diff", "restore_rng"]

CODE_VERSION = code_version(("data", "engine", "kernels", "model"))


class IncompatibleResumeError(UserError, RuntimeError):
    """The newest checkpoint was made with settings a resume must match (see Checkpointer.for_stage)."""


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
    weights = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    # buffers too otherwise (a MoE router's e_score_correction_bias), which no stage trains and _trainable leaves out
    state = {"model": {n: t for n, t in weights.items() if n in _trainable(model)}}
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


def _new_lora_keys(tc: TrainConfig) -> set[str]:
    # lora.quantization came later: while "none" it stays out of both, so earlier checkpoints still resume.
    lora = getattr(tc, "lora", None)
    return {"quantization"} if lora is not None and lora.quantization == "none" else set()


def _run_config(tc: TrainConfig, model: torch.nn.Module, digests: list[str]) -> dict:
    """What a resume must match, key by key (Checkpointer.for_stage)."""
    lora = getattr(tc, "lora", None)
    return {"model": model.config.to_dict() if lora is None else None,
            "lora": lora.model_dump(mode="json", exclude=_new_lora_keys(tc)) if lora is not None else None,
            "inputs": digests, "seq_len": tc.seq_len, "batch_size": tc.batch_size, "packing": tc.packing}


def _dir_key(cfg: Config, stage: str, tc: TrainConfig, digests: list[str]) -> str:
    """The hash that names a stage's checkpoint directory (Checkpointer.for_stage)."""
    new_lora_keys = _new_lora_keys(tc)
    # global_batch_size came later: while unset it stays out of the hash, so earlier directories are found.
    # compile is a speed setting (same learning up to fp32 rounding): a run resumes across it.
    unhashed = dict.fromkeys({"max_steps", "log_every", "compile"} |
                             ({"global_batch_size"} if tc.global_batch_size is None else set()), True)
    if new_lora_keys:
        unhashed["lora"] = new_lora_keys
    # The MTP keys came later: where they change nothing (mtp carry, no model.mtp_layers) they stay out as well.
    if getattr(tc, "mtp", "carry") == "carry" and (hasattr(tc, "mtp") or not cfg.model.mtp_layers):
        unhashed |= dict.fromkeys({"mtp", "mtp_weight"} & set(type(tc).model_fields), True)
    model = cfg.model.model_dump(mode="json", exclude={"mtp_layers"} if not cfg.model.mtp_layers else None)
    return sha256_json({"stage": stage, "section": tc.model_dump(mode="json", exclude=unhashed),
                        "model": model, "device": cfg.device,
                        "precision": cfg.precision, "kernels": cfg.kernels, "attention": cfg.attention,
                        "inputs": digests})


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
        stage's section except max_steps/log_every (a raised max_steps resumes; one lowered below the newest
        checkpoint is refused by `restore`), the model section, device, precision, kernels, attention and the
        inputs; any other change starts a fresh directory.
        The number of processes (`dist`) is not part of it: a checkpoint of N ranks resumes on M.
        """
        digests = [read_manifest(p)["digest"] for p in inputs]
        return cls(cfg.run_dir / "checkpoints" / f"{stage}-{_dir_key(cfg, stage, tc, digests)[:12]}", cfg.checkpoint,
                   run_config=_run_config(tc, model, digests), name=stage, dist=dist, sharded=sharded)

    # ---- resume

    def restore(self, model: torch.nn.Module, opt: torch.optim.Optimizer,
                max_steps: int | None = None) -> TrainState | None:
        """Load the newest verified checkpoint into `model` (trainable weights) and `opt`, restore every
        RNG and the best weights so far; None if there is none or checkpoint.resume is never.
        A checkpoint past `max_steps` (a longer run's, since max_steps is not part of the directory) is refused:
        resuming it would end at once and hand the longer run's weights on as this run's.
        Several ranks: rank 0 picks and verifies it, every rank loads it (and raises what rank 0 raised)."""
        if self.store is None or self.cfg.resume != "auto":
            return None
        c = self._pick(model, max_steps)
        if c is None:
            return None
        self._load_weights(model, opt, c)
        mine, saved_world, world = self._own_states(c)
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
            self._load_best(state.best_step)
        return state

    def _pick(self, model: torch.nn.Module, max_steps: int | None) -> Checkpoint | None:
        """The checkpoint to resume from, on every rank: rank 0 picks and verifies it, the others read it."""
        d = self.dist
        if d is None:
            return self._newest(model, max_steps)
        picked = d.on_main(lambda: self._newest(model, max_steps), share=lambda c: c and (c.step, str(c.path)))
        return picked if d.main or picked is None else self.store.load(*picked)

    def _own_states(self, c: Checkpoint) -> tuple[dict | None, int, int]:
        """This rank's own {rng, data_state} in `c` (None unless it was saved by as many ranks as run now),
        the saved world size and the current one."""
        d = self.dist
        saved_world, world = len(c.ranks) if c.ranks else 1, d.world_size if d else 1
        mine = c.ranks[d.rank] if d is not None and c.ranks and saved_world == world else None
        return mine, saved_world, world

    def _load_best(self, step: int) -> None:
        if self.sharded:                # kept (and broadcast when needed) by rank 0 only
            self._best = self.dist.on_main(lambda: self.store.load_best(step), share=lambda b: None)
        else:
            self._best = self.store.load_best(step)

    def _newest(self, model: torch.nn.Module, max_steps: int | None) -> Checkpoint | None:
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
        if max_steps is not None and c.step > max_steps:
            made_by = c.trainer_state.get("max_steps")
            raise IncompatibleResumeError(
                f"{self.name}: the checkpoint in {c.path} is at step {c.step}, past max_steps {max_steps}"
                f"{f' (a {made_by}-step run made it)' if made_by else ''}; a shorter run can't continue from it. "
                f"Delete {c.path.parent} to train {max_steps} steps from the start, or set max_steps to {c.step} "
                "or more to keep that run's weights.")
        return c

    def _load_weights(self, model: torch.nn.Module, opt: torch.optim.Optimizer, c: Checkpoint) -> None:
        if c.dcp is not None:                # sharded files: into a sharded, replicated or plain model alike
            _load_dcp(model, opt if c.has_optimizer else None, c.dcp)
        elif self.sharded:                   # whole tensors (DDP / one process) into a sharded model
            from glm_lora.engine.dist import load_full_state
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
        stall = self._write(state, model, opt, trainer_state, with_optimizer)
        self.log.info("%s: checkpoint at step %d (stall %.3f s%s)", self.name, state.step, stall,
                      ", with optimizer" if with_optimizer else "")
        return stall

    def _write(self, state: TrainState, model: torch.nn.Module, opt: torch.optim.Optimizer, trainer_state: dict,
               with_optimizer: bool) -> float:
        """Hand the checkpoint to the store; the seconds this rank stalled."""
        d = self.dist
        opt = opt if with_optimizer else None
        if d is None:
            return self._save_whole(state.step, model, opt, trainer_state, capture_rng())
        # each rank's generators and data position, for an exact resume on as many ranks
        ranks = d.all_gather({"rng": capture_rng(), "data_state": state.data_state})
        if self.sharded:
            return self.store.save_sharded(state.step, _sharded_state(model, opt), trainer_state=trainer_state,
                                           rng=ranks[0]["rng"], ranks=ranks, with_optimizer=with_optimizer)
        if d.main:      # DDP: the weights and optimizer state are the same on every rank
            return self._save_whole(state.step, model, opt, trainer_state, ranks[0]["rng"], ranks)
        return 0.0

    def _save_whole(self, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer | None, trainer_state: dict,
                    rng: dict, ranks: list | None = None) -> float:
        """Whole weights and optimizer state (`opt` None: a model-only save), written by this process."""
        return self.store.save(step, weights=_trainable(model), optimizer=opt.state_dict() if opt is not None else None,
                               rng=rng, trainer_state=trainer_state, ranks=ranks)

    # ---- the best weights by validation loss

    def save_best(self, state: TrainState, model: torch.nn.Module) -> None:
        """Keep the model's trainable weights as those of state.best_step (in memory, and in root/best/).
        Sharded: gathered whole into rank 0's memory (collective); the others keep none."""
        if self.sharded:
            from glm_lora.engine.dist import full_state
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
            from glm_lora.engine.dist import load_full_state
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
