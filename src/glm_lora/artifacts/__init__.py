"""Stage outputs as directories with a manifest (manifest.py) and the run-wide lock (lock.py)."""
