"""Test session setup: a private Prefect home (caches never leak between sessions), offline."""
import json
import os
import resource
import tempfile
import time

import pytest
import torch

# Triton kernels run in the interpreter on CPU-only machines (CI). It must be set before any
# module with @triton.jit is imported; on a GPU the real compiler is used.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="glm-lora-prefect-")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "glm_lora")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist (scripts/test.sh: `-n 2 --dist loadscope`) each busy worker gets its share of the cores, so
# two workers on a 2-core machine don't oversubscribe them (a 2-thread OpenMP step on a busy core stalls 6-26x,
# bench/RESULTS.md "Two cores"). The share reaches child processes (stages run as processes, torchrun ranks).
# With fewer modules than workers (e.g. one file selected) the idle workers are shut down: no sharing then.
def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_finish(session):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    busy = min(workers, len({_module(item) for item in session.items}))
    if busy > 1:
        threads = max(1, (os.cpu_count() or 1) // busy)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


# The longest modules first (CI durations on the 2-core machine), so that with `--dist loadscope
# --no-loadscope-reorder` each starts on its own worker while the short ones fill the gaps, instead of
# the default DAG's ~12 min starting last.
LONGEST_FIRST = ("tests/test_quality.py", "tests/serve/test_deployment.py", "tests/test_dag.py",
                 "tests/engine/test_dist.py", "tests/serve/test_vllm_server.py", "tests/engine/test_kill_resume.py",
                 "tests/tasks/test_multinode.py")


# Last: they wait for llama.cpp's runtime, built beside the other tests (scripts/test.sh).
LAST = ("tests/export/test_gguf.py",)


def pytest_collection_modifyitems(items):
    def rank(item):
        path = _module(item)
        if path in LAST:
            return len(LONGEST_FIRST) + 1
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)     # stable: the rest keep their order


# GLM_LORA_TEST_CPU_LOG=FILE: one JSON line per test with its CPU seconds (this process plus the children it reaped:
# stage processes, torchrun ranks, servers stopped during it) and wall seconds; `python -m bench.ci_cpu FILE` sums
# them per module (bench/RESULTS.md "Where CI's CPU goes"). Off by default.
def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    log = os.environ.get("GLM_LORA_TEST_CPU_LOG")
    if not log:
        return (yield)
    cpu, wall = _cpu_seconds(), time.time()
    try:
        return (yield)
    finally:
        with open(log, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "cpu_s": round(_cpu_seconds() - cpu, 3),
                                "wall_s": round(time.time() - wall, 3), "start": wall,
                                "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}) + "\n")
