"""Ten JSON schemas for structured-output tests and benchmarks: nested objects, arrays, enums,
required fields, bounded numbers and patterned strings. Each has at least one free-text string
(maxLength <= 40), one bounded number, one enum and one array, and every array and string is
bounded, so any output the grammar allows fits in 512 tokens of the demo model."""

from __future__ import annotations

from typing import Any


def _text(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def _int(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def _number(minimum: float, maximum: float) -> dict[str, Any]:
    return {"type": "number", "minimum": minimum, "maximum": maximum}


def _array(items: dict[str, Any], max_items: int, min_items: int = 0) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: list[dict[str, Any]] = [
    _object(
        {
            "name": _text(24),
            "age": _int(0, 130),
            "kind": {"enum": ["cat", "dog", "bird"]},
            "tags": _array(_text(8), 3),
        }
    ),
    _object(
        {
            "title": _text(40),
            "rating": _number(0, 5),
            "status": {"type": "string", "enum": ["draft", "published"]},
            "author": _object({"first": _text(12), "last": _text(12)}),
            "scores": _array(_int(0, 100), 4, 1),
        }
    ),
    _object(
        {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "description": _text(30),
            "price": _number(0.5, 999),
            "currency": {"enum": ["EUR", "USD", "JPY"]},
            "sizes": _array({"enum": ["S", "M", "L"]}, 3),
        }
    ),
    _object(
        {
            "city": _text(20),
            "temperature": _int(-40, 50),
            "conditions": {"enum": ["sunny", "rain", "snow", "fog"]},
            "forecast": _array(_object({"day": _text(10), "high": _int(-40, 50)}), 2),
        },
        required=["city", "temperature", "conditions", "forecast"],
    ),
    _object(
        {
            "question": _text(40),
            "answer": {"type": "boolean"},
            "confidence": _number(0, 1),
            "level": {"enum": [1, 2, 3]},
            "sources": _array(_text(16), 2),
        }
    ),
    _object(
        {
            "user": _object(
                {
                    "id": _int(1, 99999),
                    "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
                    "role": {"enum": ["admin", "member", "guest"]},
                }
            ),
            "note": _text(32),
            "permissions": _array({"type": "string", "enum": ["read", "write", "delete"]}, 3, 1),
        }
    ),
    _object(
        {
            "event": _text(24),
            "date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"},
            "attendees": _int(1, 500),
            "kind": {"enum": ["talk", "workshop", "social"]},
            "speakers": _array(_object({"name": _text(16), "minutes": _int(5, 90)}), 2),
        }
    ),
    _object(
        {
            "label": _text(20),
            "point": _object({"x": _number(-10, 10), "y": _number(-10, 10)}),
            "color": {"enum": ["red", "green", "blue"]},
            "history": _array(_int(0, 9), 5),
            "visible": {"type": "boolean"},
        },
        required=["label", "point", "color", "history"],
    ),
    _object(
        {
            "recipe": _text(30),
            "servings": _int(1, 12),
            "difficulty": {"enum": ["easy", "medium", "hard"]},
            "ingredients": _array(_object({"item": _text(14), "grams": _int(1, 1000)}), 3, 1),
            "vegetarian": {"type": "boolean"},
        }
    ),
    _object(
        {
            "ticket": {"type": "string", "pattern": "^T[0-9]{5}$"},
            "summary": _text(40),
            "priority": {"enum": ["low", "high", "urgent"]},
            "estimate": _number(0.25, 40),
            "labels": _array(_text(10), 3),
            "assignee": {"anyOf": [_text(12), {"type": "null"}]},
        }
    ),
]
