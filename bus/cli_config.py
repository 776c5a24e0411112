"""Typed command-line configs: one frozen dataclass per command, whose fields are its options.

A field declared with :func:`option` carries its flag, help text, environment
variable, choices and range; its Python type (``int | None``, ``Path``,
``Literal["a", "b"]``, ``tuple[str, ...]`` for a repeatable flag,
``tuple[float, float]`` for a pair, ``bool`` for an on/off flag) gives the
click type unless one is passed. From the class:

* :func:`click_options` adds one click option per field to a command, in field
  order; :func:`from_options` builds the frozen object from the parsed values
  (a :class:`ConfigError` becomes a :class:`click.BadParameter` naming the flag);
* :func:`to_argv` renders the fields that differ from their defaults (and
  those an environment variable could set) as the arguments that rebuild the
  object, so a parent starts a child from an object,
  and :func:`from_argv` parses such arguments back (the round trip
  ``from_argv(C, to_argv(c)) == c`` holds for every config);
* :func:`nested` composes: a config's fields may hold other configs (the NATS
  connection every component shares), whose options join the same command;
  :func:`nested` with ``declared_by`` takes a group of options that another
  module declares as a click decorator, rendering them by that decorator's own
  flag names and defaults;
* :func:`option_like` declares a field with another config's flag, type and
  range (another default or help), so a flag's name is written once.

A config subclasses :class:`CliConfig`: its ``__post_init__`` checks every
field's range and choices and then calls :meth:`CliConfig.validate`, where a
config checks what spans fields (raising :class:`ConfigError`). Environment
variables are read by click at the entry point, never by a config.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import click

__all__ = [
    "AliasedOption",
    "CliConfig",
    "ConfigError",
    "OptionSpec",
    "click_options",
    "command_for",
    "flag_of",
    "from_argv",
    "from_options",
    "nested",
    "option",
    "option_like",
    "to_argv",
]

_F = TypeVar("_F", bound=Callable[..., Any])
_C = TypeVar("_C", bound="CliConfig")
_META = "shoal.cli"


class ConfigError(ValueError):
    """A config's value is invalid; ``field`` is the field's name (or a flag) it is about."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class AliasedOption(click.Option):
    """An option whose help shows its first name only; the others are hidden aliases."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        record = super().get_help_record(ctx)
        if record is None:
            return None
        names, help_text = record
        shown = self.opts[0]
        metavar = names.rsplit(" ", 1)[-1] if " " in names else ""
        return (f"{shown} {metavar}".strip(), help_text)


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """What :func:`option` records about one field: enough to declare, check and render it."""

    flags: tuple[str, ...]
    help: str | None = None
    envvar: str | None = None
    type: Any = None
    min: float | None = None
    max: float | None = None
    min_open: bool = False
    metavar: str | None = None
    show_default: bool | str | None = None
    secondary: str | None = None
    secret: bool = False
    hidden_aliases: bool = False
    #: left out of ``--help`` (fault injection for tests)
    hidden: bool = False

    @property
    def flag(self) -> str:
        return self.flags[0]


@dataclasses.dataclass(frozen=True)
class _Nested:
    cls: type[Any]
    declared_by: Callable[[Any], Any] | None = None


def option(
    *flags: str,
    default: Any = dataclasses.MISSING,
    default_factory: Callable[[], Any] | None = None,
    help: str | None = None,
    envvar: str | None = None,
    type: Any = None,
    min: float | None = None,
    max: float | None = None,
    min_open: bool = False,
    metavar: str | None = None,
    show_default: bool | str | None = None,
    secondary: str | None = None,
    secret: bool = False,
    hidden_aliases: bool = False,
    hidden: bool = False,
) -> Any:
    """A config field that is the option ``flags[0]`` (the others: aliases, hidden from help if asked).

    ``min``/``max`` (``min_open``: min excluded) bound a number, on the command line and in code;
    ``secondary`` is the off switch of an on/off flag (``--no-x``); a ``secret`` (a password) is never
    shown as a default nor rendered by :func:`to_argv` (it travels in the environment).
    ``show_default`` None: shown unless the default is empty (None, False, "", ()) or secret;
    a ``hidden`` option works but is left out of ``--help``.
    """
    if not flags or not all(f.startswith("-") for f in flags):
        raise TypeError(f"option flags must start with '-': {flags!r}")
    spec = OptionSpec(flags=flags, help=help, envvar=envvar, type=type, min=min, max=max, min_open=min_open,
                      metavar=metavar, show_default=show_default, secondary=secondary, secret=secret,
                      hidden_aliases=hidden_aliases, hidden=hidden)
    metadata = {_META: spec}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    if isinstance(default, (list, dict, set)):
        raise TypeError("a mutable default: use a tuple or default_factory")
    return dataclasses.field(default=default, metadata=metadata)


def option_like(cls: type[Any], name: str, **overrides: Any) -> Any:
    """A field declared as ``cls``'s field ``name`` (same flag, type, range), with ``overrides``
    (``default``, ``help``, ...) — a command that passes an option on to another uses its flag."""
    spec = _spec(_field(cls, name))
    defaults = {f.name: getattr(spec, f.name) for f in dataclasses.fields(OptionSpec)}
    field = _field(cls, name)
    if field.default is not dataclasses.MISSING:
        defaults["default"] = field.default
    elif field.default_factory is not dataclasses.MISSING:
        defaults["default_factory"] = field.default_factory
    defaults.update(overrides)
    flags = defaults.pop("flags")
    if "default" in overrides:
        defaults.pop("default_factory", None)
    return option(*flags, **defaults)


def nested(cls: type[Any], *, declared_by: Callable[[Any], Any] | None = None) -> Any:
    """A field holding another config (default: that config's defaults) whose options join this command.

    ``declared_by``: a click decorator (from another module) that declares the options of ``cls``'s
    fields (matched by parameter name); :func:`to_argv` then renders them with that decorator's flags
    and compares them with its defaults.
    """
    return dataclasses.field(default_factory=cls, metadata={_META: _Nested(cls, declared_by)})


@dataclasses.dataclass(frozen=True)
class CliConfig:
    """Base of a command's config: range and choice checks on construction, then :meth:`validate`."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            spec = field.metadata.get(_META)
            if isinstance(spec, OptionSpec):
                _check(field.name, spec, _hints(type(self))[field.name], getattr(self, field.name))
        self.validate()

    def validate(self) -> None:
        """Checks across fields; raise :class:`ConfigError` naming the field at fault."""


# ---------------------------------------------------------------------------------------------- reading


_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    """``cls``'s field types, resolved (cached: every construction checks its fields)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _field(cls: type[Any], name: str) -> dataclasses.Field[Any]:
    for field in dataclasses.fields(cls):
        if field.name == name:
            return field
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def _spec(field: dataclasses.Field[Any]) -> OptionSpec:
    spec = field.metadata.get(_META)
    if not isinstance(spec, OptionSpec):
        raise KeyError(f"{field.name!r} is not an option")
    return spec


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _strip_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _leaves(cls: type[Any]) -> Iterator[tuple[dataclasses.Field[Any], OptionSpec, type[Any]]]:
    """Every option field of ``cls`` and of the configs nested in it (not those ``declared_by``)."""
    for field in dataclasses.fields(cls):
        meta = field.metadata.get(_META)
        if isinstance(meta, OptionSpec):
            yield field, meta, cls
        elif isinstance(meta, _Nested) and meta.declared_by is None:
            yield from _leaves(meta.cls)


def flag_of(cls: type[Any], name: str) -> str:
    """The flag of the field ``name`` of ``cls`` or of a config nested in it (``name`` if none is)."""
    if name.startswith("-"):
        return name
    for field, spec, _owner in _leaves(cls):
        if field.name == name:
            return spec.flag
    for field in dataclasses.fields(cls):
        meta = field.metadata.get(_META)
        if isinstance(meta, _Nested) and meta.declared_by is not None:
            params = _declared_params(meta.declared_by)
            if name in params:
                return params[name].opts[0]
    return name


# ---------------------------------------------------------------------------------------------- checks


def _is_repeated(base: Any) -> bool:
    return typing.get_origin(base) is tuple and typing.get_args(base)[-1:] == (Ellipsis,)


def _check(name: str, spec: OptionSpec, hint: Any, value: Any) -> None:
    if value is None:
        return
    base = _strip_none(hint)
    items: tuple[Any, ...] = (value,)
    if _is_repeated(base):
        base, items = typing.get_args(base)[0], tuple(value)
    elif typing.get_origin(base) is tuple:
        return
    choices: tuple[Any, ...] | None = None
    if typing.get_origin(base) is Literal:
        choices = typing.get_args(base)
    elif isinstance(spec.type, click.Choice):
        choices = tuple(spec.type.choices)
    for item in items:
        if choices is not None and item not in choices:
            raise ConfigError(name, f"{item!r} is not one of {', '.join(map(str, choices))}")
        if spec.min is not None and (item < spec.min or (spec.min_open and item == spec.min)):
            bound = "above" if spec.min_open else "at least"
            raise ConfigError(name, f"{item} is not {bound} {spec.min:g}")
        if spec.max is not None and item > spec.max:
            raise ConfigError(name, f"{item} is above the maximum {spec.max:g}")


# ---------------------------------------------------------------------------------------------- click


def _click_type(spec: OptionSpec, base: Any) -> tuple[Any, dict[str, Any]]:
    """(click type, extra click.Option arguments) for a field of type ``base`` (None stripped)."""
    extra: dict[str, Any] = {}
    if _is_repeated(base):
        extra["multiple"] = True
        base = typing.get_args(base)[0]
    elif typing.get_origin(base) is tuple:
        return typing.get_args(base), extra
    if spec.type is not None:
        return spec.type, extra
    if typing.get_origin(base) is Literal:
        return click.Choice([str(a) for a in typing.get_args(base)]), extra
    if base is bool:
        return None, extra
    if base is Path:
        return click.Path(dir_okay=False, path_type=Path), extra
    if base in (int, float) and (spec.min is not None or spec.max is not None):
        if base is int:
            low = None if spec.min is None else int(spec.min)
            high = None if spec.max is None else int(spec.max)
            return click.IntRange(min=low, max=high, min_open=spec.min_open), extra
        return click.FloatRange(min=spec.min, max=spec.max, min_open=spec.min_open), extra
    if base in (int, float, str):
        return base, extra
    raise TypeError(f"no click type for {base!r}: pass type=")


def _add_option(function: _F, field: dataclasses.Field[Any], spec: OptionSpec, owner: type[Any]) -> _F:
    base = _strip_none(_hints(owner)[field.name])
    default = _default(field)
    if default is dataclasses.MISSING:
        raise TypeError(f"{owner.__name__}.{field.name}: an option needs a default")
    kind, extra = _click_type(spec, base)
    show_default = spec.show_default
    if show_default is None:
        empty = default is None or default is False or (isinstance(default, (str, tuple)) and not default)
        show_default = not spec.secret and not empty
    attrs: dict[str, Any] = {"default": default, "help": spec.help, "show_default": show_default, **extra}
    if spec.hidden:
        attrs["hidden"] = True
    if spec.envvar is not None:
        attrs.update(envvar=spec.envvar, show_envvar=True)
    if spec.metavar is not None:
        attrs["metavar"] = spec.metavar
    if base is bool:
        switch = f"{spec.flag}/{spec.secondary}" if spec.secondary else spec.flag
        decls = [switch, *spec.flags[1:], field.name]
        if not spec.secondary:
            attrs["is_flag"] = True
    else:
        decls = [*spec.flags, field.name]
        attrs["type"] = kind
    option_class = AliasedOption if spec.hidden_aliases else click.Option
    return click.option(*decls, cls=option_class, **attrs)(function)


def click_options(cls: type[Any]) -> Callable[[_F], _F]:
    """A decorator adding the options of ``cls`` (and of the configs nested in it) to a click command."""

    def decorate(function: _F) -> _F:
        for field in reversed(dataclasses.fields(cls)):
            meta = field.metadata.get(_META)
            if isinstance(meta, OptionSpec):
                function = _add_option(function, field, meta, cls)
            elif isinstance(meta, _Nested):
                function = (meta.declared_by or click_options(meta.cls))(function)
        return function

    names = [field.name for field, _spec, _owner in _leaves(cls)]
    if len(names) != len(set(names)):
        raise TypeError(f"{cls.__name__}: two options of one name in {sorted(names)}")
    return decorate


@functools.cache
def _declared_params(decorator: Callable[[Any], Any]) -> dict[str, click.Parameter]:
    command = click.command()(decorator(lambda **_: None))
    return {p.name: p for p in command.params if p.name is not None}


def from_options(cls: type[_C], options: Mapping[str, Any]) -> _C:
    """The ``cls`` the parsed ``options`` describe (other keys are ignored); a bad value: BadParameter."""
    try:
        return _build(cls, options)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=flag_of(cls, exc.field)) from None


def _build(cls: type[_C], options: Mapping[str, Any]) -> _C:
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        meta = field.metadata.get(_META)
        if isinstance(meta, OptionSpec):
            value = options[field.name]
            if isinstance(value, list):
                value = tuple(value)
            values[field.name] = value
        elif isinstance(meta, _Nested) and meta.declared_by is not None:
            values[field.name] = meta.cls(**{f.name: options[f.name] for f in dataclasses.fields(meta.cls)})
        elif isinstance(meta, _Nested):
            values[field.name] = _build(meta.cls, options)
    return cls(**values)


def command_for(cls: type[Any]) -> click.Command:
    """A click command with ``cls``'s options that only builds the config (checks a child's arguments)."""

    def build(**options: Any) -> None:
        from_options(cls, options)

    return click.command(cls.__name__)(click_options(cls)(build))


def from_argv(cls: type[_C], argv: Sequence[str]) -> _C:
    """The ``cls`` that command-line arguments ``argv`` describe (``SHOAL_*`` variables count as usual)."""
    command = command_for(cls)
    with command.make_context(cls.__name__, list(argv)) as ctx:
        return from_options(cls, ctx.params)


# ---------------------------------------------------------------------------------------------- rendering


def _render(flag: str, value: Any) -> list[str]:
    """``flag`` and its value(s) as text (``str`` of a float parses back to the same float)."""
    if isinstance(value, tuple):
        return [flag, *(str(v) for v in value)]
    return [flag, str(value)]


def to_argv(config: Any) -> list[str]:
    """The arguments that rebuild ``config``: its fields that differ from their defaults, in field order,
    and those a variable could set (so the child's environment cannot change what the parent decided).

    A secret that is set is a ValueError (it goes to a child through the environment); so is a value
    the command line cannot say (None where the default is not).
    """
    argv: list[str] = []
    for field in dataclasses.fields(config):
        meta = field.metadata.get(_META)
        value = getattr(config, field.name)
        if isinstance(meta, _Nested):
            argv += _declared_argv(meta.declared_by, value) if meta.declared_by else to_argv(value)
            continue
        if not isinstance(meta, OptionSpec):
            continue
        if value == _default(field) and (meta.envvar is None or meta.secret or value in (None, ())):
            continue  # a default the child would take too (unless its environment says otherwise)
        if meta.secret:
            raise ValueError(f"{meta.flag} is a secret: pass it to a child through its environment variable")
        if value is None:
            raise ValueError(f"{meta.flag}: the command line cannot say None (the default is not None)")
        base = _strip_none(_hints(type(config))[field.name])
        if base is bool:
            if value:
                argv.append(meta.flag)
            elif meta.secondary:
                argv.append(meta.secondary)
            else:
                raise ValueError(f"{meta.flag} is on by default and has no off switch")
        elif _is_repeated(base):
            for item in value:
                argv += [meta.flag, str(item)]
        else:
            argv += _render(meta.flag, value)
    return argv


def _declared_argv(decorator: Callable[[Any], Any], config: Any) -> list[str]:
    params = _declared_params(decorator)
    argv: list[str] = []
    for field in dataclasses.fields(config):
        param = params[field.name]
        value = getattr(config, field.name)
        if value != param.default and value is not None:
            argv += _render(param.opts[0], value)
    return argv
