"""`asyncpage serve`: the OpenAI-compatible app (asyncpage.openai.routes) under uvicorn, for those who want
a server. The engine is loaded before uvicorn starts and run by the app's lifespan; uvicorn owns
the signals here (this is the one place asyncpage is the host process, not a guest in one).

Owns the serve flags: every AsyncEngine.from_pretrained option (ENGINE_FLAGS; a flag not given
leaves the engine's own default), the door (--api-key or ASYNCPAGE_API_KEY, --allowed-origins,
--allowed-hosts; see asyncpage.openai.routes) and uvicorn's limits (--limit-concurrency,
--timeout-keep-alive, --h11-max-incomplete-event-size, --body-timeout). With --ray the same app runs on
Ray Serve instead (asyncpage.ray.serve_app): --num-replicas engines behind Serve's HTTP proxy, on the
cluster at --address (else RAY_ADDRESS, else a local one)."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncpage.engine import AsyncEngine

_LOG = logging.getLogger("asyncpage.serve")

# uvicorn's limits, each a flag. Past limit_concurrency (connections and tasks at once) uvicorn
# answers 503 without reading the request; the engine's own bound is max_queued_requests (429).
LIMIT_CONCURRENCY = 256
TIMEOUT_KEEP_ALIVE_S = 5
# The request line and headers together (h11's limit; uvicorn's own default): past it a 400.
H11_MAX_INCOMPLETE_EVENT_SIZE = 16 << 10

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def _bytes(text: str) -> int:
    """A size: 1073741824, 1e9, 512MiB, 2GiB, 2G (binary units either way), 500MB (decimal)."""
    m = _SIZE.match(text)
    if m is None:
        try:
            return int(float(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1073741824)") from None
    number, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if unit == "b":
        return int(number)
    base = 1000 if unit.endswith("b") and "i" not in unit else 1024
    return int(number * base ** ("kmgt".index(unit[0]) + 1))


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"method\": \"ngram\"}'")
    return value


def _quantization(text: str) -> str | None:
    """`--quantization none` is from_pretrained's None (dequantize); the others pass as spelled."""
    return None if text.lower() == "none" else text


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


_BOOL = argparse.BooleanOptionalAction
# from_pretrained option -> (argparse keywords, the engine's default as shown in --help). A test checks
# that this names every option of from_pretrained and shows its real default.
ENGINE_FLAGS: dict[str, tuple[dict[str, Any], Any]] = {
    "dtype": ({"choices": ["auto", "float32", "bfloat16", "float16"]}, "auto"),
    "device": ({"help": "cpu, cuda, cuda:1, ..."}, "auto"),
    "block_size": ({"type": int, "help": "tokens per KV block"}, 16),
    "num_kv_blocks": ({"type": int, "help": "the KV pool in blocks (default: sized from --kv-cache-memory)"}, None),
    "max_num_batched_tokens": ({"type": int, "help": "tokens per engine step"}, 512),
    "max_num_seqs": ({"type": int, "help": "sequences running at once"}, 64),
    "enable_prefix_caching": ({"action": _BOOL, "help": "share cached prompt prefixes between requests"}, True),
    "attention_backend": ({}, "auto"),
    "max_model_len": ({"type": int, "help": "context length (default: the model's)"}, None),
    "kv_cache_memory": ({"type": _bytes, "metavar": "SIZE", "help": "KV pool memory, e.g. 2GiB (default: 1 GiB "
                         "on the CPU, 80%% of free GPU memory on CUDA)"}, None),
    "num_threads": ({"type": int, "flags": ["--num-threads", "--threads"],
                     "help": "torch CPU threads (default: the cores this process may use)"}, None),
    "guided_backend": ({"choices": ["llguidance", "xgrammar"]}, "llguidance"),
    "grammar_compile_timeout": ({"type": float, "metavar": "S", "help": "refuse grammars slower to compile"}, 5.0),
    "debug_checks": ({"action": _BOOL, "help": "check the KV pool's invariants every step (slow)"}, None),
    "eviction_policy": ({"help": "which cached prefix a full pool gives up first: lru, or the default"}, None),
    "quantization": ({"type": _quantization, "help": "auto: a GGUF's own quantized blocks, float weights float; "
                      "int8 | int4: float weights as GGUF blocks at load; none: dequantize"}, "auto"),
    "kv_cache_dtype": ({"help": "auto | int8 | fp8"}, "auto"),
    "speculative_config": ({"type": _json_object, "metavar": "JSON", "flags": ["--speculative-config", "--speculative"],
                            "help": "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'"}, None),
    "compile": ({"action": _BOOL, "help": "torch.compile the decode layers at load (CPU)"}, None),
    "max_queued_requests": ({"type": int, "help": "requests waiting to start past which a new one gets HTTP 429 "
                             "with Retry-After"}, 2048),
}


def add_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs asyncpage[openai])",
                       description="An OpenAI-compatible HTTP server over one engine. Engine flags left out keep "
                       "the engine's defaults (shown).")
    s.add_argument("--model", default=None, help="HF directory, cached hub id or .gguf (default: gemma-3-270m)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=8000)

    door = s.add_argument_group("the door")
    door.add_argument("--api-key", default=os.environ.get("ASYNCPAGE_API_KEY"), metavar="KEY",
                      help="require 'Authorization: Bearer KEY' on every route (401 otherwise); default: "
                      "$ASYNCPAGE_API_KEY, else none. Prefer the variable: a flag shows in `ps`")
    door.add_argument("--allowed-origins", type=_names, default=[], metavar="O1,O2",
                      help="browser origins served, with CORS (e.g. http://localhost:3000; '*': any). A request "
                      "carrying any other Origin header gets a 403. Default: none (clients that are not browsers "
                      "send no Origin)")
    door.add_argument("--allowed-hosts", type=_names, default=None, metavar="H1,H2",
                      help="Host names served besides localhost and loopback IPs ('*': any), e.g. behind a reverse "
                      "proxy that keeps the Host header. Default: on a loopback connection only loopback names "
                      "(DNS rebinding), anything on other addresses")

    limits = s.add_argument_group("limits")
    limits.add_argument("--max-request-bytes", type=_bytes, default=None, metavar="SIZE",
                        help="refuse request bodies over this many bytes with a 413 (default 8 MiB)")
    limits.add_argument("--body-timeout", type=float, default=None, metavar="S",
                        help="a request body not fully received within S seconds gets a 408 (default 60)")
    limits.add_argument("--limit-concurrency", type=int, default=LIMIT_CONCURRENCY, metavar="N",
                        help="connections and requests at once; past it uvicorn answers 503 (default %(default)s)")
    limits.add_argument("--timeout-keep-alive", type=int, default=TIMEOUT_KEEP_ALIVE_S, metavar="S",
                        help="close an idle keep-alive connection after S seconds (default %(default)s)")
    limits.add_argument("--h11-max-incomplete-event-size", type=_bytes, default=H11_MAX_INCOMPLETE_EVENT_SIZE,
                        metavar="SIZE", help="largest request line and headers (default %(default)s bytes)")

    on_ray = s.add_argument_group("Ray Serve (needs asyncpage[ray])")
    on_ray.add_argument("--ray", action="store_true",
                        help="serve on Ray Serve: --num-replicas engines (one CPU each) behind one endpoint, "
                        "a conversation's turns (prompt_cache_key) routed to the replica holding its cache")
    on_ray.add_argument("--num-replicas", type=int, default=1, metavar="N", help="engine replicas (default 1)")
    on_ray.add_argument("--address", default=None, metavar="ADDR",
                        help="the Ray cluster to join (default: $RAY_ADDRESS, else a local cluster)")

    engine = s.add_argument_group("engine (AsyncEngine.from_pretrained's options)")
    for name, (kw, default) in ENGINE_FLAGS.items():
        kw = dict(kw)
        flags = kw.pop("flags", ["--" + name.replace("_", "-")])
        shown = "on" if default is True else "off" if default is False else default
        kw["help"] = (kw.get("help", "") + f" (default: {shown})").strip() if default is not None else kw.get("help")
        engine.add_argument(*flags, dest=name, default=argparse.SUPPRESS, **kw)
    engine.add_argument("--chat-template", default=None, metavar="PATH",
                        help="a Jinja chat template file, used instead of the model's own")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The from_pretrained keywords the command line gave (left-out flags are absent, so the engine's
    defaults apply)."""
    return {name: getattr(args, name) for name in ENGINE_FLAGS if hasattr(args, name)}


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    # h11, not httptools: the incomplete-event (header size) limit is h11's; request parsing is never
    # what limits a model server's throughput.
    return {"host": args.host, "port": args.port, "log_level": "info", "http": "h11",
            "limit_concurrency": args.limit_concurrency, "timeout_keep_alive": args.timeout_keep_alive,
            "h11_max_incomplete_event_size": args.h11_max_incomplete_event_size}


def _chat_template(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"asyncpage serve: --chat-template {path}: {exc}") from None


def load_engine(args: argparse.Namespace) -> AsyncEngine:
    """The engine the flags describe (not started). --chat-template goes to from_pretrained where it
    takes one, else onto the loaded tokenizer, where chat and apply_chat_template read it."""
    import inspect

    from asyncpage import AsyncEngine

    options = engine_options(args)
    template = _chat_template(args.chat_template) if args.chat_template else None
    takes_template = "chat_template" in inspect.signature(AsyncEngine.from_pretrained).parameters
    if template is not None and takes_template:
        options["chat_template"] = template
    engine = AsyncEngine.from_pretrained(args.model, **options)
    if template is not None and not takes_template:
        engine.tokenizer.chat_template = template
    return engine


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_on_ray(args: argparse.Namespace) -> int:
    """`asyncpage serve --ray`: the app on Ray Serve until interrupted. The proxy listens on --host/--port;
    the uvicorn limits are Serve's own there."""
    import ray
    from ray import serve

    from asyncpage.errors import AsyncPageError
    from asyncpage.openai.routes import BODY_TIMEOUT_S, MAX_REQUEST_BYTES
    from asyncpage.ray import serve_app

    options: dict[str, Any] = {"model": args.model, **engine_options(args)}
    if args.chat_template:
        options["chat_template"] = _chat_template(args.chat_template)
    try:
        application = serve_app(args.num_replicas, options, api_key=args.api_key,
                                allowed_origins=args.allowed_origins, allowed_hosts=args.allowed_hosts,
                                max_request_bytes=args.max_request_bytes or MAX_REQUEST_BYTES,
                                body_timeout=args.body_timeout or BODY_TIMEOUT_S)
    except (AsyncPageError, ValueError) as exc:
        print(f"asyncpage serve: {exc}", file=sys.stderr)
        return 2
    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    address = args.address or os.environ.get("RAY_ADDRESS") or None
    ray.init(address=address, include_dashboard=False)
    # After ray.init, which installs its own (an abort): a service manager's stop, the same exit as Ctrl-C.
    signal.signal(signal.SIGTERM, stop)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application, name="asyncpage", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        try:
            # A local cluster (started here) goes with Serve; on a shared one only this app is removed.
            serve.shutdown() if address is None else serve.delete("asyncpage")
        finally:
            ray.shutdown()
    return 0


def serve(args: argparse.Namespace) -> int:
    if args.api_key is not None and not args.api_key.strip():
        # `--api-key "$UNSET"` (or an ASYNCPAGE_API_KEY set to nothing) must not serve anyone with no key.
        print("asyncpage serve: --api-key (or ASYNCPAGE_API_KEY) is empty; give a key, or unset it to serve "
              "without one", file=sys.stderr)
        return 2
    from asyncpage.errors import InvalidRequestError
    from asyncpage.openai.convert import BODY_TIMEOUT_S, MAX_REQUEST_BYTES
    from asyncpage.openai.door import check_door_options

    try:  # before minutes of loading: a negative --body-timeout would make every request a 408
        check_door_options(args.api_key, args.allowed_origins, args.allowed_hosts,
                           args.max_request_bytes or MAX_REQUEST_BYTES, args.body_timeout or BODY_TIMEOUT_S)
    except InvalidRequestError as exc:
        print(f"asyncpage serve: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "ray", False):
        return serve_on_ray(args)
    import uvicorn

    from asyncpage.errors import AsyncPageError
    from asyncpage.openai.routes import BODY_TIMEOUT_S, MAX_REQUEST_BYTES, app

    try:
        engine = load_engine(args)
    except (AsyncPageError, ValueError) as exc:
        print(f"asyncpage serve: {exc}", file=sys.stderr)
        return 2
    if args.api_key is None and not _is_loopback(args.host):
        _LOG.warning("serving on %s with no API key: anyone who can reach it may use it (set ASYNCPAGE_API_KEY)",
                     args.host)
    application = app(engine, max_request_bytes=args.max_request_bytes or MAX_REQUEST_BYTES, api_key=args.api_key,
                      allowed_origins=args.allowed_origins, allowed_hosts=args.allowed_hosts,
                      body_timeout=args.body_timeout or BODY_TIMEOUT_S)

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        async with engine:
            yield

    application.router.lifespan_context = lifespan
    uvicorn.run(application, **uvicorn_options(args))
    return 0
