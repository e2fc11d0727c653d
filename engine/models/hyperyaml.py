"""A safe reader for the HyperPyYAML dialect of the official `cosyvoice*.yaml` files.

The official loader (hyperpyyaml) imports and *calls* whatever the tags name
(`!new:cosyvoice.llm.llm.CosyVoice3LM`, `!apply:torch.manual_seed`, ...), so a
downloaded yaml could run arbitrary code. Here the tags only become data:

    !new:pkg.Class {k: v}     -> Node("new", "pkg.Class", {k: v})
    !name:pkg.func {k: v}     -> Node("name", "pkg.func", {k: v})
    !apply:pkg.func [args]    -> Node("apply", "pkg.func", [args])
    !ref <a.b> * <c>          -> the referenced value (simple arithmetic allowed)

Nothing is imported or executed; callers pick the numbers they need.

Anchors and aliases (`&a` / `*a`) are refused: none of the released yamls uses them, and
nested aliases let a few hundred bytes expand into millions of nodes once resolved. For
the same reason `!ref` copies are capped at MAX_NODES resolved nodes in all. Every
problem with the file is a `HyperYamlError` (a ValueError); the model loader re-raises
it as a ModelDirError naming the file.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


# The released cosyvoice2/3 yamls resolve to about 510 nodes; a real file never
# comes near this, a hostile one stops here.
MAX_NODES = 200_000


class HyperYamlError(ValueError):
    """The yaml cannot be read (syntax, a refused construct, a bad `!ref`)."""


@dataclass(frozen=True)
class Node:
    kind: str  # "new" | "name" | "apply"
    target: str  # dotted name, never imported
    value: Any  # mapping or sequence of arguments

    def get(self, key: str, default: Any = None) -> Any:
        return self.value.get(key, default) if isinstance(self.value, dict) else default

    def __getitem__(self, key: str) -> Any:
        if not isinstance(self.value, dict):
            raise KeyError(key)
        return self.value[key]

    @property
    def class_name(self) -> str:
        return self.target.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class _Ref:
    expr: str


class _SafeHyperLoader(yaml.SafeLoader):
    """SafeLoader that turns HyperPyYAML tags into inert values and refuses anchors and
    aliases (checked on the event stream, before any node is built)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, f"yaml aliases (*{event.anchor}) are not supported in a model yaml", event.start_mark)
        if getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(
                None, None, f"yaml anchors (&{event.anchor}) are not supported in a model yaml", event.start_mark)
        return super().compose_node(parent, index)


def _tagged(kind: str):
    def construct(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Node:
        if isinstance(node, yaml.MappingNode):
            value: Any = loader.construct_mapping(node, deep=True)
        elif isinstance(node, yaml.SequenceNode):
            value = loader.construct_sequence(node, deep=True)
        else:
            scalar = loader.construct_scalar(node)
            value = {} if scalar in ("", None) else scalar
        return Node(kind, suffix, value)

    return construct


def _construct_ref(loader: yaml.SafeLoader, node: yaml.Node) -> _Ref:
    return _Ref(str(loader.construct_scalar(node)))


for _kind in ("new", "name", "apply"):
    _SafeHyperLoader.add_multi_constructor(f"!{_kind}:", _tagged(_kind))
_SafeHyperLoader.add_constructor("!ref", _construct_ref)
# `!copy` and `!tuple` exist in the dialect too; they hold plain data.
_SafeHyperLoader.add_constructor("!tuple", lambda l, n: tuple(l.construct_sequence(n, deep=True)))
_SafeHyperLoader.add_constructor("!copy", _construct_ref)

_REF = re.compile(r"<([^<>]+)>")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.USub: operator.neg,
}


def _arith(expr: str) -> Any:
    """Evaluate +-*/ over numbers only; anything else is an error, never code."""

    def ev(n: ast.AST) -> Any:
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.operand))
        raise HyperYamlError(f"unsupported expression in !ref: {expr!r}")

    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise HyperYamlError(f"unsupported expression in !ref: {expr!r}") from exc
    try:
        return ev(tree)
    except (ArithmeticError, TypeError) as exc:  # <a> / 0, a number times a list, ...
        raise HyperYamlError(f"!ref {expr!r}: {exc}") from exc


def _lookup(root: dict[str, Any], path: str) -> Any:
    cur: Any = root
    for part in re.split(r"[.\[\]]+", path.strip()):
        if not part:
            continue
        if isinstance(cur, Node):
            cur = cur.value
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, (list, tuple)) and part.lstrip("-").isdigit() and -len(cur) <= int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise HyperYamlError(f"!ref <{path.strip()}>: no such key")
    return cur


class _Resolver:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.nodes = 0

    def __call__(self, value: Any, depth: int = 0) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise HyperYamlError(f"more than {MAX_NODES} nodes once !ref values are copied in (a reference bomb?)")
        if depth > 32:
            raise HyperYamlError("!ref nesting too deep (cycle?)")
        if isinstance(value, _Ref):
            refs = _REF.findall(value.expr)
            if len(refs) == 1 and value.expr.strip() == f"<{refs[0]}>":
                return self(_lookup(self.root, refs[0]), depth + 1)
            values = {r: self(_lookup(self.root, r), depth + 1) for r in set(refs)}
            if any(isinstance(v, str) for v in values.values()):
                # HyperPyYAML joins strings (`!ref <dir>/file`); no arithmetic on them.
                return _REF.sub(lambda m: str(values[m.group(1)]), value.expr)
            text = _REF.sub(lambda m: repr(values[m.group(1)]), value.expr)
            return _arith(text)
        if isinstance(value, Node):
            return Node(value.kind, value.target, self(value.value, depth))
        if isinstance(value, dict):
            return {k: self(v, depth) for k, v in value.items()}
        if isinstance(value, list):
            return [self(v, depth) for v in value]
        if isinstance(value, tuple):
            return tuple(self(v, depth) for v in value)
        return value


def _resolve(value: Any, root: dict[str, Any], depth: int = 0) -> Any:
    return _Resolver(root)(value, depth)


def load_hyper_yaml(path: Path | str) -> dict[str, Any]:
    """Read a HyperPyYAML file into plain data (dicts, lists, scalars, `Node`s).

    Raises HyperYamlError (without the path: callers add it) for anything wrong with the
    file's contents; OSError if it cannot be read."""
    text = Path(path).read_text(encoding="utf-8")
    loader = _SafeHyperLoader(text)
    loader.name = str(path)  # yaml's messages then say `in "<path>", line N`, not "<unicode string>"
    try:
        raw = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise HyperYamlError(str(exc)) from exc
    finally:
        loader.dispose()
    if raw is None:
        raise HyperYamlError("the file is empty")
    if not isinstance(raw, dict):
        raise HyperYamlError(f"top level must be a mapping, not {type(raw).__name__}")
    return _resolve(raw, raw)
