"""`asyncpage serve`: the OpenAI-compatible app (asyncpage.openai) under uvicorn, for those who want
a server. The engine is loaded before uvicorn starts and run by the app's lifespan; uvicorn owns
the signals here (this is the one place asyncpage is the host process, not a guest in one)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from typing import Any


def add_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs asyncpage[openai])")
    s.add_argument("--model", default=None, help="HF directory, cached hub id or .gguf (default: gemma-3-270m)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    s.add_argument("--device", default="auto")
    s.add_argument("--max-request-bytes", type=int, default=None,
                   help="refuse request bodies over this many bytes with a 413 (default 8 MiB)")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from asyncpage import AsyncEngine
    from asyncpage.openai import MAX_REQUEST_BYTES, app

    engine = AsyncEngine.from_pretrained(args.model, dtype=args.dtype, device=args.device)
    application = app(engine, max_request_bytes=args.max_request_bytes or MAX_REQUEST_BYTES)

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        async with engine:
            yield

    application.router.lifespan_context = lifespan
    uvicorn.run(application, host=args.host, port=args.port, log_level="info")
    return 0
