"""Print the answer of the most recent promotion (serve stage or `serve promote`) and what the endpoint serves.

Looks in every deployment this machine lists (serve/deploy.py's index: any runs_dir) and in RUNS_DIR
(default runs/); `python -m glm_lora.flows.answer [RUNS_DIR]`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(runs_dir: str = "runs") -> int:
    from glm_lora.serve.deploy import ANSWER, indexed

    answers = [*Path(runs_dir).glob("*/serve/answer.json"), *Path(runs_dir).glob(f"*/serving/{ANSWER}"),
               *(root / ANSWER for root in indexed() if (root / ANSWER).is_file())]
    if not answers:
        print(f"no served answer under {runs_dir}/*/serve/ or any listed deployment", file=sys.stderr)
        return 1
    a = json.loads(max(answers, key=lambda p: p.stat().st_mtime).read_text())
    print(f"\n[{a['endpoint']}] model={a['model']}\n  Q: {a['prompt']}\n  A: {a['answer']}"
          f"\n  (in-process greedy: {a['inprocess_answer']!r}; match={a['matches_inprocess']};"
          f" server {'running' if a['running'] else 'stopped'}{'' if a.get('restarted', True) else ', unchanged export: not restarted'})")
    for name, m in a.get("models", {}).items():
        print(f"  model {name!r}: {m['what']}" + (f" (adapter on {m['parent']!r})" if m.get("parent") else ""))
    if a.get("api_key_from"):
        print(f"  the endpoint requires 'Authorization: Bearer <key>'; the key is in the {a['api_key_from']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
