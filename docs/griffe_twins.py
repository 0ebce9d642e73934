"""A griffe extension for the API reference: `put = blocking(_put_verb)` is a method.

`distbatch.twins` makes a verb's sync method and its async twin from one function, assigned as
class attributes. griffe reads those statically as attributes with no signature or docstring;
this extension turns each into a method with the verb's parameters and docstring, its return
type unwrapped from `Coroutine[Any, Any, R]`, and the async twin labelled ``async``.
"""

from __future__ import annotations

from typing import Any

import griffe

TWINS = {"blocking": False, "awaiting": True}  # wrapper name -> is the twin async


class Twins(griffe.Extension):
    """Replace twin attributes by methods built from their verb."""

    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        for name, member in list(cls.members.items()):
            twin = _twin_of(member)
            if twin is None:
                continue
            wrapper, verb_name = twin
            verb = cls.members.get(verb_name)
            if not isinstance(verb, griffe.Function):
                continue
            method = griffe.Function(
                name,
                lineno=member.lineno,
                endlineno=member.endlineno,
                parameters=verb.parameters,
                returns=_result_type(verb.returns),
                docstring=None
                if verb.docstring is None
                else griffe.Docstring(verb.docstring.value, lineno=verb.docstring.lineno),
            )
            if TWINS[wrapper]:
                method.labels.add("async")
            method.labels.add("method")
            cls.set_member(name, method)
            if method.docstring is not None:
                method.docstring.parent = method


def _twin_of(member: Any) -> tuple[str, str] | None:
    """(wrapper, verb name) when `member` is `name = blocking(verb)` or `awaiting(verb)`."""
    if not isinstance(member, griffe.Attribute) or not isinstance(member.value, griffe.ExprCall):
        return None
    call = member.value
    wrapper = str(call.function)
    if wrapper not in TWINS or len(call.arguments) != 1 or not isinstance(call.arguments[0], griffe.ExprName):
        return None
    return wrapper, call.arguments[0].name


def _result_type(returns: Any) -> Any:
    """`R` of `Coroutine[Any, Any, R]`; anything else as it is."""
    if isinstance(returns, griffe.ExprSubscript) and str(returns.left).endswith("Coroutine"):
        items = getattr(returns.slice, "elements", None)
        if items:
            return items[-1]
    return returns
