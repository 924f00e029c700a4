"""Evaluation apart from training: decoding (decode.py), held-out metrics (metrics.py, heldout.py), the promotion
gate (gate.py) and lm-evaluation-harness (harness.py)."""
