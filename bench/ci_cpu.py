"""CPU seconds per test module from a GLM_LORA_TEST_CPU_LOG file (tests/conftest.py), largest first.

    GLM_LORA_TEST_CPU_LOG=/tmp/cpu.jsonl bash .ci/run; python -m bench.ci_cpu /tmp/cpu.jsonl [--tests 20]
"""
from __future__ import annotations

import argparse
import collections
import json


def per_module(rows: list[dict]) -> list[tuple[str, float, float, int]]:
    """(module, CPU s, wall s, tests), by CPU seconds, largest first."""
    sums: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        acc = sums[r["test"].split("::", 1)[0]]
        acc[0] += r["cpu_s"]
        acc[1] += r["wall_s"]
        acc[2] += 1
    return sorted(((m, c, w, n) for m, (c, w, n) in sums.items()), key=lambda x: -x[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--tests", type=int, default=0, help="also list the N tests with the most CPU seconds")
    args = ap.parse_args()
    with open(args.log) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    modules = per_module(rows)
    print(f"{len(rows)} tests: {sum(m[1] for m in modules) / 60:.1f} CPU-minutes, "
          f"{sum(m[2] for m in modules) / 60:.1f} worker-minutes")
    print("| module | CPU s | wall s | tests |\n|---|---|---|---|")
    for m, c, w, n in modules:
        print(f"| {m} | {c:.0f} | {w:.0f} | {n} |")
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[:args.tests]:
        print(f"{r['cpu_s']:8.1f} {r['wall_s']:8.1f}  {r['test']}")


if __name__ == "__main__":
    main()
