"""Command-line flags declared by the settings they set.

A settings dataclass (``EngineArgs``, ``KVTransferConfig``, ``RouterConfig``, the engine server's
``ServerSettings``) marks each field a flag sets with :func:`flag`: its help, and where the flag's name,
choices or parser differ from what the field says. The field's name, type and default are the rest:

- ``add_flags`` adds a dataclass's flags to a parser (``--block-size`` for ``block_size``, a bool becomes
  ``--x/--no-x``, ``T | None`` a flag whose default is None);
- ``flag_values`` reads them back as the dataclass's keyword arguments;
- ``forwarded_argv`` writes parsed values out again as a command line (``pdserve serve`` hands its
  children what it was given this way, so a flag added to a config reaches them with no other change).

Choices name their table (``choices=TRANSPORTS``), never a copy of it. This module is the lowest floor's:
it knows dataclasses and argparse, nothing of what the settings mean.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_METADATA_KEY = "pdserve.flag"


def parse_size(text: str) -> int:
    """Bytes from "4GiB", "512MiB", "1.5G" or a plain number of bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4GiB, 512MiB or a number of bytes)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "")[:1].upper()])


def parse_positive_ints(text: str) -> str:
    """Comma-separated positive integers ("1,2,4,8"), checked, as text sorted and without repeats."""
    try:
        numbers = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        numbers = set()
    if not numbers or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"not a list of positive integers: {text!r} (use e.g. 1,2,4,8)")
    return ",".join(str(number) for number in sorted(numbers))


@dataclasses.dataclass(frozen=True)
class Flag:
    help: str
    name: str | None = None  # the flag's name without dashes, when it is not the field's ("kv-transfer")
    choices: Sequence[str] | None = None
    parse: Callable[[str], Any] | None = None  # instead of the field's type (parse_size)
    aliases: tuple[str, ...] = ()  # more spellings ("-tp")
    env: str | None = None  # the default comes from this environment variable when it is set
    metavar: str | None = None


def flag(help: str, **options: Any) -> dict[str, Flag]:
    """A field's metadata making it a flag: ``x: int = field(default=1, metadata=flag("..."))``."""
    return {_METADATA_KEY: Flag(help, **options)}


@dataclasses.dataclass(frozen=True)
class DeclaredFlag:
    """One field's flag, resolved: what argparse and the forwarding need."""

    field: str
    option: str  # "--kv-transfer"
    dest: str  # the namespace attribute: the option's name, so flags of two configs never collide
    spec: Flag
    kind: type  # bool, int, float or str
    default: Any


def declared_flags(cls: type) -> list[DeclaredFlag]:
    """The flags a settings dataclass declares, in field order."""
    hints = typing.get_type_hints(cls)
    found = []
    for item in dataclasses.fields(cls):
        spec = item.metadata.get(_METADATA_KEY)
        if spec is None:
            continue
        name = spec.name or item.name.replace("_", "-")
        if item.default is not dataclasses.MISSING:
            default = item.default
        elif item.default_factory is not dataclasses.MISSING:
            default = item.default_factory()
        else:
            raise TypeError(f"{cls.__name__}.{item.name}: a flag needs a default")
        found.append(
            DeclaredFlag(item.name, "--" + name, name.replace("-", "_"), spec, _scalar(hints[item.name]), default)
        )
    return found


def _scalar(hint: Any) -> type:
    """int from ``int`` or ``int | None``; the flags' types are scalars."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        kinds = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(kinds) == 1:
            hint = kinds[0]
    if hint not in (bool, int, float, str):
        raise TypeError(f"a flag's field must be bool, int, float or str (or one of them | None), not {hint}")
    return typing.cast(type, hint)


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, exclude: Iterable[str] = ()
) -> None:
    """Add ``cls``'s declared flags (but the fields in ``exclude``) to ``parser``."""
    skip = set(exclude)
    for declared in declared_flags(cls):
        if declared.field in skip:
            continue
        spec = declared.spec
        default = declared.default
        if spec.env is not None:
            default = os.environ.get(spec.env) or default
        options: dict[str, Any] = {"dest": declared.dest, "default": default, "help": _help(declared)}
        if declared.kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = spec.parse or declared.kind
            if spec.choices is not None:
                options["choices"] = list(spec.choices)
            if spec.metavar is not None:
                options["metavar"] = spec.metavar
        parser.add_argument(declared.option, *spec.aliases, **options)


def _help(declared: DeclaredFlag) -> str:
    text = declared.spec.help
    if declared.spec.env is not None and "env " not in text:
        text += f" (default: env {declared.spec.env})"
    return text.replace("%", "%%")  # argparse formats help with %


def flag_values(args: argparse.Namespace, cls: type, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """``cls``'s declared flags as parsed into ``args``: keyword arguments for ``cls`` (field -> value)."""
    skip = set(exclude)
    return {d.field: getattr(args, d.dest) for d in declared_flags(cls) if d.field not in skip}


def forwarded_argv(args: argparse.Namespace, classes: Iterable[type], exclude: Iterable[str] = ()) -> list[str]:
    """The command line that sets, in another process, every flag of ``classes`` to its value in ``args``
    (``exclude``: fields set per process, by the caller). Values equal to the default are written too: a
    child's default may not be the parent's (an environment variable)."""
    skip = set(exclude)
    argv: list[str] = []
    for cls in classes:
        for declared in declared_flags(cls):
            if declared.field in skip:
                continue
            value = getattr(args, declared.dest)
            if declared.kind is bool:
                argv.append(declared.option if value else "--no-" + declared.option[2:])
            elif value is not None:
                argv += [declared.option, str(value)]
    return argv
