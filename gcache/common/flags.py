"""Command-line flags generated from a config dataclass: each flag's name, help, type and
default live once, on its field.

A field that is a flag carries `metadata=flag(...)`:

    @dataclass
    class Settings:
        port: int = field(default=7600, metadata=flag("data port"))
        memory: int = field(default=1 << 30, metadata=flag("memory tier", size=True))

and the CLI adds them with `add_flags(parser, Settings, not_flags=(...))`. Every field is either
a flag or named in `not_flags` (settings a CLI does not expose): add_flags raises otherwise, so
a new field cannot be forgotten by the flag table, nor a flag outlive its field.

By default a flag is `--field-name`, its value lands in `args.field_name`, int and float fields
parse as such, str fields stay text, bool fields are `--x/--no-x` (argparse's
BooleanOptionalAction), and the flag's default is the field's. Metadata changes what differs:
another name or dest, choices, a metavar, an argument group, a flag taking text the CLI parses
later (`text`, e.g. "1.0,0.8,0.5" for a tuple), a switch (`action="store_true"`, e.g.
`--no-prefix-cache` for a field that is on by default) or a unit (`from_field` / `to_field`,
e.g. MiB on the command line for a field in bytes). `config_from_flags` builds the dataclass
back from the parsed flags.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

FLAG_KEY = "gcache.flag"  # the key of a field's metadata this module reads

T = TypeVar("T")


class _FieldDefault:
    def __repr__(self) -> str:
        return "FIELD_DEFAULT"


FIELD_DEFAULT: Any = _FieldDefault()  # a flag's default: the field's (through from_field)


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one dataclass field appears on the command line (see the module doc)."""

    help: str | None = None
    name: str | None = None  # default: "--" + the field name with dashes
    dest: str | None = None  # the argparse.Namespace attribute; default: the field name
    type: Callable[[str], Any] | None = None  # default: from the field's annotation
    choices: Iterable[Any] | None = None
    metavar: str | None = None
    group: str | None = None  # the argument group's title (groups appear in field order)
    action: str | builtins.type[argparse.Action] | None = None  # e.g. "store_true" (default: by the type)
    default: Any = FIELD_DEFAULT  # the flag's default, where it is not the field's
    text: bool = False  # the flag takes text whatever the field's type (parsed by the CLI)
    size: bool = False  # a byte size: "64MiB" (gcache.common.units.parse_size, by the CLI)
    from_field: Callable[[Any], Any] | None = None  # the field's default as the flag's
    to_field: Callable[[Any], Any] | None = None  # the parsed flag as the field's value

    def option(self, field_name: str) -> str:
        return self.name or "--" + field_name.replace("_", "-")

    def dest_of(self, field_name: str) -> str:
        return self.dest or field_name


def flag(help: str | None = None, **options: Any) -> dict[str, Flag]:
    """A field's `metadata=` that makes it a flag; `options` are Flag's fields."""
    return {FLAG_KEY: Flag(help, **options)}


def flag_of(f: dataclasses.Field[Any]) -> Flag | None:
    """The Flag of a dataclass field, None if it is not one."""
    found = f.metadata.get(FLAG_KEY)
    return found if isinstance(found, Flag) else None


def flag_fields(cls: type, not_flags: Iterable[str] = ()) -> list[tuple[dataclasses.Field[Any], Flag]]:
    """(field, Flag) of every flag of `cls`, in field order. TypeError unless every field is
    either a flag or named in `not_flags` (and no name there is a flag or unknown)."""
    skip = set(not_flags)
    fields = dataclasses.fields(cls)
    unknown = skip - {f.name for f in fields}
    if unknown:
        raise TypeError(f"{cls.__name__}: not_flags names no field: {sorted(unknown)}")
    out = []
    for f in fields:
        fl = flag_of(f)
        if fl is None and f.name not in skip:
            raise TypeError(f"{cls.__name__}.{f.name} is neither a flag (metadata=flag(...)) nor listed as not a flag")
        if fl is not None and f.name in skip:
            raise TypeError(f"{cls.__name__}.{f.name} is a flag and also listed as not a flag")
        if fl is not None:
            out.append((f, fl))
    return out


def field_default(f: dataclasses.Field[Any]) -> Any:
    """A field's default value (default_factory called); MISSING where it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _base_type(hint: Any) -> Any:
    """int for `int`, str for `str | None`: the one type a flag's value has."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    not_flags: Iterable[str] = (),
    defaults: bool = True,
    groups: dict[str, argparse._ArgumentGroup] | None = None,
) -> None:
    """Add a flag to `parser` for every flag field of dataclass `cls` (see the module doc).

    defaults=False: every flag defaults to None (the CLI fills what the command line left
    out, e.g. from a config file). `groups`: argument groups by title, shared between calls
    (created here, in the order first used, where missing)."""
    hints = typing.get_type_hints(cls)
    groups = {} if groups is None else groups
    for f, fl in flag_fields(cls, not_flags):
        target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
        if fl.group is not None:
            if fl.group not in groups:
                groups[fl.group] = parser.add_argument_group(fl.group)
            target = groups[fl.group]
        kwargs: dict[str, Any] = {"dest": fl.dest_of(f.name)}
        kind = _base_type(hints[f.name])
        action = fl.action
        if action is None and kind is bool and not fl.text:
            action = argparse.BooleanOptionalAction
        if action is not None:
            kwargs["action"] = action
        elif fl.type is not None:
            kwargs["type"] = fl.type
        elif kind in (int, float) and not (fl.text or fl.size):
            kwargs["type"] = kind
        elif kind is not str and not (fl.text or fl.size):
            raise TypeError(f"{cls.__name__}.{f.name}: say how its flag parses (type=..., or text=True)")
        if fl.choices is not None:
            kwargs["choices"] = fl.choices
        if fl.metavar is not None:
            kwargs["metavar"] = fl.metavar
        if fl.help is not None:
            kwargs["help"] = fl.help
        if not defaults:
            kwargs["default"] = None
        elif fl.default is not FIELD_DEFAULT:
            kwargs["default"] = fl.default
        elif action not in ("store_true", "store_false"):  # those default to their own off
            value = field_default(f)
            kwargs["default"] = fl.from_field(value) if fl.from_field is not None else value
        target.add_argument(fl.option(f.name), **kwargs)


def config_from_flags(cls: type[T], args: argparse.Namespace, not_flags: Iterable[str] = (), **given: Any) -> T:
    """An instance of dataclass `cls` from parsed flags (each through its to_field); `given`
    sets other fields (those not flags keep their defaults)."""
    values: dict[str, Any] = {}
    for f, fl in flag_fields(cls, not_flags):
        value = getattr(args, fl.dest_of(f.name))
        values[f.name] = fl.to_field(value) if fl.to_field is not None else value
    values.update(given)
    return cls(**values)
