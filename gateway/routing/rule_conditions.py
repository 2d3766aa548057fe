"""A rule's ``when`` table -> conditions, each a Python expression over the request's facts ``f``
and one constant ``C`` (the set of wanted values, a bound, a compiled pattern). :mod:`.rules`
writes a whole tree's conditions into one generated function (one decision is a few attribute
reads and set lookups, not a closure per test) and keeps each condition's own small function as
the reference it is tested against. Sans-I/O; problems by path."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Cond", "conditions", "served_model", "CONDITIONS"]

CONDITIONS = ("model", "min_prompt_tokens", "max_prompt_tokens", "min_max_tokens", "max_max_tokens", "stream",
              "headers", "key_id", "key_tier", "user_regex", "user_keywords")


@dataclass(frozen=True, slots=True)
class Cond:
    """``expr`` holds for the request whose facts are ``f``, ``C`` being :attr:`const`."""

    expr: str
    const: Any

    def test(self) -> Callable[[Any], bool]:
        """This condition alone, as a function of the facts (the reference for the generated tree)."""
        fn: Callable[[Any, Any], bool] = eval(f"lambda f, C: bool({self.expr})", {})  # noqa: S307 - our own text
        const = self.const
        return lambda f: fn(f, const)


def served_model(value: Any, at: str, models: Mapping[str, str], p: list[str]) -> str:
    """A name or alias of a served model -> the model's name ("" and a problem otherwise)."""
    if not isinstance(value, str) or value not in models:
        p.append(f"{at}: {value!r} is not a served model (known: {', '.join(sorted(models))})")
        return ""
    return models[value]


def conditions(when: Any, at: str, models: Mapping[str, str], p: list[str]) -> tuple[Cond, ...]:
    if not isinstance(when, Mapping):
        p.append(f"{at}: expected a table of conditions, got {when!r}")
        return ()
    out: list[Cond] = []
    for key, v in when.items():
        where = f"{at}.{key}"
        if key == "model":
            out.append(Cond("f.model() in C", frozenset(served_model(m, where, models, p) for m in _names(v, where, p))))
        elif key in ("min_prompt_tokens", "max_prompt_tokens", "min_max_tokens", "max_max_tokens"):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                p.append(f"{where}: expected a whole number >= 0, got {v!r}")
                continue
            fact = "f.prompt_tokens()" if "prompt" in key else "f.max_tokens()"
            out.append(Cond(f"{fact} {'>=' if key.startswith('min') else '<='} C", v))
        elif key == "stream":
            if not isinstance(v, bool):
                p.append(f"{where}: expected true or false, got {v!r}")
                continue
            out.append(Cond("f.stream() is C", v))
        elif key == "headers":
            out += _headers(v, where, p)
        elif key in ("key_id", "key_tier"):
            out.append(Cond(f"f.key()[{0 if key == 'key_id' else 1}] in C", frozenset(_names(v, where, p))))
        elif key == "user_regex":
            try:
                out.append(Cond("C.search(f.user_text()) is not None", re.compile(v)))
            except (re.error, TypeError) as e:
                p.append(f"{where}: not a regular expression: {e}")
        elif key == "user_keywords":
            words = [w.casefold() for w in _names(v, where, p)]
            if words:
                rx = re.compile(r"\b(?:" + "|".join(re.escape(w) for w in words) + r")\b")
                out.append(Cond("C.search(f.user_text().casefold()) is not None", rx))
        else:
            p.append(f"{where}: unknown condition (known: {', '.join(CONDITIONS)})")
    return tuple(out)


def _names(v: Any, where: str, p: list[str]) -> list[str]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not items or not all(isinstance(x, str) and x for x in items):
        p.append(f"{where}: expected a name or a list of names, got {v!r}")
        return []
    return list(items)


def _headers(v: Any, where: str, p: list[str]) -> list[Cond]:
    if not isinstance(v, Mapping) or not v:
        p.append(f"{where}: expected a table of header name -> value(s), got {v!r}")
        return []
    out = []
    for name, values in v.items():
        wanted = frozenset(x.encode("latin-1") for x in _names(values, f"{where}.{name}", p))
        out.append(Cond(f"f.header({name.lower().encode('latin-1')!r}) in C", wanted))
    return out
