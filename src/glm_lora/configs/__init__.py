"""The config schema (schema.py), the presets (*.yaml) and their loader (load.py)."""
