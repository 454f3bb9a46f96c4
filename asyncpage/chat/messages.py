"""OpenAI-shaped chat requests: checked, normalized, and rendered into prompt token ids.

Owns the request side of chat(): messages, tools, tool_choice and response_format in OpenAI's
shapes, and the chat template (the checkpoint's own through transformers' apply_chat_template, or
the shipped Gemma 3 turn template for the default model, whose GGUF carries none). It does not
build grammars (grammar.py) nor read output (parse.py).

Every size here is bounded before any work that grows faster than the input (the limits below,
each refused as an InvalidRequestError naming its field, which the HTTP app answers with a 400).
Everything that is only linear (message count, content size) is bounded by the request body and
the context instead: the rendered prompt must fit max_model_len anyway.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from asyncpage.chat.formats import ToolFormat
from asyncpage.chat.reasoning import ReasoningMarkers, detect
from asyncpage.chat.types import Tool
from asyncpage.errors import InvalidRequestError
from asyncpage.guided.schema import map_subschemas

ROLES = ("system", "developer", "user", "assistant", "tool")

# OpenAI's own limits: at most 128 tools, names of 1-64 characters from [A-Za-z0-9_.-].
MAX_TOOLS = 128
# Messages in one conversation: an agent's longest turn has hundreds; rendering 240k of them took ~1.5 s
# of a preparation thread before the prompt was refused as too long.
MAX_MESSAGES = 4096
MAX_TOOL_NAME = 64
_TOOL_NAME = re.compile(rf"[A-Za-z0-9_.\-]{{1,{MAX_TOOL_NAME}}}")
# A schema (one tool's `parameters`, or response_format's schema) as compact JSON, and all the
# tools' `parameters` together. A grammar of 64 KiB of schema is already far past any real tool's;
# the bound keeps the rewrites (grammar.py) and the compile within the preparation deadline.
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMAS_BYTES = 256 * 1024
# Nesting of a schema or of a history call's arguments (JSON levels): the rewrites, copy.deepcopy
# and the templates' `tojson` recurse, so a deeper value would end in a RecursionError (a 500).
MAX_JSON_DEPTH = 128
# A chat template given with the request (chat_template=): a real one is a few KiB (Qwen3's: 4 KiB).
MAX_TEMPLATE_BYTES = 256 * 1024
# Branches of one oneOf: the oneOf-to-anyOf rewrite compares every pair of branches (O(n^2): 1,000
# branches cost 0.75 s here, 466k, which fit in 8 MiB, would take hours). 512 cost about 0.2 s.
MAX_ONE_OF = 512


def bad(field: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(field, message)


def json_extent(value: Any, max_depth: int = MAX_JSON_DEPTH, max_size: float = float("inf")) -> tuple[int, int]:
    """(nesting depth, a lower bound of the compact JSON size) of a JSON-shaped value, walked
    without recursion and given up as soon as either is past its bound: a huge or cyclic value costs
    only what the bounds allow (json.dumps would run to the end in C, holding the GIL)."""
    deepest, size = 0, 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            size += 2 + sum(len(k) + 4 if isinstance(k, str) else 4 for k in v)
            items: Any = v.values()
        elif isinstance(v, list | tuple):
            size += 2 + len(v)
            items = v
        else:
            size += len(v) + 2 if isinstance(v, str) else 4
            if size > max_size:
                return deepest, size
            continue
        d += 1
        deepest = max(deepest, d)
        if d > max_depth or size > max_size:
            return deepest, size
        stack.extend((x, d) for x in items)
    return deepest, size


def check_schema(schema: Any, field: str) -> int:
    """Refuse a schema past the limits above; its size in bytes (compact JSON) otherwise."""
    depth, approx = json_extent(schema, MAX_JSON_DEPTH, MAX_SCHEMA_BYTES)
    if depth > MAX_JSON_DEPTH:
        raise bad(field, f"is nested more than {MAX_JSON_DEPTH} levels deep")
    if approx <= MAX_SCHEMA_BYTES:  # a lower bound: the exact size is only taken of what may pass
        try:
            approx = len(json.dumps(schema, separators=(",", ":")))
        except (TypeError, ValueError) as exc:
            raise bad(field, f"must be JSON: {exc}") from exc
    if approx > MAX_SCHEMA_BYTES:
        raise bad(field, f"is over the limit of {MAX_SCHEMA_BYTES} bytes as JSON")

    def count(s: dict[str, Any]) -> dict[str, Any]:
        branches = s.get("oneOf")
        if isinstance(branches, list) and len(branches) > MAX_ONE_OF:
            raise bad(field, f"has a oneOf of {len(branches)} branches, over the limit of {MAX_ONE_OF}")
        return s

    map_subschemas(schema, count)  # recursion is safe: the depth is bounded above
    return approx


def parse_tools(tools: Any) -> list[Tool]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("tools", "must be a list of {'type': 'function', 'function': {...}} objects")
    if len(tools) > MAX_TOOLS:
        raise bad("tools", f"has {len(tools)} tools, over the limit of {MAX_TOOLS}")
    out: list[Tool] = []
    seen: set[str] = set()
    total = 0
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise bad(f"tools[{i}]", "must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            shown = name if not isinstance(name, str) or len(name) <= 80 else name[:80] + "..."
            raise bad(f"tools[{i}].function.name",
                      f"must match [A-Za-z0-9_.-]{{1,{MAX_TOOL_NAME}}}, got {shown!r}")
        if name in seen:
            raise bad(f"tools[{i}].function.name", f"duplicate tool name {name!r}")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters", "must be a JSON Schema object")
        kind = params.get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            # A call's arguments are a JSON object (as OpenAI requires); refused here, by name, before a
            # template renders the schema (many read its `properties`) or the grammar compiles it.
            raise bad(f"tools[{i}].function.parameters", f'must be a JSON Schema of type "object", got type '
                                                         f"{str(kind)[:40]!r}")
        total += check_schema(params, f"tools[{i}].function.parameters")
        if total > MAX_SCHEMAS_BYTES:
            raise bad("tools", f"the tools' parameters are over {MAX_SCHEMAS_BYTES} bytes of JSON together")
        out.append(Tool(name, str(fn.get("description") or ""), params))
    return out


def parse_tool_choice(tool_choice: Any, tools: list[Tool]) -> str:
    """"none" | "auto" | "required" | the name of the one tool to call."""
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad("tool_choice", f"must be none, auto, required or a named function, got {tool_choice!r}")
        if tool_choice == "required" and not tools:
            raise bad("tool_choice", "'required' needs at least one tool")
        return "none" if not tools else tool_choice
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad("tool_choice", "a named choice is {'type': 'function', 'function': {'name': ...}}")
        if not any(t.name == name for t in tools):
            raise bad("tool_choice", f"names {name!r}, which is not among the tools")
        if name in ("none", "auto", "required"):  # the turn's mode is the tool's name: it would read as the keyword
            raise bad("tool_choice", f"a tool named {name!r} cannot be chosen by name (rename it)")
        return name
    raise bad("tool_choice", f"must be a str or a dict, got {type(tool_choice).__name__}")


def parse_response_format(response_format: Any) -> dict[str, Any] | None:
    """The JSON Schema the answer must follow, or None for free text."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise bad("response_format", "must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        js = response_format.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if schema is None and isinstance(js, dict):
            return {}  # OpenAI allows a json_schema without a schema: any JSON
        if not isinstance(schema, dict | bool):
            raise bad("response_format.json_schema.schema", "must be a JSON Schema object")
        if isinstance(schema, dict):
            check_schema(schema, "response_format.json_schema.schema")
            return schema
        return {}
    raise bad("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")


def _text(content: Any, field: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                raise bad(field, "only text content parts are supported (this engine has no vision input)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise bad(field, f"must be a str or a list of text parts, got {type(content).__name__}")


def normalize(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages -> plain dicts the templates understand: text content, system and developer
    messages merged into one leading system message (most templates accept only one, first),
    tool-call arguments as dicts (templates apply `tojson` to them), tool results named."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise bad("messages", f"has {len(messages)} messages, over the limit of {MAX_MESSAGES}")
    system: list[str] = []
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object with a role")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        text = _text(m.get("content"), f"messages[{i}].content")
        if role in ("system", "developer"):
            system.append(text)
        elif role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if isinstance(m.get("reasoning_content"), str):  # templates that show earlier thinking read it
                msg["reasoning_content"] = m["reasoning_content"]
            calls = m.get("tool_calls") or []
            if calls:
                msg["tool_calls"] = [_call(c, f"messages[{i}].tool_calls[{j}]", names) for j, c in enumerate(calls)]
            out.append(msg)
        elif role == "tool":
            cid = m.get("tool_call_id")
            out.append({"role": "tool", "content": text, "tool_call_id": cid,
                        "name": m.get("name") or names.get(str(cid), "")})
        else:
            out.append({"role": "user", "content": text})
    if system:
        out.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return out


def _call(c: Any, field: str, names: dict[str, str]) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(field, "must be {'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': ...}}")
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except RecursionError:  # json.loads' own depth limit: the caller's value, a 400 like the rest
            raise bad(f"{field}.function.arguments", f"is nested more than {MAX_JSON_DEPTH} levels deep") from None
        except ValueError as exc:
            raise bad(f"{field}.function.arguments", f"is not JSON: {exc}") from exc
    # The templates render arguments with `tojson`, which recurses: bound them as schemas are.
    if json_extent(args)[0] > MAX_JSON_DEPTH:
        raise bad(f"{field}.function.arguments", f"is nested more than {MAX_JSON_DEPTH} levels deep")
    cid = str(c.get("id") or "")
    names[cid] = fn["name"]
    return {"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _plain(messages: list[dict[str, Any]], fmt: ToolFormat) -> list[dict[str, Any]]:
    """For templates that know nothing of tools: calls become the format's own text in the
    assistant turn, tool results become user turns, and consecutive turns of one role merge (some
    templates insist that user and assistant alternate)."""
    # Runs of one role are gathered and joined once: concatenating turn by turn copied the run so
    # far each time (quadratic in a run of many small messages).
    runs: list[tuple[str, list[str]]] = []
    for m in messages:
        role, text = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            calls = [(c["function"]["name"], json.dumps(c["function"]["arguments"])) for c in m["tool_calls"]]
            text = (text + "\n" if text else "") + fmt.render(calls)
        if role == "tool":
            role, text = "user", f"Result of the tool call {m['name'] or m['tool_call_id']}: {text}"
        if runs and runs[-1][0] == role and role != "system":
            runs[-1][1].append(text)
        else:
            runs.append((role, [text]))
    return [{"role": role, "content": "\n\n".join(texts)} for role, texts in runs]


@dataclass(frozen=True)
class Template:
    text: str
    knows_tools: bool  # it renders `tools` and tool-call turns itself
    markers: ReasoningMarkers | None = None  # what the model reasons within (reasoning.py), if it does
    field: str = "messages"  # what a rendering failure names: the request's own template is `chat_template`

    @property
    def reasoning(self) -> bool:
        return self.markers is not None


def shipped_gemma3_template() -> str:
    return resources.files("asyncpage.chat").joinpath("gemma3.jinja").read_text()


def template_of(tokenizer: Any, model_type: str, override: Any = None, markers: Any = None) -> Template:
    """The turn's template: `override` (a request's chat_template) or the checkpoint's (the shipped
    Gemma 3 one for the default model); its reasoning markers are `markers` when given (False: none),
    else detected (reasoning.detect)."""
    field, text = "messages", None
    if override is not None:
        if not isinstance(override, str) or not override.strip():
            raise bad("chat_template", "must be a non-empty Jinja template string")
        if len(override) > MAX_TEMPLATE_BYTES or len(override.encode("utf-8", "surrogatepass")) > MAX_TEMPLATE_BYTES:
            raise bad("chat_template", f"is over the limit of {MAX_TEMPLATE_BYTES} bytes")
        text, field = str(override), "chat_template"
    else:
        text = getattr(tokenizer, "chat_template", None)
        if isinstance(text, dict):  # several named templates: the default one, or the tool-use one
            text = text.get("default") or next(iter(text.values()))
    if not text:
        if not model_type.startswith("gemma3"):
            raise bad("messages", "this model has no chat template (and none is shipped for it)")
        text = shipped_gemma3_template()
    found = None if markers is False else ReasoningMarkers.of(markers) or detect(text, tokenizer)
    return Template(text, knows_tools="tools" in text, markers=found, field=field)


def render(tokenizer: Any, template: Template, messages: list[dict[str, Any]], tools: list[Tool],
           fmt: ToolFormat) -> str:
    """The prompt text, generation prompt included. The tools' schemas go into the prompt as well:
    masks alone leave a model guessing what to call."""
    tool_dicts = [_shown(t) for t in tools] or None
    if not template.knows_tools:
        messages = _plain(messages, fmt)
        if tools:
            block = fmt.instructions(tools)
            if messages[0]["role"] == "system":
                messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + block}
            else:
                messages.insert(0, {"role": "system", "content": block})
        tool_dicts = None
    try:
        return str(_apply(tokenizer, template.text, messages, tool_dicts))
    except Exception as exc:
        if messages[0]["role"] != "system":
            raise bad(template.field, f"the chat template refused them: {exc}") from exc
    # Templates without a system role: the system text leads the first user turn.
    sys_text, rest = messages[0]["content"], messages[1:]
    if rest and rest[0]["role"] == "user":
        rest = [{**rest[0], "content": sys_text + "\n\n" + rest[0]["content"]}, *rest[1:]]
    else:
        rest = [{"role": "user", "content": sys_text}, *rest]
    try:
        return str(_apply(tokenizer, template.text, rest, tool_dicts))
    except Exception as exc:
        raise bad(template.field, f"the chat template refused them: {exc}") from exc


def _shown(tool: Tool) -> dict[str, Any]:
    """A tool as the template is given it. An object schema may leave `properties` out (any object is
    its arguments; OpenAI takes {"type": "object"}), and many templates read `parameters.properties`
    (`| tojson` refuses the Undefined): they are shown an empty one, which allows the same objects.
    Only the prompt sees it: the grammar keeps the schema as sent (declared properties would close it)."""
    shown = tool.openai()
    params = tool.parameters
    if isinstance(params, dict) and "properties" not in params:
        shown["function"]["parameters"] = {**params, "properties": {}}
    return shown


def _apply(tokenizer: Any, template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Any:
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                         add_generation_prompt=True)
