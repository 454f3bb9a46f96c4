"""The types an extraction may ask for, and what the engine needs from each: its JSON Schema, how its value is
decoded and checked, and which top-level field a refusal names.

- a JSON Schema dict: the value is plain JSON;
- a msgspec type (a Struct, or any type msgspec describes): decoded by msgspec, as before;
- a pydantic v2 model, or any type `pydantic.TypeAdapter` takes (`list[Model]`, a pydantic dataclass): its JSON
  Schema from pydantic, the value validated by pydantic and returned as its instance. pydantic is imported only
  when such a type is given (and only when the caller's program imported it already or msgspec cannot describe
  the type): it stays an optional dependency (`pip install 'asyncpage[pydantic]'`).

A refusal by the type's own validation (a constraint, a pydantic `field_validator` or `model_validator`, a
msgspec `__post_init__` raising) is a `Refused`: a msgspec.ValidationError (what callers already catch) that
names the first top-level field it is about (None when the validation names none).
"""

from __future__ import annotations

import re
import sys
from typing import Any

import msgspec

from asyncpage.errors import InvalidRequestError
from asyncpage.guided.schema import closed_objects


class Refused(msgspec.ValidationError):
    """The type's validation refused the value; `field`: the top-level property it names, first in the output
    (None: the whole value, as a `__post_init__` or a model validator refuses it)."""

    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message)
        self.field = field


class PydanticTarget:
    """A pydantic type behind a TypeAdapter: `schema` is its JSON Schema, `decode` validates JSON text."""

    def __init__(self, tp: Any) -> None:
        from pydantic import TypeAdapter

        self.type = tp
        self.adapter: Any = tp if isinstance(tp, TypeAdapter) else TypeAdapter(tp)
        self.schema: dict[str, Any] = self.adapter.json_schema()

    def decode(self, text: str, order: list[str] | None = None) -> Any:
        """The validated value; raises Refused (a validation error, with each error's field path), or
        msgspec.DecodeError when the text is not JSON at all."""
        from pydantic import ValidationError

        try:
            return self.adapter.validate_json(text)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            if errors and all(e.get("type") == "json_invalid" for e in errors):
                raise msgspec.DecodeError(str(exc)) from None
            fields = [e["loc"][0] for e in errors if e.get("loc") and isinstance(e["loc"][0], str)]
            first = min(fields, key=lambda f: (order or []).index(f) if f in (order or []) else len(order or []),
                        default=None)
            whole = any(not e.get("loc") for e in errors)
            paths = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())) or '$'}: {e.get('msg')}" for e in errors)
            raise Refused(paths, None if whole and first is None else first) from None
        except MemoryError:
            raise
        except Exception as exc:  # a validator's own error (pydantic lets all but ValueError through)
            raise _raised(exc) from None

    def __repr__(self) -> str:
        return f"PydanticTarget({self.type!r})"


def _pydantic_type(tp: Any) -> bool:
    """A pydantic model (or a type built of them) — answered without importing pydantic: a program that never
    imported it has none."""
    pyd = sys.modules.get("pydantic")
    if pyd is None:
        return False
    if isinstance(tp, type):
        return issubclass(tp, pyd.BaseModel) or hasattr(tp, "__pydantic_fields__")
    return any(_pydantic_type(a) for a in getattr(tp, "__args__", ()) if a is not tp)


def describe(schema: Any) -> tuple[dict[str, Any], Any]:
    """(the JSON Schema, the decode target): None for a dict schema, a PydanticTarget for a pydantic type, else
    the msgspec type itself."""
    if isinstance(schema, dict):
        return schema, None
    adapter = type(schema).__name__ == "TypeAdapter"  # a pydantic TypeAdapter instance, used as it is
    if callable(schema) and not isinstance(schema, type) and not hasattr(schema, "__origin__") \
            and not hasattr(schema, "__supertype__") and not adapter:
        # a function or another callable object (pydantic's TypeAdapter would take a function as a validator and
        # validate anything through it: a CLI's `module:helper` typo ran a job of nulls)
        raise InvalidRequestError("schema", f"{schema!r} is a callable, not a type or a JSON Schema dict")
    if adapter or _pydantic_type(schema):
        target = PydanticTarget(schema)
        return closed_objects(target.schema), target
    try:
        return closed_objects(msgspec.json.schema(schema)), schema
    except (TypeError, ValueError) as exc:
        try:  # not msgspec's: a type pydantic takes (installed but not imported yet by the caller)?
            import pydantic  # noqa: F401
        except ImportError:
            raise InvalidRequestError("schema", f"not a msgspec type or JSON Schema dict: {exc}") from exc
        try:
            target = PydanticTarget(schema)
        except Exception as pexc:  # pydantic's PydanticSchemaGenerationError, TypeError, ...
            raise InvalidRequestError("schema", f"not a msgspec type, pydantic type or JSON Schema dict: "
                                                f"{exc}; pydantic: {pexc}") from exc
        return closed_objects(target.schema), target


def decode(text: str, target: Any, order: list[str] | None = None) -> Any:
    """`text` (JSON) as `target` (describe()'s); raises Refused when the type's validation refuses it and
    msgspec.DecodeError when it is not JSON. `order`: the value's top-level keys as written (the first
    refused one is named)."""
    if isinstance(target, PydanticTarget):
        return target.decode(text, order)
    try:
        return msgspec.json.decode(text, type=target) if target is not None else msgspec.json.decode(text)
    except msgspec.ValidationError as exc:
        raise Refused(str(exc), _msgspec_field(str(exc), order or [])) from None
    except (msgspec.DecodeError, MemoryError):
        raise
    except Exception as exc:  # a __post_init__ raising other than ValueError / TypeError
        raise _raised(exc) from None


def _raised(exc: Exception) -> Refused:
    """A validator that raised instead of refusing (a RuntimeError, a KeyError) refuses the whole value: the record
    gets the error, the job and every other record go on."""
    return Refused(f"the type's validation raised {type(exc).__name__}: {exc}", None)


def _msgspec_field(message: str, keys: list[str]) -> str | None:
    """The top-level key a msgspec error's path (`- at `$.key...``) names; None without one."""
    m = re.search(r" - at `\$\.(.*)`$", message)
    if m is None:
        return None
    path = m.group(1)
    named = [k for k in keys if path == k or path.startswith((k + ".", k + "["))]
    return max(named, key=len, default=None)


def enc_hook(obj: Any) -> Any:
    """For msgspec's encoders: a pydantic model as its JSON-mode dump (what `asyncpage extract` writes)."""
    dump = getattr(obj, "model_dump", None)
    if callable(dump) and _pydantic_type(type(obj)):
        return dump(mode="json")
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def to_builtins(value: Any) -> Any:
    """JSON builtins of an extracted value (a pydantic instance through its dump)."""
    return msgspec.to_builtins(value, enc_hook=enc_hook)
