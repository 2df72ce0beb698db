"""Command-line flags built from a config dataclass, and the dataclass built back from the parsed flags.

The dataclass is the one place a setting is described: its field names give
the flag names (``tokens_per_block`` -> ``--tokens-per-block``), its
annotations the types, the string literal after each field (an attribute
docstring, which Python keeps nowhere at run time, so it is read from the
source with ``ast`` as vLLM's ``get_attr_docs`` does) the help, and a default
instance the caller passes the defaults shown. Every flag defaults to "not
given" (``argparse.SUPPRESS``), and ``DataclassFlags.build`` applies only the
flags the user gave onto that default instance, so an untouched flag keeps
the dataclass's value and the dataclass's own ``__post_init__`` does the
validating.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, Union

T = TypeVar("T")

_METAVARS: dict[type, str] = {int: "INT", float: "FLOAT", str: "STR"}


@dataclass(frozen=True)
class Converter:
    """How a flag reads a field's value from text (the argparse ``type``) and shows its default in the help.

    For a ``tuple[X, ...]`` field it reads one occurrence (one ``X``); otherwise the whole value.
    """

    parse: Callable[[str], Any]
    """Text -> value; a ``ValueError`` becomes argparse's ``argument --flag: <message>`` (exit 2)."""
    show: Callable[[Any], str] = str
    """Value -> text, for ``(default: ...)``."""
    metavar: str = "VALUE"
    """What the usage line shows after the flag."""

    def __call__(self, text: str) -> Any:
        try:
            return self.parse(text)
        except ValueError as e:  # argparse would print only "invalid value"; the converter's message says why
            raise argparse.ArgumentTypeError(str(e)) from None

    @classmethod
    def choice(cls, named: Mapping[str, Any]) -> Converter:
        """One of ``named``'s values, by its name (``float16`` -> ``torch.float16``)."""
        names = {v: k for k, v in named.items()}

        def parse(text: str) -> Any:
            if text not in named:
                raise ValueError(f"invalid choice {text!r} (choose from {', '.join(named)})")
            return named[text]

        return cls(parse, names.__getitem__, "{" + ",".join(named) + "}")

    @classmethod
    def number(cls, kind: Callable[[str], float], ok: Callable[[float], bool], what: str, metavar: str) -> Converter:
        """A number ``kind`` reads that ``ok`` accepts, refused when parsed (before anything runs) naming ``what``."""
        def parse(text: str) -> float:
            try:
                value = kind(text)
            except ValueError:
                raise ValueError(f"expected {what}, got {text!r}") from None
            if not ok(value):
                raise ValueError(f"expected {what}, got {text!r}")
            return value

        return cls(parse, metavar=metavar)


POSITIVE_INT = Converter.number(int, lambda v: v >= 1, "a positive integer", "N")
NONNEG_INT = Converter.number(int, lambda v: v >= 0, "an integer >= 0", "N")
POSITIVE_FLOAT = Converter.number(float, lambda v: 0 < v < float("inf"), "a positive number", "X")
NONNEG_FLOAT = Converter.number(float, lambda v: 0 <= v < float("inf"), "a number >= 0", "X")


# ---------------------------------------------------------------------- byte sizes

_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
          "KB": 10 ** 3, "kB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes from ``64MiB``, ``1GiB``, ``512KiB``, ``1.5GB`` or a plain integer."""
    m = _SIZE.fullmatch(text)
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(f"expected a size such as 64MiB, 1GiB, 512KiB or a number of bytes, got {text!r}")
    number, unit = m.groups()
    size = float(number) * _UNITS[unit]
    if size != int(size):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(size)


def format_size(size: int) -> str:
    """The largest binary unit that states ``size`` exactly (``67108864`` -> ``64MiB``)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if size and size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return str(size)


SIZE = Converter(parse_size, format_size, "SIZE")
"""A byte budget: ``64MiB``, ``1GiB``, ``512KiB`` or bytes."""
SIZES = Converter(lambda text: [parse_size(s) for s in text.split(",")],
                  lambda sizes: ",".join(map(format_size, sizes)), "SIZE[,SIZE...]")
"""A list of byte budgets, comma-separated."""


# ---------------------------------------------------------------------- dataclass -> flags


def attribute_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right after it in the class body), base classes first."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except OSError:  # no source shipped (a zipped or .pyc-only install): flags without help, not a crash
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]  # the class definition
        for stmt, after in itertools.pairwise(body):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _without_none(annotation: Any) -> Any:
    """``X`` for ``X | None`` (the flag parses ``X``; ``None`` is only ever the default)."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _argument_kwargs(name: str, annotation: Any, converter: Converter | None) -> dict[str, Any]:
    """``add_argument``'s type, action, choices and metavar for a field of this annotation."""
    tp = _without_none(annotation)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        element = converter or args[0]
        return {"action": "append", "type": element,
                "metavar": converter.metavar if converter else _METAVARS.get(args[0], "VALUE")}
    if converter is not None:
        return {"type": converter, "metavar": converter.metavar}
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        return {"type": type(args[0]), "choices": args}
    if tp in _METAVARS:
        return {"type": tp, "metavar": _METAVARS[tp]}
    raise TypeError(f"field {name!r} has type {annotation!r}, which has no flag; pass converters={{{name!r}: ...}}")


def _show_default(value: Any, converter: Converter | None) -> str:
    if value is None or value == ():
        return "none"
    show = converter.show if converter is not None else str
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(show, value))
    return show(value)


def _help(doc: str, default: Any, converter: Converter | None, repeatable: bool) -> str:
    """The docstring (``%`` escaped: argparse formats help with it) and the default."""
    text = doc.replace("``", "`") + (" Repeatable." if repeatable else "")
    return f"{text} (default: {_show_default(default, converter)})".lstrip().replace("%", "%%")


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class DataclassFlags(Generic[T]):
    """The flags ``add_dataclass_flags`` added for one dataclass, and how to build it from the parsed arguments."""

    default: T
    """The instance the given flags are applied to."""
    flags: Mapping[str, str]
    """Field name -> its flag (``--tokens-per-block``)."""
    repeatable: frozenset[str]
    """Fields whose flag may be repeated (``tuple[X, ...]``): argparse collects a list, the field holds a tuple."""

    def given(self, args: argparse.Namespace) -> dict[str, Any]:
        """Field name -> value, for the flags the user gave (an absent flag is absent from ``args``)."""
        out: dict[str, Any] = {}
        for name, flag in self.flags.items():
            if hasattr(args, _dest(flag)):
                value = getattr(args, _dest(flag))
                out[name] = tuple(value) if name in self.repeatable else value
        return out

    def apply(self, args: argparse.Namespace, **overrides: Any) -> T:
        """``default`` with the given flags and ``overrides`` (fields no given flag sets) applied.

        The dataclass validates (``dataclasses.replace`` runs ``__post_init__``); a ``ValueError`` or
        ``TypeError`` it raises comes out as a ``ValueError`` prefixed, as argparse's own errors are, with the
        given flags its message names.
        """
        given = self.given(args)
        assert not given.keys() & overrides.keys(), f"overrides {sorted(given.keys() & overrides.keys())} " \
                                                    "would discard flags the user gave"
        try:
            return dataclasses.replace(self.default, **given, **overrides)  # type: ignore[type-var]
        except (ValueError, TypeError) as e:
            named = [self.flags[f] for f in given if re.search(rf"\b{re.escape(f)}\b", str(e))]
            raise ValueError(f"argument {'/'.join(named)}: {e}" if named else str(e)) from None

    def build(self, args: argparse.Namespace, parser: argparse.ArgumentParser, **overrides: Any) -> T:
        """``apply``, its error ending the program through ``parser.error`` (exit 2)."""
        try:
            return self.apply(args, **overrides)
        except ValueError as e:
            parser.error(str(e))


def add_dataclass_flags(parser: argparse.ArgumentParser, default: T, *, title: str, description: str | None = None,
                        prefix: str = "", rename: Mapping[str, str] | None = None, exclude: Collection[str] = (),
                        converters: Mapping[str, Converter] | None = None) -> DataclassFlags[T]:
    """Add one flag per field of ``default``'s dataclass, in an argument group titled ``title``.

    The flag of field ``f`` is ``--<prefix>-<f>`` (underscores as dashes), or ``--<rename[f]>``; ``exclude``
    leaves fields out (nested configs, fields another flag decides). Types come from the annotations: int,
    float, str, bool (``--f/--no-f``), ``Literal[...]`` (choices), ``X | None`` (parses ``X``),
    ``tuple[X, ...]`` (repeatable); ``converters[f]`` reads any other type, or overrides the annotation's.
    """
    rename, converters = rename or {}, converters or {}
    cls = type(default)
    fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    unknown = (set(rename) | set(exclude) | set(converters)) - {f.name for f in fields}
    assert not unknown, f"{sorted(unknown)} are not fields of {cls.__name__}"
    hints, docs = typing.get_type_hints(cls), attribute_docs(cls)
    group = parser.add_argument_group(title, description)
    flags: dict[str, str] = {}
    repeatable: set[str] = set()
    for f in fields:
        if f.name in exclude:
            continue
        name = rename.get(f.name) or (f"{prefix}-{f.name}" if prefix else f.name)
        flag = "--" + name.replace("_", "-")
        kwargs = _argument_kwargs(f.name, hints[f.name], converters.get(f.name))
        repeats = kwargs.get("action") == "append"
        group.add_argument(flag, dest=_dest(flag), default=argparse.SUPPRESS,
                           help=_help(docs.get(f.name, ""), getattr(default, f.name), converters.get(f.name),
                                      repeats), **kwargs)
        flags[f.name] = flag
        if repeats:
            repeatable.add(f.name)
    return DataclassFlags(default, flags, frozenset(repeatable))
