"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) over chat().

A request's `input` (text, or items: messages, `function_call`, `function_call_output`), its
`instructions`, function `tools`, `tool_choice`, `text.format` and sampling fields become one chat
turn (asyncpage.chat: the same grammar-exact tool calls as /v1/chat/completions); the turn comes
back as output items (a `reasoning` item with the thinking as `reasoning_text`, a message with
`output_text`, `function_call`s) with usage, cached input and reasoning tokens included.
`reasoning.effort` (or `max_reasoning_tokens`) bounds the reasoning (asyncpage.chat.reasoning).
`previous_response_id` continues a stored response: its conversation (input and
output) is prepended, and its `prompt_cache_key` (or its id) keeps the conversation's blocks for the
next turn. `stream` sends the Responses event sequence (`response.created`, `.output_item.added`,
`.reasoning_text.delta`/`.done`, `.output_text.delta`, `.function_call_arguments.delta`/`.done`,
`.completed`, ...).

The store is in-process and bounded (ResponseStore: the MAX_STORED most recent within MAX_STORED_BYTES,
`store: false` keeps nothing); it lives with the app, one per `app()`. What a response echoes back is
checked as OpenAI checks it (`metadata`: at most 16 string pairs; `text`: `format` and `verbosity`), so a
stored response holds little beyond its conversation.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from asyncpage.chat import ChatDelta, ChatResult
from asyncpage.errors import InvalidRequestError
from asyncpage.openai.convert import reasoning_options

MAX_STORED = 1024  # responses kept for previous_response_id and GET, most recent first out last
MAX_STORED_BYTES = 256 << 20  # ... and at most this much of them (their JSON size), oldest out first
MAX_INPUT_ITEMS = 4096
MAX_METADATA = 16  # OpenAI's limits on `metadata`: 16 pairs, keys of 64 characters, values of 512
VERBOSITY = (None, "low", "medium", "high")


class ResponseStore:
    """Stored responses by id: the response object and the conversation it ended (chat messages),
    the `limit` most recent within `max_bytes` (each counted as its JSON's size)."""

    def __init__(self, limit: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.limit, self.max_bytes, self.bytes = limit, max_bytes, 0
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = OrderedDict()

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        size = len(msgspec.json.encode([response, messages]))
        self.delete(response["id"])
        self._items[response["id"]] = (response, messages, size)
        self.bytes += size
        while len(self._items) > self.limit or (self.bytes > self.max_bytes and len(self._items) > 1):
            self.bytes -= self._items.popitem(last=False)[1][2]

    def get(self, rid: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        kept = self._items.get(rid)
        return None if kept is None else (kept[0], kept[1])

    def delete(self, rid: str) -> bool:
        kept = self._items.pop(rid, None)
        if kept is not None:
            self.bytes -= kept[2]
        return kept is not None


def check_echoed(body: dict[str, Any]) -> None:
    """`metadata`, `text` and `store` as OpenAI takes them (a response echoes the first two back and the
    store keeps them): InvalidRequestError naming the field otherwise."""
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA:
            raise InvalidRequestError("metadata", f"must be an object of at most {MAX_METADATA} string pairs")
        for k, v in metadata.items():
            if not (isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512):
                raise InvalidRequestError("metadata", "keys must be strings of at most 64 characters and "
                                                      "values strings of at most 512")
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
            raise InvalidRequestError("text", "must be an object with `format` and / or `verbosity`")
        if text.get("verbosity") not in VERBOSITY:
            raise InvalidRequestError("text.verbosity", "must be low, medium or high")
    if body.get("store") is not None and not isinstance(body.get("store"), bool):
        raise InvalidRequestError("store", "must be true or false")


def check_call_ids(history: list[dict[str, Any]], value: Any) -> None:
    """Every `function_call_output` in `input` answers a call made before it (in the stored conversation
    or earlier in `input`), as OpenAI requires."""
    if not isinstance(value, list):
        return
    known = {c.get("id") for m in history for c in (m.get("tool_calls") or []) if isinstance(c, dict)}
    for i, item in enumerate(value):
        if isinstance(item, dict) and item.get("type") == "function_call":
            known.add(item.get("call_id"))
        elif isinstance(item, dict) and item.get("type") == "function_call_output" and item.get("call_id") not in known:
            raise InvalidRequestError(f"input[{i}].call_id",
                                      f"no function call {str(item.get('call_id'))[:80]!r} for this output")


def _text_of(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise InvalidRequestError(f"{field}[{i}]", "only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(f"{field}[{i}].text", "must be a string")
            parts.append(text)
        return "".join(parts)
    raise InvalidRequestError(field, "must be a string or a list of text parts")


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user message; items map one to one (consecutive
    `function_call` items become one assistant message with several tool calls)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("input", "must be a string or a non-empty list of items")
    if len(value) > MAX_INPUT_ITEMS:
        raise InvalidRequestError("input", f"has {len(value)} items, over the limit of {MAX_INPUT_ITEMS}")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        field = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(field, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(f"{field}.role",
                                          f"must be user, assistant, system or developer, got {role!r:.40}")
            out.append({"role": role, "content": _text_of(item.get("content"), f"{field}.content")})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", field), "type": "function",
                    "function": {"name": _str(item, "name", field), "arguments": _str(item, "arguments", field)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last.get("content"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", field),
                        "content": output if isinstance(output, str) else _text_of(output, f"{field}.output")})
        elif kind == "reasoning":
            continue  # the model's own earlier thinking is not shown to it again
        else:
            raise InvalidRequestError(f"{field}.type", f"{kind!r} items are not supported")
    return out


def _str(item: dict[str, Any], key: str, field: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{field}.{key}", "must be a string")
    return value


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses function tools ({"type": "function", "name", "parameters", ...}) in chat's shape."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", "must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise InvalidRequestError(f"tools[{i}]", "only function tools are supported")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                     if k in t}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None:
        return "auto"
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("text.format", "must be an object")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema"),
                                                      "strict": fmt.get("strict")}}
    if fmt.get("type") in ("json_object", "text"):
        return {"type": fmt["type"]}
    raise InvalidRequestError("text.format.type", f"must be text, json_object or json_schema, got {fmt.get('type')!r}")


# What chat() and SamplingParams call the fields a Responses body was translated into (longest first),
# and the body's own names for them: an error names what the client sent. `messages` also holds the
# instructions and a previous response's conversation, so its items' indexes are not `input`'s.
_BODY_NAMES = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
               ("max_tokens", "max_output_tokens"))
_TOOL_FUNCTION = re.compile(r"tools\[(\d+)\]\.function(?=\.|$)")


def body_field(field: str) -> str:
    """The Responses body's name for `field`, as chat() or SamplingParams named it (chat_tools and
    chat_response_format keep a tool's index and the format's schema)."""
    if field == "messages" or field.startswith(("messages.", "messages[")):
        return "input"
    tool = _TOOL_FUNCTION.match(field)
    if tool is not None:  # a Responses tool is flat: {"type": "function", "name", "parameters"}
        return f"tools[{tool.group(1)}]" + field[tool.end():]
    for ours, theirs in _BODY_NAMES:
        if field == ours or field.startswith((ours + ".", ours + "[")):
            return theirs + field[len(ours):]
    return field


def usage(u: Any) -> dict[str, Any]:
    cached = int(getattr(u, "cached_tokens", 0) or 0)
    thought = int(getattr(u, "reasoning_tokens", 0) or 0)
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def _effort(body: dict[str, Any]) -> Any:
    """`reasoning.effort` of a Responses body (None when absent)."""
    r = body.get("reasoning")
    if r is None:
        return None
    if not isinstance(r, dict):
        raise InvalidRequestError("reasoning", "must be an object such as {\"effort\": \"low\"}")
    return r.get("effort")


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class Turn:
    """One Responses request, as a chat turn: its messages, options and the response shell."""

    def __init__(self, body: dict[str, Any], store: ResponseStore, model: str, trust_template: bool = True) -> None:
        self.body = body
        previous = body.get("previous_response_id")
        history: list[dict[str, Any]] = []
        parent: dict[str, Any] | None = None
        if previous is not None:
            kept = store.get(previous) if isinstance(previous, str) else None
            if kept is None:
                raise InvalidRequestError("previous_response_id", f"no stored response {previous!r:.80}")
            parent, history = kept[0], [dict(m) for m in kept[1]]
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise InvalidRequestError("instructions", "must be a string")
        check_echoed(body)
        new = input_messages(body.get("input"))
        check_call_ids(history, body.get("input"))
        self.conversation = history + new  # what a later turn continues (instructions are per request)
        self.messages = ([{"role": "system", "content": instructions}] if instructions else []) + self.conversation
        self.tools = chat_tools(body.get("tools"))
        self.args: dict[str, Any] = dict(tools=self.tools, tool_choice=chat_tool_choice(body.get("tool_choice")),
                                         parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
                                         response_format=chat_response_format(body.get("text")),
                                         **reasoning_options(body, _effort(body), trust_template))
        self.store = body.get("store") is not False
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model
        # A conversation's blocks are kept under its cache key: the caller's, else its first response's id.
        key = body.get("prompt_cache_key")
        if not (isinstance(key, str) and key):
            key = parent.get("prompt_cache_key") if parent is not None else None
        self.cache_key: str | None = key or (self.id if self.store else None)

    def shell(self, status: str, output: list[dict[str, Any]], usage_: dict[str, Any] | None = None,
              incomplete: str | None = None) -> dict[str, Any]:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "parallel_tool_calls": self.args["parallel_tool_calls"],
                "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
                "instructions": b.get("instructions"), "previous_response_id": b.get("previous_response_id"),
                "max_output_tokens": b.get("max_output_tokens"), "temperature": b.get("temperature"),
                "top_p": b.get("top_p"), "text": b.get("text") or {"format": {"type": "text"}},
                "store": self.store, "metadata": b.get("metadata") or {}, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "prompt_cache_key": self.cache_key, "usage": usage_,
                "reasoning": {"effort": self.args["reasoning_effort"], "summary": None}}

    def finished(self, res: ChatResult, store: ResponseStore) -> dict[str, Any]:
        output: list[dict[str, Any]] = []
        if res.reasoning:
            output.append(_reasoning_item(res.reasoning))
        if res.content:
            output.append(_message_item(res.content))
        output += [_call_item(c.id, c.name, c.arguments) for c in res.tool_calls]
        incomplete = "max_output_tokens" if res.finish_reason == "length" else None
        response = self.shell("incomplete" if incomplete else "completed", output, usage(res.usage), incomplete)
        self._keep(response, res.content, res.tool_calls, store)
        return response

    def _keep(self, response: dict[str, Any], content: str | None, calls: list[Any], store: ResponseStore) -> None:
        if not self.store:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        store.put(response, [*self.conversation, reply])

    async def events(self, stream: AsyncIterator[ChatDelta], first: ChatDelta,
                     store: ResponseStore) -> AsyncIterator[dict[str, Any]]:
        """The Responses event sequence for a streamed turn, `first` delta already read."""
        seq = 0

        def event(kind: str, **fields: Any) -> dict[str, Any]:
            nonlocal seq
            seq += 1
            return {"type": kind, "sequence_number": seq - 1, **fields}

        yield event("response.created", response=self.shell("in_progress", []))
        yield event("response.in_progress", response=self.shell("in_progress", []))
        output: list[dict[str, Any]] = []
        text: list[str] = []
        message: dict[str, Any] | None = None
        calls: list[Any] = []
        final: ChatDelta | None = None

        async def deltas() -> AsyncIterator[ChatDelta]:
            yield first
            async for d in stream:
                yield d

        thinking: dict[str, Any] | None = None  # the reasoning item, while its text streams
        thought: list[str] = []

        def end_thinking() -> list[dict[str, Any]]:
            nonlocal thinking
            if thinking is None:
                return []
            item, thinking = thinking, None
            index, full = output.index(item), "".join(thought)
            part = {"type": "reasoning_text", "text": full}
            item.update(content=[part], status="completed")
            return [event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=full),
                    event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part),
                    event("response.output_item.done", output_index=index, item=item)]

        async for d in deltas():
            if d.reasoning:
                if thinking is None and not thought:
                    thinking = _reasoning_item("", "in_progress")
                    output.append(thinking)
                    yield event("response.output_item.added", output_index=len(output) - 1, item=dict(thinking))
                    yield event("response.content_part.added", item_id=thinking["id"], output_index=len(output) - 1,
                                content_index=0, part={"type": "reasoning_text", "text": ""})
                if thinking is not None:
                    thought.append(d.reasoning)
                    yield event("response.reasoning_text.delta", item_id=thinking["id"],
                                output_index=output.index(thinking), content_index=0, delta=d.reasoning)
            if d.content or d.tool_call is not None or d.finish_reason is not None:
                for e in end_thinking():
                    yield e
            if d.content:
                if message is None:
                    message = _message_item("", "in_progress")
                    message["content"][0]["text"] = ""
                    output.append(message)
                    yield event("response.output_item.added", output_index=len(output) - 1, item=message)
                    yield event("response.content_part.added", item_id=message["id"], output_index=len(output) - 1,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                text.append(d.content)
                yield event("response.output_text.delta", item_id=message["id"], output_index=output.index(message),
                            content_index=0, delta=d.content, logprobs=[])
            if d.tool_call is not None:
                tc = d.tool_call
                item = _call_item(tc.id or "", tc.name or "", "", "in_progress")
                output.append(item)
                index = len(output) - 1
                yield event("response.output_item.added", output_index=index, item=dict(item))
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=tc.arguments)
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=tc.arguments, name=item["name"])
                item.update(arguments=tc.arguments, status="completed")
                calls.append(_Call(item["call_id"], item["name"], tc.arguments))
                yield event("response.output_item.done", output_index=index, item=item)
            if d.finish_reason is not None:
                final = d
        if message is not None:
            index = output.index(message)
            full = "".join(text)
            message["content"][0]["text"] = full
            message["status"] = "completed"
            yield event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                        text=full, logprobs=[])
            yield event("response.content_part.done", item_id=message["id"], output_index=index, content_index=0,
                        part=message["content"][0])
            yield event("response.output_item.done", output_index=index, item=message)
        incomplete = "max_output_tokens" if final is not None and final.finish_reason == "length" else None
        u = usage(final.usage) if final is not None and final.usage is not None else None
        response = self.shell("incomplete" if incomplete else "completed", output, u, incomplete)
        self._keep(response, "".join(text) or None, calls, store)
        yield event("response.incomplete" if incomplete else "response.completed", response=response)


class _Call:
    def __init__(self, call_id: str, name: str, arguments: str) -> None:
        self.id, self.name, self.arguments = call_id, name, arguments


def sampling_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions fields of a Responses body (`max_output_tokens` is chat's max_tokens)."""
    out = {k: body[k] for k in ("temperature", "top_p", "seed") if body.get(k) is not None}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    return out
