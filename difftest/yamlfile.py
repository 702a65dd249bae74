"""Reading the YAML files a user gives difftest (suites, policies, matrices, bug entries, deploy
configurations): strict where PyYAML is lenient.

- A key given twice in one mapping is an error naming both lines. PyYAML keeps the last one
  silently, so a policy with `fail_on:` twice (the second `[]`) would pass a leaking run.
- Size is bounded: a document of more than MAX_NODES (a node counts 1, a scalar 1 more per 100
  characters), counted with its aliases expanded (the "billion laughs"), is refused before it is
  built, as is a file over MAX_BYTES. The message says which: too many nodes as written, or aliases.
- `quote()` shortens a value quoted in an error message, so no message carries a whole file.

Every error is a yaml.YAMLError, so the callers' existing handlers name the file.
"""

from __future__ import annotations

import reprlib
from pathlib import Path

import yaml

MAX_BYTES = 16 << 20  # the largest shipped suite (278 segments) is 55 KB
MAX_NODES = 200_000  # a node, or 100 characters of a scalar; audiobook-278: 4,300, 15 a segment


class TooLarge(yaml.YAMLError):
    def __init__(self, problem: str):
        self.problem, self.problem_mark = problem, None
        super().__init__(problem)


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode):
                    key = (key_node.tag, key_node.value)
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {quote(key_node.value)} (first on line {seen[key] + 1}, "
                            f"again on line {key_node.start_mark.line + 1})", key_node.start_mark)
                    seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _sizes(root) -> tuple[int, int]:
    """(size as written, size with aliases expanded but at most MAX_NODES + 1) of the tree `root`
    (memoised: linear in distinct nodes)."""
    memo, own = {}, {}

    def size(node) -> int:
        got = memo.get(id(node))
        if got is not None:
            return got
        memo[id(node)] = MAX_NODES + 1  # a node inside itself (a recursive alias) counts as too large
        if isinstance(node, yaml.ScalarNode):
            own[id(node)] = total = 1 + len(str(node.value)) // 100
        else:
            own[id(node)] = 1
            kids = node.value if isinstance(node, yaml.SequenceNode) else [x for kv in node.value for x in kv]
            total = 1 + sum(size(c) for c in kids)
        memo[id(node)] = total = min(total, MAX_NODES + 1)
        return total

    expanded = size(root)
    return sum(own.values()), expanded


def loads(text: str):
    """One YAML document, strictly (see the module's text)."""
    if len(text) > MAX_BYTES:
        raise TooLarge(f"{len(text)} characters, more than the {MAX_BYTES} difftest reads")
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        written, expanded = _sizes(node)
        if written > MAX_NODES:
            raise TooLarge(f"{written} nodes (a node counts 1, a scalar 1 more per 100 characters), more than the "
                           f"{MAX_NODES} difftest reads in one file; split it")
        if expanded > MAX_NODES:
            raise TooLarge(f"its aliases expand to more than {MAX_NODES} nodes ({written} as written)")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_file(path: str | Path):
    """A YAML file, strictly. OSError, UnicodeDecodeError and yaml.YAMLError as the caller expects."""
    path = Path(path)
    if path.is_file() and path.stat().st_size > MAX_BYTES:
        raise TooLarge(f"{path.stat().st_size} bytes, more than the {MAX_BYTES} difftest reads")
    return loads(path.read_text(encoding="utf-8"))


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 6, 6, 60, 60


def quote(value, limit: int = 80) -> str:
    """repr(value), bounded: a value from a hostile file can be any size, its quote is not."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
