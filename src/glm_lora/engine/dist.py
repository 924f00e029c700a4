"""More than one process per training stage: torchrun starts them, this module joins them up.

    torchrun --nproc_per_node N [--nnodes M --node_rank R --rdzv-endpoint HOST:PORT] -m glm_lora.engine STAGE ...

Under torchrun (WORLD_SIZE in the environment) `python -m glm_lora.engine` calls `init()` — one process group
(NCCL on CUDA with each rank on cuda:LOCAL_RANK and gloo beside it for CPU collectives; gloo on CPU) —
runs the stage with `Runtime.dist` set, and ends each rank with `end_rank()`. Without WORLD_SIZE nothing here runs and
the stage is the plain one-process path. Only rank 0 logs, writes the stage's files and its metrics.

Strategies (`dist.strategy`; `strategy_for`):
- ddp (the LoRA stages' default): every rank holds the whole model; DistributedDataParallel all-reduces
  the gradients of the trainable parameters only (the frozen base is replicated and never reduced),
  skipped (`no_sync`) on all but the last micro-batch of a step. The loss runs inside DDP's forward
  (`_LossModule`), which is what arms DDP's gradient hooks.
- fsdp2 (pretraining's default): `fully_shard` per decoder block, then the root (embeddings, final
  norm, lm_head); parameters, gradients and optimizer state live 1/N on each rank, a block's weights
  are all-gathered for its forward and backward and freed after. `Decoder.hidden_states` is registered
  as a forward method, so the losses (which call it, then use lm_head.weight themselves) all-gather the
  root; FSDP keeps the root unsharded from forward to backward, so lm_head.weight is a plain tensor
  there. Inside every module's forward the parameters are plain unsharded tensors too: the fused
  Triton ops and FlexAttention never see a DTensor. On CUDA with precision bf16 the parameters are
  gathered in bf16 and gradients reduced in fp32 (MixedPrecisionPolicy); otherwise fp32. A LoRA stage's
  frozen base is cast to bf16 before sharding there (engine/adapter_stage.py): its shards are bf16, the
  adapter's fp32.

Batch math: one optimizer step takes batch_size × grad_accum × world_size rows (× seq_len token
slots); `<stage>.global_batch_size` fixes the rows and derives grad_accum (`grad_accum`, `check`).

Assumed: every rank sees the same paths — the input artifacts, and runs_dir (token cache, checkpoints:
rank 0 writes them, FSDP2's shards are written by every rank, all ranks read them on resume). On one
machine that is given; over several nodes runs_dir must be on a shared filesystem.

Test hook: GLM_LORA_TEST_FAIL="RANK:STEP" makes rank RANK raise a RuntimeError before training step
STEP + 1 ("RANK:STEP:user": a UserError), so tests can see one rank fail (tests/engine/test_dist.py).
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as tdist
import torch.nn as nn

from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import LORA_STAGES, Config, derived_grad_accum

log = logging.getLogger("glm_lora.dist")

STRATEGIES = ("ddp", "fsdp2")
# Long enough for rank 0's held-out evaluation while the others wait at the final barrier.
TIMEOUT = timedelta(minutes=30)
TEST_FAIL_ENV = "GLM_LORA_TEST_FAIL"


# ---------------------------------------------------------------- what the launcher asks

def nproc_per_node(cfg: Config) -> int:
    """Processes torchrun starts on this machine: dist.nproc_per_node, "auto" = the visible CUDA GPUs
    (1 without CUDA, or with device: cpu)."""
    n = cfg.dist.nproc_per_node
    if n != "auto":
        return n
    return torch.cuda.device_count() if cfg.device != "cpu" and torch.cuda.is_available() else 1


def world_size(cfg: Config) -> int:
    """Processes over all machines: nproc_per_node × nnodes."""
    return nproc_per_node(cfg) * cfg.dist.nnodes


def strategy_for(cfg: Config, stage: str) -> str:
    """"ddp" or "fsdp2" for a training stage: dist.strategy, where "auto" means fsdp2 for pretraining
    (the whole model trains: shard it) and ddp for the LoRA stages (small gradients: replicate)."""
    if cfg.dist.strategy != "auto":
        return cfg.dist.strategy
    return "ddp" if stage in LORA_STAGES else "fsdp2"


def grad_accum(cfg: Config, stage: str, world: int) -> int:
    """Micro-batches per optimizer step of `stage` on `world` processes (UserError naming the keys if
    `<stage>.global_batch_size` does not divide)."""
    try:
        return derived_grad_accum(getattr(cfg, stage), stage, world)
    except ValueError as e:
        raise UserError(str(e)) from None


def check(cfg: Config, world: int | None = None) -> dict[str, dict]:
    """Before any stage runs (engine/preflight.py) and in every process: the batch math of each training
    stage this config runs on `world` processes (default: world_size(cfg)), and strategy × precision.
    Returns per stage: strategy, grad_accum, rows and token slots per optimizer step over all ranks."""
    world = world_size(cfg) if world is None else world
    plan = {}
    lora = tuple(s for s in LORA_STAGES if s != "rl" or cfg.rl.enabled)
    for stage in lora if cfg.base_model else ("pretrain", *lora):
        tc, strategy = getattr(cfg, stage), strategy_for(cfg, stage)
        if world > 1 and strategy == "fsdp2" and cfg.precision == "fp16":
            raise UserError(f"precision fp16 is not supported with dist.strategy fsdp2 ({stage} on {world} "
                            "processes); use precision bf16, or dist.strategy ddp")
        accum = grad_accum(cfg, stage, world)
        rows = tc.batch_size * accum * world
        plan[stage] = {"strategy": strategy, "world_size": world, "grad_accum": accum, "global_batch_size": rows,
                       "tokens_per_step": rows * tc.seq_len}
    return plan


# ---------------------------------------------------------------- the process group

def launched() -> bool:
    """Started by torchrun (or anything that sets the env:// variables)."""
    return "WORLD_SIZE" in os.environ


@dataclass(frozen=True)
class Dist:
    """This process's place in the group, and the few collectives the engine uses (all blocking, every rank
    must call them in the same order)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device        # where this rank computes, and where NCCL's tensors must be

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        tdist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Elementwise sums over ranks (float64: token counts stay exact)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        tdist.all_reduce(t)
        return t.tolist()

    def max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return int(t.item())

    def any(self, flag: bool) -> bool:
        return self.max(int(flag)) > 0

    def all_gather(self, obj: Any) -> list:
        out: list = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank."""
        box = [obj]
        tdist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def on_main(self, fn: Callable[[], Any], share: Callable[[Any], Any] = lambda r: r) -> Any:
        """Run `fn` on rank 0 only. Rank 0 gets its result; the others get `share(result)`. If it raises, every
        rank raises it (rank 0 its own, the others a copy): no rank is left waiting in a collective."""
        result, outcome = None, None
        if self.main:
            try:
                result = fn()
                outcome = ("ok", share(result))
            except BaseException as e:
                outcome = ("error", _picklable(e))
                self.broadcast(outcome)
                raise
        outcome = self.broadcast(outcome)
        if outcome[0] == "error":
            raise outcome[1]
        return result if self.main else outcome[1]

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (e.g. builds a cache), the others after it (and find it built)."""
        if not self.main:
            self.barrier()
        yield
        if self.main:
            self.barrier()


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        cls = UserError if isinstance(e, UserError) else RuntimeError
        return cls(f"{type(e).__name__} on rank 0: {e}")


_CURRENT: Dist | None = None


def init(device: str) -> Dist:
    """Join the process group torchrun set up (env://). `device` is the stage's resolved device type."""
    global _CURRENT
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        if local >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA devices are visible; "
                            "lower dist.nproc_per_node (or use auto)")
        where = torch.device("cuda", local)
        torch.cuda.set_device(where)
        # NCCL for tensors on the GPU; gloo beside it for CPU tensors (sharded async checkpoint writes).
        tdist.init_process_group("cpu:gloo,cuda:nccl", timeout=TIMEOUT, device_id=where)
    else:
        where = torch.device("cpu")
        tdist.init_process_group("gloo", timeout=TIMEOUT)
    _CURRENT = Dist(rank, world, local, where)
    log.info("rank %d of %d (local %d) on %s", rank, world, local, where)
    return _CURRENT


def check_same_config(cfg: Config, d: Dist) -> None:
    """Every rank runs rank 0's config, dist.node_rank aside: a node started with another one would train something
    else or stop in a collective the others never reach. Collective; every rank raises the same UserError, naming
    the keys that differ."""
    mine = _leaves(cfg.model_dump(mode="json"))
    mine.pop("dist.node_rank")
    configs = d.all_gather(mine)
    for rank, other in enumerate(configs):
        keys = sorted(k for k in other.keys() | configs[0].keys() if other.get(k) != configs[0].get(k))
        if keys:
            diff = "; ".join(f"{k}: {other.get(k)!r} there, {configs[0].get(k)!r} on rank 0" for k in keys[:5])
            raise UserError(f"rank {rank} runs another config than rank 0 ({diff}); start every node with the same "
                            "config (only dist.node_rank differs)")


def _leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def current() -> Dist | None:
    """The process group this process joined with init(), or None (one process)."""
    return _CURRENT


def end_rank(status: int) -> NoReturn:
    """How a torchrun rank ends, after its last collective: streams flushed, then out without the interpreter's
    teardown. Destroying the process group and finalising the interpreter while gloo's C++ threads hold work can
    abort the process (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#179291 describes
    the race) — CI saw it once after a user error and once after a two-rank FSDP2 RL stage had finished and passed
    the final barrier — and torchrun then reports the abort instead of this rank's status. The caller has nothing
    left to tear down: every rank is past its last collective and its files are written and closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


def injected_failure(rank: int, step: int) -> None:
    """The GLM_LORA_TEST_FAIL hook (see the module docstring); called by the loop before each step."""
    spec = os.environ.get(TEST_FAIL_ENV)
    if not spec:
        return
    want_rank, want_step, *kind = spec.split(":")
    if int(want_rank) == rank and int(want_step) == step:
        msg = f"injected failure on rank {rank} at step {step} ({TEST_FAIL_ENV}={spec})"
        raise UserError(msg) if kind == ["user"] else RuntimeError(msg)


# ---------------------------------------------------------------- strategies

class _LossModule(nn.Module):
    """model + loss as one module, so that DDP's forward (which arms its gradient hooks) runs the loss."""

    def __init__(self, model: nn.Module, loss_fn: Callable):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, batch: dict):
        return self.loss_fn(self.model, batch)


class DDPLoss:
    """The training loss through a DDP module; `no_sync()` skips the all-reduce (gradient accumulation)."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel):
        self.ddp = ddp

    def __call__(self, model: nn.Module, batch: dict):
        return self.ddp(batch)

    def no_sync(self):
        return self.ddp.no_sync()


def parallelize(model: nn.Module, loss_fn: Callable, strategy: str, rt) -> Callable:
    """Wrap `model` for `strategy` on rt.dist's ranks; return the loss function the loop must call.

    ddp: `model` stays a plain module (on rt.device) inside a DDP wrapper the returned loss goes through.
    fsdp2: `model` itself becomes sharded (its parameters DTensors); the loss is unchanged.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "ddp":
        model.to(rt.device)
        ids = [rt.device.index] if rt.device.type == "cuda" else None
        return DDPLoss(nn.parallel.DistributedDataParallel(_LossModule(model, loss_fn), device_ids=ids))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(rt.device.type, (rt.dist.world_size,))
    # Gathered in the dtype the matmuls read (frozen weights already in it as they are), gradients reduced in fp32.
    mp = (MixedPrecisionPolicy(param_dtype=rt.dtype, reduce_dtype=torch.float32) if rt.weights_in_compute_dtype
          else MixedPrecisionPolicy())
    for block in model.model.layers:            # one all-gather per block: only one block is whole at a time
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)   # the rest: embeddings, final norm, lm_head
    register_fsdp_forward_method(model, "hidden_states")   # what the losses call instead of forward()
    return loss_fn


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def full_state(model: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """The whole (unsharded) weights of a sharded model on rank 0's CPU ({} on the other ranks); collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=trainable_only))


def load_full_state(model: nn.Module, weights: dict[str, torch.Tensor], *, from_rank0: bool) -> None:
    """Put whole weights (some or all of the model's) into a sharded model; with `from_rank0` only rank 0
    passes them and the others receive them by broadcast. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    # One collective per tensor, in dict order: the same order on every rank (safetensors' is not).
    ordered = {n: weights[n] for n, _ in model.named_parameters() if n in weights}
    set_model_state_dict(model, ordered, options=StateDictOptions(full_state_dict=True, strict=False,
                                                                  broadcast_from_rank0=from_rank0))


def consolidated(model: nn.Module, rt, build: Callable[[], nn.Module]) -> nn.Module | None:
    """The trained model as one plain module, for held-out evaluation and saving: `model` itself with one
    process; with several, on rank 0 only (None on the others). A DDP-trained model is whole on every rank
    already; a sharded one is gathered (collective) into `build()` — the same architecture, built on the
    meta device so no second initialisation runs — and moved to rt.device."""
    d = rt.dist
    if d is None:
        return model
    if not is_sharded(model):
        return model if d.main else None
    weights = full_state(model, trainable_only=False)
    if not d.main:
        return None
    with torch.device("meta"):
        plain = build()
    plain.load_state_dict(weights, assign=True)
    if getattr(plain.config, "tie_embeddings", False):
        plain.lm_head.weight = plain.model.embed_tokens.weight
    return plain.to(rt.device)
