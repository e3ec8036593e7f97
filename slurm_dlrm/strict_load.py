"""YAML and JSON readers that refuse a key given twice in one mapping.

PyYAML's SafeLoader and `json.loads` both keep the last of two equal keys, so
`name: x` then `name: y` silently loads as `y` (YAML 1.2 and RFC 8259 say keys
"should"/"must" be unique; the libraries do not check). Specs, workload files and
sample files go through these instead, and a duplicate is one line naming the key and
the line it is repeated on.
"""

from __future__ import annotations

import json
from typing import Any

import yaml


class DuplicateKeyError(ValueError):
    """A mapping names `key` twice; `line` (1-based) is the repeat, when known."""

    def __init__(self, key: str, line: int | None, first_line: int | None = None) -> None:
        self.key = key
        self.line = line
        self.first_line = first_line
        at = f"line {line}" if line else "a repeat"
        first = f" (first at line {first_line})" if first_line else ""
        super().__init__(f"duplicate key {key!r} at {at}{first}")


class StrictSafeLoader(yaml.SafeLoader):
    """SafeLoader whose mappings refuse duplicate keys (merge keys `<<` excepted)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader refuses it below
                    continue
                line = key_node.start_mark.line + 1
                if first is not None:
                    raise DuplicateKeyError(str(key), line, first)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, refusing duplicate keys (DuplicateKeyError)."""
    return yaml.load(text, Loader=StrictSafeLoader)  # noqa: S506 - a SafeLoader subclass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key, None)
        out[key] = value
    return out


def load_json(text: str, line: int | None = None) -> Any:
    """`json.loads`, refusing duplicate keys. `line`: the text's line in its file (JSON
    lines); otherwise the line is found by reading the text as YAML, which JSON is."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except DuplicateKeyError as exc:
        if line is not None:
            raise DuplicateKeyError(exc.key, line) from None
        try:
            load_yaml(text)
        except DuplicateKeyError as located:
            raise located from None
        except yaml.YAMLError:
            pass
        raise
