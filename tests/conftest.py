"""Test session setup: a private Prefect home (caches never leak between sessions), offline."""
import os
import tempfile

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
