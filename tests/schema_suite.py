"""JSON schemas of varied features for the constrained-decoding tests: nested objects, enums and consts, arrays with
bounds, anyOf, string formats and patterns, bounded numbers, $defs, additionalProperties false. Every value they
allow is bounded in length, so a random model (which never closes a string or an array by itself) still ends each
output within a short token budget; that the output ends, and validates, is then the grammar's doing alone."""
from __future__ import annotations

import json

NAME = {"type": "string", "maxLength": 6}
SHORT = {"type": "string", "maxLength": 3}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
SMALL = {"type": "integer", "minimum": -9, "maximum": 9}
COLOR = {"type": "string", "enum": ["red", "green", "blue"]}
FLAG = {"type": "boolean"}
FORMATS = ("date", "uuid", "ipv4", "time")


def obj(props: dict, required: list[str] | None = None, closed: bool = True) -> dict:
    out = {"type": "object", "properties": props, "required": list(props) if required is None else required}
    if closed:
        out["additionalProperties"] = False
    return out


def arr(items: dict, lo: int = 0, hi: int = 3) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def _scalars() -> list[dict]:
    out = [NAME, SHORT, AGE, SMALL, COLOR, FLAG, {"type": "null"}, {"const": "fixed"}, {"enum": [1, "two", None]},
           {"type": "string", "pattern": "^[a-z]{2}[0-9]{1,3}$"}, {"type": "string", "minLength": 2, "maxLength": 4},
           {"type": "integer", "enum": [3, 5, 7]}, {"type": "number", "minimum": 0, "maximum": 1,
                                                   "multipleOf": 0.25}]
    out += [{"type": "string", "format": f} for f in FORMATS]
    return out


def _objects() -> list[dict]:
    base = [
        obj({"name": NAME, "age": AGE}),
        obj({"name": NAME, "age": AGE}, required=["name"]),
        obj({"color": COLOR, "ok": FLAG, "n": SMALL}),
        obj({"id": {"type": "string", "format": "uuid"}, "when": {"type": "string", "format": "date"}}),
        obj({"ip": {"type": "string", "format": "ipv4"}, "port": {"type": "integer", "minimum": 1,
                                                                  "maximum": 65535}}),
        obj({"tags": arr(SHORT, 1, 3)}),
        obj({"matrix": arr(arr(SMALL, 1, 2), 1, 2)}),
        obj({"user": obj({"name": NAME, "address": obj({"city": NAME, "zip": {"type": "string",
                                                                          "pattern": "^[0-9]{5}$"}})})}),
        obj({"kind": {"const": "point"}, "x": SMALL, "y": SMALL}),
        obj({"value": {"anyOf": [SMALL, NAME, {"type": "null"}]}}),
        obj({"shape": {"anyOf": [obj({"r": SMALL}), obj({"w": SMALL, "h": SMALL})]}}),
        obj({"items": arr(obj({"sku": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}), 0, 2)}),
        obj({"status": {"enum": ["ok", "error", None]}, "code": {"type": "integer", "enum": [200, 404, 500]}}),
        obj({"pair": {"type": "array", "prefixItems": [NAME, SMALL], "items": False, "minItems": 2}}),
        obj({"a": obj({"b": obj({"c": obj({"d": SMALL})})})}),
        obj({"name": NAME, "nick": {"type": ["string", "null"], "maxLength": 4}}),
        obj({"meta": {"type": "object", "properties": {"k": SHORT}, "required": ["k"],
                      "additionalProperties": False}, "on": FLAG}),
        obj({"list": arr(COLOR, 2, 3), "first": COLOR}),
        obj({"score": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}}),
        obj({"time": {"type": "string", "format": "time"}, "date": {"type": "string", "format": "date"}}),
    ]
    return base


def _defs() -> list[dict]:
    node = {"$defs": {"leaf": obj({"v": SMALL}), "color": COLOR},
            "type": "object", "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"},
                                             "c": {"$ref": "#/$defs/color"}},
            "required": ["left", "right", "c"], "additionalProperties": False}
    listed = {"$defs": {"item": obj({"n": SHORT})}, "type": "array", "items": {"$ref": "#/$defs/item"},
              "minItems": 1, "maxItems": 2}
    return [node, listed]


def schemas() -> list[dict]:
    """At least 100 distinct schemas: the scalars and objects above, objects with every property optional,
    wrapped in arrays, combined pairwise under anyOf, scalars paired in objects. (No open object: a random model
    would name its extra properties with unbounded strings.)"""
    scalars, objects = _scalars(), _objects()
    out = [obj({"v": s}) for s in scalars]  # every scalar as an object's property
    out += objects
    out += [{**o, "required": []} for o in objects[:8]]
    out += [arr(o, 1, 2) for o in objects[:10]]
    out += [{"anyOf": [objects[i], objects[i + 1]]} for i in range(0, 18, 2)]
    out += [obj({"x": s, "y": t}) for s, t in zip(scalars, reversed(scalars), strict=True)]
    out += [obj({"p": s, "q": t}, required=["q"]) for s, t in zip(scalars, scalars[3:] + scalars[:3], strict=True)]
    out += _defs()
    out += [arr(s, 0, 2) for s in scalars[:6]]
    distinct = {json.dumps(s, sort_keys=True): s for s in out}
    return list(distinct.values())
