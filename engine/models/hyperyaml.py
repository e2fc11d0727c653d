"""A safe reader for the HyperPyYAML dialect of the official `cosyvoice*.yaml` files.

The official loader (hyperpyyaml) imports and *calls* whatever the tags name
(`!new:cosyvoice.llm.llm.CosyVoice3LM`, `!apply:torch.manual_seed`, ...), so a
downloaded yaml could run arbitrary code. Here the tags only become data:

    !new:pkg.Class {k: v}     -> Node("new", "pkg.Class", {k: v})
    !name:pkg.func {k: v}     -> Node("name", "pkg.func", {k: v})
    !apply:pkg.func [args]    -> Node("apply", "pkg.func", [args])
    !ref <a.b> * <c>          -> the referenced value (simple arithmetic allowed)

Nothing is imported or executed; callers pick the numbers they need.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


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
    """SafeLoader that turns HyperPyYAML tags into inert values."""


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
        raise ValueError(f"unsupported expression in !ref: {expr!r}")

    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"unsupported expression in !ref: {expr!r}") from exc
    return ev(tree)


def _lookup(root: dict[str, Any], path: str) -> Any:
    cur: Any = root
    for part in re.split(r"[.\[\]]+", path.strip()):
        if not part:
            continue
        cur = cur[part] if not isinstance(cur, Node) else cur[part]
    return cur


def _resolve(value: Any, root: dict[str, Any], depth: int = 0) -> Any:
    if depth > 32:
        raise ValueError("!ref nesting too deep (cycle?)")
    if isinstance(value, _Ref):
        refs = _REF.findall(value.expr)
        if len(refs) == 1 and value.expr.strip() == f"<{refs[0]}>":
            return _resolve(_lookup(root, refs[0]), root, depth + 1)
        text = _REF.sub(lambda m: repr(_resolve(_lookup(root, m.group(1)), root, depth + 1)), value.expr)
        return _arith(text)
    if isinstance(value, Node):
        return Node(value.kind, value.target, _resolve(value.value, root, depth))
    if isinstance(value, dict):
        return {k: _resolve(v, root, depth) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, root, depth) for v in value]
    return value


def load_hyper_yaml(path: Path | str) -> dict[str, Any]:
    """Read a HyperPyYAML file into plain data (dicts, lists, scalars, `Node`s)."""
    text = Path(path).read_text(encoding="utf-8")
    raw = yaml.load(text, Loader=_SafeHyperLoader)  # noqa: S506 - the loader is a SafeLoader subclass
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    return _resolve(raw, raw)
