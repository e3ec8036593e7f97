"""YAML and JSON readers that refuse a key given twice in one mapping, and input whose
size would hang or exhaust the reader.

PyYAML's SafeLoader and `json.loads` both keep the last of two equal keys, so
`name: x` then `name: y` silently loads as `y` (YAML 1.2 and RFC 8259 say keys
"should"/"must" be unique; the libraries do not check). Specs, workload files and
sample files go through these instead, and a duplicate is one line naming the key and
the line it is repeated on.

Size (issue 32): YAML aliases are kept (a spec may share one table's settings with
`<<: *common`), but the document is counted as it would be after every alias is
expanded, before anything is built: nine levels of ten `*a` in 440 bytes are 10^9
nodes, which any walk of the loaded value (an error message's repr, a deep copy) would
make real. Nesting deeper than `MAX_DEPTH` is refused too (PyYAML's composer and
`json.loads` recurse; 5,000 `[` were a RecursionError traceback), and so is a number
Python will not convert (over 4,300 digits) or any other value the constructor cannot
build. Each refusal is an `InputLimitError`, a `yaml.YAMLError` with one line.
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from yaml.constructor import SafeConstructor

# Nodes of one document after alias expansion. The largest spec the spec limits allow
# (slurm_dlrm/spec.py: 10,000 tables of 7 fields) is about 150,000 nodes.
MAX_NODES = 1_000_000
# Collections nested in one another. A spec nests 3 deep (tables -> table -> value).
MAX_DEPTH = 64
# libyaml's parser and composer (PyYAML's C extension) when present: the pure-Python
# loader takes about 4x as long (a 10,000-table spec: 1.7 s against 0.4 s here).
_CLoader: Any = getattr(yaml, "CSafeLoader", None)


class InputLimitError(yaml.YAMLError):
    """The document passes a size limit (nodes after aliases, nesting) or holds a value
    that cannot be built; the message is one line."""


class DuplicateKeyError(ValueError):
    """A mapping names `key` twice; `line` (1-based) is the repeat, when known."""

    def __init__(self, key: str, line: int | None, first_line: int | None = None) -> None:
        self.key = key
        self.line = line
        self.first_line = first_line
        at = f"line {line}" if line else "a repeat"
        first = f" (first at line {first_line})" if first_line else ""
        super().__init__(f"duplicate key {key!r} at {at}{first}")


class _NoDuplicateKeys(SafeConstructor):
    """SafeConstructor whose mappings refuse duplicate keys (merge keys `<<` excepted)."""

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


class StrictSafeLoader(_NoDuplicateKeys, yaml.SafeLoader):
    """SafeLoader whose mappings refuse duplicate keys."""


_STRICT_C: Any = type("StrictCSafeLoader", (_NoDuplicateKeys, _CLoader), {}) if _CLoader is not None else None


def check_size(text: str, max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH) -> None:
    """Raise InputLimitError if the YAML document in `text` has more than `max_nodes`
    nodes once every alias is expanded, nests deeper than `max_depth`, or has an alias
    inside its own anchor (a cycle). One pass over the parser's events, nothing built;
    the parser itself is iterative (PyYAML's and libyaml's)."""
    expanded = 0
    anchor_sizes: dict[str, int] = {}
    open_collections: list[tuple[int, str | None]] = []  # (count when it opened, its anchor)
    for event in yaml.parse(text, Loader=_CLoader or yaml.SafeLoader):
        line = event.start_mark.line + 1 if event.start_mark is not None else 0
        if isinstance(event, yaml.CollectionStartEvent):
            if len(open_collections) >= max_depth:
                raise InputLimitError(f"nested deeper than {max_depth} levels (line {line})")
            open_collections.append((expanded, event.anchor))
            expanded += 1
        elif isinstance(event, yaml.CollectionEndEvent):
            start, anchor = open_collections.pop()
            if anchor is not None:
                anchor_sizes[anchor] = expanded - start
        elif isinstance(event, yaml.ScalarEvent):
            expanded += 1
            if event.anchor is not None:
                anchor_sizes[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            name = event.anchor or ""
            if any(a == name for _, a in open_collections):
                raise InputLimitError(f"alias *{_short(name)} inside its own anchor (line {line})")
            expanded += anchor_sizes.get(name, 1)  # an unknown alias: the loader says so
        else:
            continue
        if expanded > max_nodes:
            raise InputLimitError(f"more than {max_nodes:,} values once aliases are expanded (at line {line})")


def load_yaml(text: str, max_nodes: int = MAX_NODES) -> Any:
    """`yaml.safe_load`, refusing duplicate keys (DuplicateKeyError) and documents past
    the size limits (InputLimitError, see `check_size`)."""
    check_size(text, max_nodes)
    try:
        return yaml.load(text, Loader=_STRICT_C or StrictSafeLoader)  # noqa: S506 - SafeLoader subclasses
    except DuplicateKeyError:
        raise
    except (ValueError, OverflowError) as exc:
        # int() of a number past 4,300 digits, a timestamp like 2024-13-45: not YAMLError
        raise InputLimitError(f"a value cannot be read: {_short(str(exc))}") from None


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


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
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise InputLimitError(f"nested deeper than {MAX_DEPTH} levels") from None
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
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # an integer past 4,300 digits
        raise InputLimitError(f"a value cannot be read: {_short(str(exc))}") from None
    _check_json_depth(data)
    return data


def _check_json_depth(data: Any, max_depth: int = MAX_DEPTH) -> None:
    """The same nesting limit as YAML's (json.loads itself stops only at Python's
    recursion limit, and what reads the value next may recurse)."""
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth >= max_depth:
                raise InputLimitError(f"nested deeper than {max_depth} levels")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
