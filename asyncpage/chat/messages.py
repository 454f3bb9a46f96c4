"""OpenAI-shaped chat requests: checked, normalized, and rendered into prompt token ids.

Owns the request side of chat(): messages, tools, tool_choice and response_format in OpenAI's
shapes, and the chat template (the checkpoint's own through transformers' apply_chat_template, or
the shipped Gemma 3 turn template for the default model, whose GGUF carries none). It does not
build grammars (grammar.py) nor read output (parse.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from asyncpage.chat.formats import ToolFormat
from asyncpage.errors import InvalidRequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def bad(field: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(field, message)


def parse_tools(tools: Any) -> list[Tool]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("tools", "must be a list of {'type': 'function', 'function': {...}} objects")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise bad(f"tools[{i}]", "must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise bad(f"tools[{i}].function.name", f"must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}")
        if any(o.name == name for o in out):
            raise bad(f"tools[{i}].function.name", f"duplicate tool name {name!r}")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters", "must be a JSON Schema object")
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
        return schema if isinstance(schema, dict) else {}
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
        except ValueError as exc:
            raise bad(f"{field}.function.arguments", f"is not JSON: {exc}") from exc
    cid = str(c.get("id") or "")
    names[cid] = fn["name"]
    return {"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _plain(messages: list[dict[str, Any]], fmt: ToolFormat) -> list[dict[str, Any]]:
    """For templates that know nothing of tools: calls become the format's own text in the
    assistant turn, tool results become user turns, and consecutive turns of one role merge (some
    templates insist that user and assistant alternate)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, text = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            calls = [(c["function"]["name"], json.dumps(c["function"]["arguments"])) for c in m["tool_calls"]]
            text = (text + "\n" if text else "") + fmt.render(calls)
        if role == "tool":
            role, text = "user", f"Result of the tool call {m['name'] or m['tool_call_id']}: {text}"
        if out and out[-1]["role"] == role and role != "system":
            out[-1] = {"role": role, "content": out[-1]["content"] + "\n\n" + text}
        else:
            out.append({"role": role, "content": text})
    return out


@dataclass(frozen=True)
class Template:
    text: str
    knows_tools: bool  # it renders `tools` and tool-call turns itself
    reasoning: bool  # the model writes a <think>...</think> block


def shipped_gemma3_template() -> str:
    return resources.files("asyncpage.chat").joinpath("gemma3.jinja").read_text()


def template_of(tokenizer: Any, model_type: str) -> Template:
    text = getattr(tokenizer, "chat_template", None)
    if isinstance(text, dict):  # several named templates: the default one, or the tool-use one
        text = text.get("default") or next(iter(text.values()))
    if not text:
        if not model_type.startswith("gemma3"):
            raise bad("messages", "this model has no chat template (and none is shipped for it)")
        text = shipped_gemma3_template()
    return Template(text, knows_tools="tools" in text, reasoning="<think>" in text)


def render(tokenizer: Any, template: Template, messages: list[dict[str, Any]], tools: list[Tool],
           fmt: ToolFormat) -> str:
    """The prompt text, generation prompt included. The tools' schemas go into the prompt as well:
    masks alone leave a model guessing what to call."""
    tool_dicts = [t.openai() for t in tools] or None
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
            raise bad("messages", f"the chat template refused them: {exc}") from exc
    # Templates without a system role: the system text leads the first user turn.
    sys_text, rest = messages[0]["content"], messages[1:]
    if rest and rest[0]["role"] == "user":
        rest = [{**rest[0], "content": sys_text + "\n\n" + rest[0]["content"]}, *rest[1:]]
    else:
        rest = [{"role": "user", "content": sys_text}, *rest]
    try:
        return str(_apply(tokenizer, template.text, rest, tool_dicts))
    except Exception as exc:
        raise bad("messages", f"the chat template refused them: {exc}") from exc


def _apply(tokenizer: Any, template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Any:
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                         add_generation_prompt=True)
