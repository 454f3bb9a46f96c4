"""vLLM's guided-decoding body fields on the OpenAI app, as vLLM clients and `outlines.from_vllm(client)`
send them (in `extra_body`): `structured_outputs` (`{"json": ..., "regex": ..., "choice": [...],
"grammar": ..., "json_object": true}`, vLLM >= 0.12) and older servers' `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`. Each becomes SamplingParams' json_schema, regex, choice or grammar
(at most one); a body that also asks for JSON through response_format, or for tool calls, is refused
with the field named. No routes here (routes.py), and no SamplingParams built (convert.py)."""

from __future__ import annotations

import json
from typing import Any

from asyncpage.errors import InvalidRequestError

FIELD = "structured_outputs"
# structured_outputs' constraint keys -> SamplingParams fields.
KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# Older vLLM servers' body fields -> SamplingParams fields.
LEGACY = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
# structured_outputs' options that change nothing here: the engine never falls back to another backend,
# and its JSON never has free whitespace.
_NO_EFFECT = ("disable_fallback", "disable_any_whitespace")


def structured_fields(body: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """SamplingParams fields from the body's vLLM fields: {param field: (body field it came from,
    value)}; {} when the body has none."""
    out: dict[str, tuple[str, Any]] = {}
    so = body.get(FIELD)
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequestError(FIELD, "must be an object: {json | regex | choice | grammar: ...}")
        for key, value in so.items():
            name = f"{FIELD}.{key}"
            if value is None or key in _NO_EFFECT:
                continue
            if key in KINDS:
                out[KINDS[key]] = (name, value)
            elif key == "json_object":
                if value is not True and value is not False:
                    raise InvalidRequestError(name, f"must be true or false, got {value!r:.40}")
                if value:
                    out["json_schema"] = (name, {"type": "object"})
            elif key == "disable_additional_properties":
                # vLLM's switch for its guidance backend: true closes objects, false keeps JSON Schema's
                # open default (SamplingParams.json_closed_objects; closed unless a body says false).
                if not isinstance(value, bool):
                    raise InvalidRequestError(name, f"must be true or false, got {value!r:.40}")
                out["json_closed_objects"] = (name, value)
            else:  # whitespace_pattern, structural_tag, ...: refused rather than silently ignored
                raise InvalidRequestError(name, f"{name} is not supported by this server")
    for key, field in LEGACY.items():
        if body.get(key) is None:
            continue
        if field in out or any(f in out for f in KINDS.values()):
            raise InvalidRequestError(key, f"at most one of {FIELD}, {', '.join(LEGACY)}")
        out[field] = (key, body[key])
    if body.get("guided_whitespace_pattern") is not None:
        raise InvalidRequestError("guided_whitespace_pattern", "guided_whitespace_pattern is not supported by "
                                  "this server (its JSON has fixed separators and no free whitespace)")
    kinds = [(f, src) for f, (src, _v) in out.items() if f in KINDS.values()]
    if len(kinds) > 1:
        raise InvalidRequestError(kinds[1][1], f"at most one of {', '.join(src for _f, src in kinds)}")
    if kinds:
        _refuse_conflicts(body, kinds[0][1])
    if "json_schema" in out:
        src, schema = out["json_schema"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(src, f"is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError(src, "must be a JSON Schema object")
        out["json_schema"] = (src, schema)
    if "choice" in out:
        src, choices = out["choice"]
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError(src, "must be a non-empty list of non-empty strings")
    for field in ("regex", "grammar"):
        if field in out and not isinstance(out[field][1], str):
            raise InvalidRequestError(out[field][0], "must be a string")
    return out


def _refuse_conflicts(body: dict[str, Any], src: str) -> None:
    """One grammar a turn: a vLLM constraint and response_format's JSON (or tool calls) cannot both hold."""
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") in ("json_schema", "json_object"):
        raise InvalidRequestError(src, f"{src} and response_format ({rf['type']}) each set the output's "
                                       "grammar: send one of them")
    if body.get("tools") and body.get("tool_choice", "auto") != "none":
        raise InvalidRequestError(src, f"{src} cannot be combined with tools (tool calls set the turn's grammar)")
