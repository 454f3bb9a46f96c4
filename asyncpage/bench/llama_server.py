"""`asyncpage bench --baseline llama-server`: llama.cpp's own C++ server (`llama-server`, one slot per
request: `-np 32` for the 32-request mixed workload, continuous batching) on the same GGUF, fed the
same requests at once over HTTP: the same token-id prompts, `n_predict` = each request's max_tokens,
greedy, EOS ignored, streamed, as asyncpage's side runs them. Output tokens are the server's own
`tokens_predicted`. The binary comes from `--llama-server PATH` or `$LLAMA_SERVER` (README: how to
build it); the server is always terminated, on errors and Ctrl-C too.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from typing import IO, Any, TypeVar

from asyncpage.bench.throughput import BenchResult, Item, _pct

T = TypeVar("T")


class LlamaServerError(RuntimeError):
    pass


def find_llama_server(explicit: str | None) -> str:
    """The binary: `explicit`, else $LLAMA_SERVER, else `llama-server` on PATH; LlamaServerError if none."""
    name = explicit or os.environ.get("LLAMA_SERVER") or "llama-server"
    path = shutil.which(name) or (name if os.path.isfile(name) and os.access(name, os.X_OK) else None)
    if path is None:
        raise LlamaServerError(
            f"llama-server binary not found ({name!r}): pass --llama-server PATH or set LLAMA_SERVER "
            "(README: building llama-server)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(binary: str, model: str, items: list[Item], threads: int, port: int,
                   slots: int | None = None) -> list[str]:
    """One slot per request by default; each slot's context holds the longest request (the KV cache is
    split evenly between slots unless unified)."""
    slots = slots or max(1, len(items))
    per_slot = max(len(it.prompt) + it.max_tokens for it in items) + 16
    return [binary, "-m", model, "-np", str(slots), "-c", str(slots * per_slot), "-cb",
            "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1", "--port", str(port),
            "--no-webui"]


async def _wait_healthy(client: Any, proc: subprocess.Popen[bytes], url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LlamaServerError(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            r = await client.get(url + "/health", timeout=2.0)
            if r.status_code == 200:
                return
        except Exception:  # not listening yet
            pass
        await asyncio.sleep(0.2)
    raise LlamaServerError(f"llama-server not healthy after {timeout:.0f} s")


async def _complete(client: Any, url: str, item: Item, ttfts: list[float], itls: list[float]) -> int:
    """One streamed /completion; returns the server's tokens_predicted."""
    body = {"prompt": item.prompt, "n_predict": item.max_tokens, "temperature": 0.0, "top_k": 1,
            "ignore_eos": True, "stream": True, "cache_prompt": True}
    start = time.perf_counter()
    last: float | None = None
    predicted: int | None = None
    async with client.stream("POST", url + "/completion", json=body, timeout=None) as r:
        if r.status_code != 200:
            await r.aread()
            raise LlamaServerError(f"/completion answered {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("stop"):
                predicted = int(chunk["tokens_predicted"])
                break
            now = time.perf_counter()
            k = max(1, len(chunk.get("tokens") or ()))
            if last is None:
                ttfts.append(now - start)
            else:
                itls.extend([(now - last) / k] * k)
            last = now
    if predicted is None:
        raise LlamaServerError("/completion stream ended without a final chunk")
    return predicted


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def gather_or_cancel(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """All their results; when one fails (or Ctrl-C), the others are cancelled and awaited first, so
    none is still talking to the server when it is stopped."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _tail(log: IO[bytes], n: int = 600) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-n:]


async def run_llama_server(binary: str, model: str, items: list[Item], threads: int | None = None,
                           slots: int | None = None, startup_timeout: float = 300.0) -> BenchResult:
    """Start llama-server on `model`, warm it up with one short request, then send every item at once
    and time them; the server is stopped before returning (or raising)."""
    import httpx

    n_threads = threads or len(os.sched_getaffinity(0))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(binary, model, items, n_threads, port, slots)
    ttfts: list[float] = []
    itls: list[float] = []
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(items) + 4)) as client:
                await _wait_healthy(client, proc, url, startup_timeout)
                await _complete(client, url, Item(items[0].prompt[:8], 4), [], [])  # warm-up, not counted
                t0 = time.perf_counter()
                counts = await gather_or_cancel([_complete(client, url, it, ttfts, itls) for it in items])
                wall = time.perf_counter() - t0
        except LlamaServerError as exc:
            raise LlamaServerError(f"{exc}; its log ends:\n{_tail(log)}") from None
        finally:
            _stop(proc)
    out = sum(counts)
    asked = sum(it.max_tokens for it in items)
    if out != asked:
        print(f"# llama-server generated {out} tokens, {asked} asked for", file=sys.stderr)
    return BenchResult(workload="", engine=f"llama-server ({len(items) if slots is None else slots} slots, "
                       f"{n_threads} threads)", dtype="gguf", num_requests=len(items), output_tokens=out,
                       prompt_tokens=sum(len(it.prompt) for it in items), wall_s=wall,
                       throughput_tok_s=out / wall, ttft_p50_ms=_pct(ttfts, 50), ttft_p99_ms=_pct(ttfts, 99),
                       itl_p50_ms=_pct(itls, 50), itl_p99_ms=_pct(itls, 99))
