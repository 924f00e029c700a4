"""CPU seconds per process kind while something runs (bench/RESULTS.md "Where CI's CPU goes, by process").

    python bench/probe/proc_sampler.py sample OUT.jsonl &  S=$!; bash .ci/run; kill $S; wait $S
    python bench/probe/proc_sampler.py summary OUT.jsonl

`sample` reads every process's user + system CPU time from /proc every 0.5 s until SIGTERM, then writes one JSON line
per process seen (pid, ppid, command line, last CPU seconds, first / last seen). Processes shorter than 0.5 s are
missed. `summary` leaves out the processes already running at the first sample and sums the rest by KINDS.
"""
import collections
import json
import os
import re
import signal
import sys
import time

KINDS = (("vLLM engine cores", r"venv-vllm.*spawn_main"), ("vLLM API servers", r"vllm\.entrypoints"),
         ("setup: pip installs", r"pip install|-m venv|ensurepip"), ("pytest workers", r"exec\(eval\(sys\.stdin"),
         ("Prefect servers", r"prefect server start|prefect\.server\.api\.server"),
         ("torchrun launchers", r"torch\.distributed\.run"), ("engine processes (torchrun ranks)", r"-m glm_lora\.engine"),
         ("C/C++ builds (inductor, llama.cpp)", r"cc1plus|/ld |g\+\+|gcc|cmake|make|ninja|as "),
         ("the CLI and other glm_lora processes", r"glm_lora|glm-lora"), ("nginx", r"nginx"), ("postgres", r"postgres"))


def sample(out: str) -> None:
    tick, seen, stop = os.sysconf("SC_CLK_TCK"), {}, []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    while not stop:
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == os.getpid():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    s = f.read()
                rest = s[s.rindex(")") + 2:].split()       # the command name may hold spaces and parentheses
                key = (int(d), int(rest[19]))              # pid, start time: a reused pid is another process
                if key not in seen:
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
                    seen[key] = {"pid": int(d), "ppid": int(rest[1]), "cmd": cmd, "first": time.time()}
                seen[key].update(cpu_s=(int(rest[11]) + int(rest[12])) / tick, last=time.time())
            except (OSError, ValueError, IndexError):      # gone between listdir and open
                pass
        time.sleep(0.5)
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in seen.values())


def summary(path: str) -> dict[str, list]:
    rows = [json.loads(line) for line in open(path)]
    t0 = min(r["first"] for r in rows)
    sums: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for r in rows:
        if "cpu_s" in r and r["first"] > t0 + 0.2:
            kind = next((k for k, pattern in KINDS if re.search(pattern, r["cmd"])), "other")
            sums[kind][0] += r["cpu_s"]
            sums[kind][1] += 1
    return dict(sorted(sums.items(), key=lambda kv: -kv[1][0]))


if __name__ == "__main__":
    if sys.argv[1] == "sample":
        sample(sys.argv[2])
    else:
        for kind, (cpu, n) in summary(sys.argv[2]).items():
            print(f"| {kind} | {cpu:,.0f} | {n} |")
