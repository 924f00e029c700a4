"""Print the answer the most recent serve stage got from its vLLM server."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(runs_dir: str = "runs") -> int:
    answers = sorted(Path(runs_dir).glob("*/serve/answer.json"), key=lambda p: p.stat().st_mtime)
    if not answers:
        print(f"no served answer under {runs_dir}/*/serve/", file=sys.stderr)
        return 1
    a = json.loads(answers[-1].read_text())
    print(f"\n[{a['endpoint']}] model={a['model']}\n  Q: {a['prompt']}\n  A: {a['answer']}"
          f"\n  (in-process greedy: {a['inprocess_answer']!r}; match={a['matches_inprocess']};"
          f" server {'running' if a['running'] else 'stopped'})")
    if a.get("api_key_from"):
        print(f"  the endpoint requires 'Authorization: Bearer <key>'; the key is in the {a['api_key_from']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
