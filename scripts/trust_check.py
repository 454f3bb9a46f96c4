"""The trust issue's acceptance, run from outside the engine's internals: the default model behind the
OpenAI app (in-process ASGI, as `engine.openai_client()` reaches it), hostile requests one at a time,
each beside another client's 2-token request and an event-loop stall monitor. Prints one row per case:
the hostile request's status and time, the bystander's time, the loop's longest stall, engine health.

    .venv/bin/python scripts/trust_check.py            # ~3-5 minutes on 2 cores
"""

from __future__ import annotations

import random
import time
from typing import Any

import anyio

from asyncpage import AsyncEngine
from asyncpage.openai import http_client

VLLM_PROMPT = [107, 4606, 236787, 107]


def long_schema(n_props: int = 300, name_len: int = 200) -> dict[str, Any]:
    """A schema whose shortest value is long: many required booleans with long names."""
    props = {f"p{i:03d}_" + "x" * name_len: {"type": "boolean"} for i in range(n_props)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def one_of_schema(n: int = 400) -> dict[str, Any]:
    return {"oneOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"],
                       "additionalProperties": False} for i in range(n)]}


def cases() -> list[tuple[str, str, dict[str, Any], float]]:
    chat = [{"role": "user", "content": "Give me JSON."}]
    return [
        ("20,000 prompts, one /v1/completions", "/completions",
         {"prompt": ["a"] * 20_000, "max_tokens": 2}, 120),
        ("5,000 stop strings", "/completions",
         {"prompt": "Once upon a time", "max_tokens": 8, "stop": [f"zz{i}q" for i in range(5000)]}, 120),
        ("response_format: 400-branch oneOf", "/chat/completions",
         {"messages": chat, "max_tokens": 16,
          "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": one_of_schema()}}}, 60),
        ("response_format: shortest value ~18k tokens", "/chat/completions",
         {"messages": chat, "max_tokens": 64,
          "response_format": {"type": "json_schema", "json_schema": {"name": "l", "schema": long_schema()}}}, 60),
    ]


async def main() -> None:
    engine = AsyncEngine.from_pretrained()
    # The default model has no chat template (a base model): give it a plain one for the chat cases.
    if not getattr(engine.tokenizer, "chat_template", None):
        engine.tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                          "{% if add_generation_prompt %}assistant: {% endif %}")
    async with engine, http_client(engine, module="httpx") as client:
        stall = [0.0]

        async def monitor() -> None:
            while True:
                t = time.perf_counter()
                await anyio.sleep(0.01)
                stall[0] = max(stall[0], time.perf_counter() - t - 0.01)

        async def bystander() -> tuple[int, float]:
            t = time.perf_counter()
            r = await client.post("/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
            return r.status_code, time.perf_counter() - t

        rows = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(monitor)
            for name, route, body, bound in cases():
                stall[0] = 0.0
                res: dict[str, Any] = {}

                async def hostile(route: str = route, body: dict[str, Any] = body, res: dict[str, Any] = res,
                                  bound: float = bound) -> None:
                    t = time.perf_counter()
                    r = await client.post(route, json=body, timeout=bound + 30)
                    res.update(status=r.status_code, secs=time.perf_counter() - t, body=r.text[:160])

                async with anyio.create_task_group() as inner:
                    inner.start_soon(hostile)
                    await anyio.sleep(0.2)  # the hostile request is in
                    code, secs = await bystander()
                rows.append((name, res["status"], res["secs"], bound, code, secs, stall[0], engine.healthy,
                             res["body"]))
                print(*rows[-1], sep=" | ", flush=True)
            # Malformed bodies: none may be a 5xx.
            rng = random.Random(0)
            junk = [b"{", b'{"prompt": "\\ud800", "max_tokens": 1}', b'{"prompt": 1e999}', b"[" * 5000,
                    b'{"prompt": "x", "max_tokens": 2, "temperature": 99999999999999999999}',
                    b'{"prompt": "x", "max_tokens": 2, "seed": 99999999999999999999}',
                    b'{"prompt": "x", "max_tokens": 2, "top_k": 99999999999999999999}', b'{"messages": [{"role": 5}]}',
                    b'{"prompt": ["a", 3]}', b"\xff\xfe", b'{"stop": {"a": 1}, "prompt": "x"}']
            codes: dict[int, int] = {}
            for i in range(300):
                raw = junk[i % len(junk)] if i < 100 else bytes(rng.randrange(256) for _ in range(rng.randrange(1, 60)))
                route = "/completions" if i % 2 else "/chat/completions"
                try:  # a body that is a valid request runs to its end: bounded, so one cannot hold the run
                    r = await client.post(route, content=raw, headers={"content-type": "application/json"},
                                          timeout=60)
                    status = r.status_code
                except Exception:  # the client's timeout
                    status = -1
                codes[status] = codes.get(status, 0) + 1
            # The vLLM invalid-prefix sequence through the engine, then an ordinary request.
            from asyncpage import SamplingParams
            from tests.test_request_faults import VLLM_TEXT, VLLM_TOKENS, token_grammar
            out = await engine.generate(VLLM_PROMPT, SamplingParams(grammar=token_grammar(VLLM_TOKENS),
                                                                    max_tokens=len(VLLM_TOKENS) + 4))
            vllm_ok = out.token_ids == VLLM_TOKENS and out.text == VLLM_TEXT
            code, secs = await bystander()
            tg.cancel_scope.cancel()
        print(f"{'case':46} {'status':>6} {'secs':>7} {'bound':>5} {'other':>5} {'other s':>7} {'stall s':>7} healthy")
        for name, st, s, b, oc, os_, stl, ok, _ in rows:
            print(f"{name:46} {st:>6} {s:7.2f} {b:5.0f} {oc:>5} {os_:7.2f} {stl:7.3f} {ok}")
        for name, _st, *_, text in rows:
            print(f"  {name}: {text}")
        print("malformed bodies by status:", dict(sorted(codes.items())), "(no 5xx)" if max(codes) < 500 else "5xx!")
        print(f"vLLM invalid-prefix sequence exact: {vllm_ok}; next request {code} in {secs:.2f} s; "
              f"healthy {engine.healthy}")


if __name__ == "__main__":
    anyio.run(main)
