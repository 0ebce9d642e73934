"""A griffe extension for the API reference: a name in single backticks is a reference.

Our docstrings follow the Sphinx convention: ``double backticks`` are literal code,
`single backticks` name another object (`WorkerGroup`, `Controller.get_meta`,
`distbatch.transport.recv_pool`). mkdocstrings only links ``[title][identifier]``, so this extension
resolves each single-backticked name from the docstring's scope (the object, its parents,
its module's imports, then the top-level names of distbatch and rpc_server) and rewrites it
as an optional autorefs link: a link where the target is on a page, plain code elsewhere.

A name that should be ours and resolves to nothing is a broken reference, logged as a
warning, which fails the strict build (`scripts/docs`, run by `scripts/test`). "Should be
ours": CamelCase (``WorkerGroup``) or dotted under ``distbatch`` / ``rpc_server``, and not a
builtin. Names imported from other packages (``torch.Tensor``) resolve to those packages
and are left as code. griffe has no such option itself, hence this file.
"""

from __future__ import annotations

import builtins
import re
from typing import Any

import griffe

OURS = ("distbatch", "rpc_server")
# `name` in single backticks, not part of a ``double`` pair; dots and a trailing () allowed.
REFERENCE = re.compile(r"(?<![`\w])`(?P<name>[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*)(?P<call>\(\))?`(?![`\w])")
CAMEL = re.compile(r"^_?[A-Z][a-z0-9]+[A-Za-z0-9]*$")


class BacktickReferences(griffe.Extension):
    """Rewrite `Name` in docstrings into autorefs links; warn on names that resolve to nothing."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name not in OURS:
            return
        for package in OURS:  # the other package too: rpc_server's docstrings name distbatch's objects
            if package not in loader.modules_collection:
                loader.load(package)
        self._top_level = _top_level_names(loader)
        for obj in _walk(pkg):
            if obj.docstring is not None:
                text = obj.docstring.value
                obj.docstring.value = REFERENCE.sub(lambda m, o=obj: self._link(o, m, loader), text)

    def _link(self, scope: griffe.Object, match: re.Match[str], loader: griffe.GriffeLoader) -> str:
        name, call = match.group("name"), match.group("call") or ""
        target = _resolve(scope, name, loader, self._top_level)
        if target is None:
            if _should_be_ours(name):
                where = f"{scope.relative_filepath}:{scope.docstring.lineno if scope.docstring else '?'}"
                griffe.logger.warning(f"{where}: `{name}` in the docstring of {scope.path} names nothing")
            return match.group(0)
        if not target.startswith(OURS):
            return match.group(0)  # another package's object: plain code
        return f'<autoref identifier="{target}" optional><code>{name}{call}</code></autoref>'


def _walk(obj: griffe.Object) -> Any:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


def _top_level_names(loader: griffe.GriffeLoader) -> dict[str, str]:
    """Class and function names defined (not imported) in our modules, when unique, by name."""
    seen: dict[str, set[str]] = {}
    for package in OURS:
        for obj in _walk(loader.modules_collection[package]):
            if obj.is_module:
                for name, member in obj.members.items():
                    if not member.is_alias and (member.is_class or member.is_function):
                        seen.setdefault(name, set()).add(member.path)
    return {name: next(iter(paths)) for name, paths in seen.items() if len(paths) == 1}


def _final_path(obj: Any) -> str | None:
    try:
        return obj.final_target.path if obj.is_alias else obj.path
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return obj.target_path if obj.is_alias else None  # an object of an unloaded package


def _resolve(scope: griffe.Object, name: str, loader: griffe.GriffeLoader, top: dict[str, str]) -> str | None:
    """The path `name` means in `scope`, or None."""
    first, *rest = name.split(".")
    base: str | None = None
    holder: Any = scope
    while holder is not None and base is None:
        if holder.name == first and not rest:
            return _final_path(holder)
        member = holder.members.get(first) if hasattr(holder, "members") else None
        if member is not None:
            base = _final_path(member)
        holder = holder.parent
    if base is None:
        if first in OURS:
            base = first
        elif first in top:
            base = top[first]
        else:
            return None
    path = ".".join([base, *rest])
    if not path.startswith(OURS):
        return path  # resolved into another package: trust the import
    try:
        return _final_path(loader.modules_collection[path])
    except KeyError:
        return None


def _should_be_ours(name: str) -> bool:
    first = name.split(".")[0]
    if hasattr(builtins, first):
        return False
    return first in OURS or bool(CAMEL.match(first))
