"""The RL stage's answers sampled by a vLLM server (`rl.sampler: vllm`), the policy's weights synced into it after
every update without a restart: TRL's vLLM "server mode", for a LoRA policy. `rl_stage` is the stage table's rl:
engine/rl.py with this sampler plugged in (it writes exports and runs a server, so it sits above engine/).

vLLM lives in its own virtualenv (serve/vllm_server.py), so it runs beside the trainer as a server, started when the
stage starts on the stage's frozen base (pretrain + SFT + DPO merged, written once as a Hugging Face directory).
Before each rollout the trainer writes the current adapter in PEFT's format (the export's own writer) and loads it
in place under one name (`POST /v1/load_lora_adapter`, `load_inplace`); the rollout is one `/v1/completions` call
on the prompts' token ids, `n` = rl.group_size, seeded by the prompt cursor, the answers' token ids returned. The
trainer then scores those answers with its own weights (the ratio, the KL term), as with our own sampler.

The server and its files live only as long as the stage: `close()` stops it and removes them; a watchdog process
(serve/vllm_server.py `watch`) stops it if the trainer dies without closing (kill -9).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from safetensors.torch import save_file

from glm_lora.artifacts.lock import pid_alive
from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import Config
from glm_lora.data.tokenizer import end_of_turn_ids, load_tokenizer
from glm_lora.engine import dist, rl
from glm_lora.export.hf_peft import DTYPES, write_hf_model, write_peft_adapter   # the export's writers: what vLLM serves later
from glm_lora.model.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from glm_lora.model.lora import lora_state_dict
from glm_lora.serve import vllm_server as vs

log = logging.getLogger("glm_lora.rl")

POLICY = "policy"          # the name the trained adapter is served under
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))
WORK_PREFIX = ".rl-vllm-"  # runs/<run>/.rl-vllm-*/: the server's base, adapters and log while the stage runs


class VLLMSampler:
    def __init__(self, cfg: Config, policy, tokenizer_dir: Path, *, port: int | None = None):
        """Write the policy's weights (no adapter yet) as the server's base and start the server; returns at once,
        the first `sync` waits for it to be healthy (loading overlaps the stage's own set-up)."""
        tc = cfg.rl
        if tc.lora.quantization != "none":
            raise UserError("rl.sampler vllm samples from the full-precision base; with rl.lora.quantization "
                            f"{tc.lora.quantization} that is not the model being trained: use rl.sampler ours")
        self.device = vs.vllm_device()
        if policy.config.n_routed_experts and self.device == "cpu":
            raise UserError("rl.sampler vllm: vLLM's CPU build serves no LoRA on a mixture-of-experts base; use "
                            "rl.sampler ours (or vLLM's CUDA build)")
        self.lora, self.version = tc.lora, 0
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        remove_stale(cfg.run_dir)
        self.work = Path(tempfile.mkdtemp(prefix=WORK_PREFIX, dir=cfg.run_dir))
        self._record({})
        self.base, self.server, self.watchdog = self.work / "base", None, None
        try:
            tok = load_tokenizer(tokenizer_dir)
            self.stop = end_of_turn_ids(tok)
            write_hf_model(policy, tok, Path(tokenizer_dir), self.base, DTYPES[cfg.serve.dtype])
            settings = dict(dtype=cfg.serve.dtype, max_model_len=policy.config.max_seq_len,
                            runtime_lora_rank=vs.lora_rank_for(tc.lora.r), max_num_seqs=tc.batch_size * tc.group_size)
            if self.device == "cpu":
                settings["kv_cache_bytes"] = cfg.serve.kv_cache_bytes
            else:
                settings["gpu_memory_utilization"] = tc.vllm_gpu_memory_utilization
            self.server = vs.start_server(self.base, port=port or vs.free_port(), served_model_name="base",
                                          log_path=self.work / "vllm.log", device=self.device, **settings)
            self.watchdog = vs.watch(self.server.pid)
            self._record({"pid": self.server.pid, "port": self.server.port})
        except BaseException:
            self.close()
            raise
        self._healthy = False
        log.info("rl: vLLM server (pid %d, port %d) starting on %s", self.server.pid, self.server.port, self.base)

    # -------------------------------------------------------------------------------------------------------
    def sync(self, model) -> None:
        """Load the model's current adapter into the server in place of the last one (no restart)."""
        if not self._healthy:
            waited = vs.wait_healthy(self.server, timeout_s=600)
            self._healthy = True
            log.info("rl: vLLM server healthy after %.1f s", waited)
        self.version += 1
        ours, peft = self.work / f"ours-{self.version}", self.work / f"{POLICY}-{self.version}"
        ours.mkdir()
        save_file({k: v.detach().cpu().contiguous() for k, v in lora_state_dict(model).items()}, ours / ADAPTER_WEIGHTS)
        (ours / ADAPTER_CONFIG).write_text(json.dumps(self.lora.model_dump()))
        split = write_peft_adapter(ours, peft, base_model_path=str(self.base), vllm_split_gate_up=True)
        served = peft.with_name(peft.name + "-vllm") if split else peft
        self._post("/v1/load_lora_adapter", {"lora_name": POLICY, "lora_path": str(served),
                                             "load_inplace": self.version > 1}, expect_json=False)
        for old in self.work.glob("*-*"):       # the previous version's files: vLLM has read its adapter by now
            if old.is_dir() and not old.name.endswith(f"-{self.version}") and not old.name.endswith(
                    f"-{self.version}-vllm"):
                shutil.rmtree(old, ignore_errors=True)

    def sample(self, prompts: list[list[int]], *, n: int, max_new_tokens: int, temperature: float,
               seed: int) -> list[list[int]]:
        """n answers to each prompt (token ids, a stop token kept at the end as our sampler keeps it), prompt-major:
        answers[i * n + j] is prompt i's j-th. temperature 0 = greedy."""
        body = {"model": POLICY, "prompt": prompts, "n": n, "max_tokens": max_new_tokens, "temperature": temperature,
                "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "seed": seed,
                "stop_token_ids": self.stop, "ignore_eos": False, "skip_special_tokens": False,
                "include_stop_str_in_output": True, "return_token_ids": True}
        out = self._post("/v1/completions", body)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * n:
            raise RuntimeError(f"vLLM returned {len(choices)} answers for {len(prompts)} prompts × {n}")
        return [list(c["token_ids"])[:max_new_tokens] for c in choices]

    def close(self) -> None:
        """Stop the server and remove its files (also after a failed start)."""
        try:
            if self.server is not None:
                vs.stop_server(self.server.pid)
        finally:
            if self.watchdog is not None:
                vs.release(self.watchdog)
            shutil.rmtree(self.work, ignore_errors=True)

    def _record(self, server: dict) -> None:
        (self.work / "server.json").write_text(json.dumps({"owner": os.getpid(), **server}))

    # -------------------------------------------------------------------------------------------------------
    def _post(self, route: str, body: dict, expect_json: bool = True):
        request = urllib.request.Request(self.server.base_url + route, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        t = time.monotonic()
        try:
            with _LOCAL.open(request, timeout=600) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"vLLM {route} answered {e.code}: {e.read().decode(errors='replace')[:2000]}") from e
        except OSError as e:
            raise RuntimeError(f"vLLM {route} failed ({e}); last log lines:\n{vs.log_tail(self.server.log_path)}") from e
        log.debug("rl: vLLM %s %.3f s", route, time.monotonic() - t)
        return json.loads(raw) if expect_json else raw


def remove_stale(run_dir: Path) -> None:
    """Remove what a killed stage left (its work directory; the watchdog has stopped its server): a directory of
    ours whose stage process is gone and whose server, if it had one, is not running."""
    for work in Path(run_dir).glob(WORK_PREFIX + "*"):
        try:
            rec = json.loads((work / "server.json").read_text())
        except (OSError, ValueError):
            continue          # being created this instant (a directory without its record is not ours to judge)
        owner, server = rec.get("owner"), rec.get("pid")
        if not (isinstance(owner, int) and owner > 0 and pid_alive(owner)) and not (
                isinstance(server, int) and server > 0 and vs.is_running(server)):
            shutil.rmtree(work, ignore_errors=True)


def sampler_for(cfg: Config, policy, tokenizer_dir: Path) -> VLLMSampler | None:
    """The stage's vLLM sampler when rl.sampler is vllm (None: our own sampler, evaluation/decode.sample_decode)."""
    if cfg.rl.sampler != "vllm":
        return None
    if dist.world_size(cfg) > 1:
        raise UserError(f"rl.sampler vllm runs in one process, and this config runs {dist.world_size(cfg)} "
                        "(dist.nproc_per_node × dist.nnodes): use rl.sampler ours under torchrun, or one process")
    return VLLMSampler(cfg, policy, tokenizer_dir)


def rl_stage(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    """The rl stage (tasks/table.py): engine/rl.py, its answers sampled by vLLM when rl.sampler is vllm."""
    return rl.run(cfg, inputs, out_dir, make_sampler=sampler_for)
