"""Command-line overrides generated from a dataclass (argparse only; no tyro on the device machine).

Every field ``name: T = default`` of the dataclass becomes ``--name VALUE``:

* ``bool`` fields: ``--name`` / ``--no-name`` (``argparse.BooleanOptionalAction``);
* ``int`` / ``float`` / ``str``: parsed with that type;
* ``Optional[T]``: ``T``, or ``none`` / ``None`` for None (also ``--name none`` for a sequence);
* ``Literal[...]``: restricted to those choices;
* ``Union[int, str]`` (scalars): the first member that parses the string, ``str`` last;
* ``Tuple[T, ...]`` / ``List[T]``: several values (``--name a b c``; given twice, the values add up);
* ``Tuple[T1, T2]`` (fixed length): exactly that many values, each parsed by its own type.

Any other field type (a dict, a nested dataclass) is a ``TypeError`` naming the field when the
parser is built, never a silent string.

Unknown flags and abbreviations of flags are rejected (argparse exits with status 2).

One convention for every script (:data:`CONVENTION`, shown by ``--help``): dashes and underscores
in a flag's name are the same (``--num-layers`` == ``--num_layers``, ``--no-use-short-conv`` ==
``--no-use_short_conv``); a list flag takes its values separated by spaces, commas or both
(``--d_models 64 128`` == ``--d_models 64,128``); an item ``key=value`` (the sweep's ``--base``) keeps
the commas of its value, and a comma before another ``key=`` starts a new item
(``--base steps=200,batch_size=8`` == ``--base steps=200 batch_size=8``). :class:`ArgumentParser`
applies it (the scripts' parsers are made with it) and :class:`ListAction` reads a list flag so.

:func:`parse_overrides` / :func:`apply_overrides` read the same types from ``field=value`` strings
(the sweep's ``--base``; bools also as ``true``/``false``, sequences comma-separated) and raise
``ValueError`` naming the field. Library code raises ``ValueError``/``TypeError`` naming config
fields as ``Config.field``; :func:`exit_on_error` turns them into an exit message for a script,
with each ``Config.field`` of the script's config written as its flag ``--field``.

Example::

    @dataclasses.dataclass
    class Config:
        lr: float = 3e-3
        mixer: str = "gdn"
        resume: bool = False

    cfg = parse_dataclass(Config, ["--lr", "1e-3", "--resume"])
"""
from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import typing
from typing import Any, Dict, Iterator, Optional, Sequence, Type, TypeVar

__all__ = ["CONVENTION", "ArgumentParser", "ListAction", "add_dataclass_arguments", "apply_overrides", "as_flags", "dataclass_from_args", "exit_on_error", "make_parser",
           "parse_dataclass", "parse_kernel_config", "parse_overrides"]

T = TypeVar("T")
_NONE = ("none", "None", "null")


def _type_hints(cls) -> dict:
    """Field types of ``cls``, resolving string annotations (``from __future__ import annotations``)
    even when the defining module is not in ``sys.modules`` (e.g. a script run with ``runpy``)."""
    try:
        return typing.get_type_hints(cls)
    except NameError:
        ns = dict(vars(builtins))
        ns.update({k: getattr(typing, k) for k in typing.__all__})
        mod = sys.modules.get(getattr(cls, "__module__", ""), None)
        if mod is not None:
            ns.update(vars(mod))
        return {f.name: eval(f.type, ns) if isinstance(f.type, str) else f.type for f in dataclasses.fields(cls)}


def _unwrap_optional(tp):
    """``(inner_type, is_optional)`` for ``Optional[X]`` / ``X | None``."""
    args = typing.get_args(tp)
    if args and type(None) in args and (typing.get_origin(tp) is typing.Union or type(tp).__name__ == "UnionType"):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
        return typing.Union[tuple(rest)], True
    return tp, False


_SCALARS = (bool, int, float, str)
_SEQUENCES = (tuple, list, typing.Sequence, Sequence)


def _is_union(tp) -> bool:
    return typing.get_origin(tp) is typing.Union or type(tp).__name__ == "UnionType"


def _scalar_parser(tp, optional: bool, field: str = "field"):
    """``str -> value`` for a scalar field type (``bool``, ``int``, ``float``, ``str``, a ``Literal``
    of them, a ``Union`` of them); ``ValueError`` (a message without the field) if the string is bad,
    ``TypeError`` naming ``field`` if the type is none of these."""
    def none_or(parse):
        def wrapped(s: str):
            if optional and s in _NONE:
                return None
            return parse(s)
        wrapped.__name__ = parse.__name__
        return wrapped

    if tp is bool:
        def parse_bool(s: str):
            if s.lower() in ("1", "true", "yes", "y", "on"):
                return True
            if s.lower() in ("0", "false", "no", "n", "off"):
                return False
            raise ValueError(f"not a boolean: {s!r}")
        parse_bool.__name__ = "bool"
        return none_or(parse_bool)
    if tp in (int, float, str):
        def parse(s: str):
            try:
                return tp(s)
            except ValueError as e:
                raise ValueError(f"invalid {tp.__name__} value: {s!r}") from e
        parse.__name__ = tp.__name__
        return none_or(parse)
    if typing.get_origin(tp) is typing.Literal:
        choices = list(typing.get_args(tp))
        convs = [_scalar_parser(t, False, field) for t in dict.fromkeys(type(c) for c in choices)]

        def parse_choice(s: str):
            for conv in convs:
                try:
                    v = conv(s)
                except ValueError:
                    continue
                if v in choices:
                    return v
            raise ValueError(f"invalid choice: {s!r} (choose from {', '.join(map(repr, choices))})")
        parse_choice.__name__ = "choice"
        return none_or(parse_choice)
    if _is_union(tp) and all(a in _SCALARS for a in typing.get_args(tp)):
        # the first member (in declared order, str last) that parses the string wins: Union[int, str]
        # reads "3" as 3 and "abc" as "abc"; Union[int, float] reads "3" as 3 and "0.5" as 0.5
        members = sorted(typing.get_args(tp), key=lambda a: a is str)
        convs = [_scalar_parser(a, False, field) for a in members]

        def parse_union(s: str):
            for conv in convs:
                try:
                    return conv(s)
                except ValueError:
                    pass
            raise ValueError(f"{s!r} is none of {', '.join(a.__name__ for a in members)}")
        parse_union.__name__ = "|".join(a.__name__ for a in members)
        return none_or(parse_union)
    raise TypeError(f"{field}: the command line cannot parse a field of type {tp!r} (supported: bool, int, float, "
                    f"str, Literal, a Union of these, Optional, Tuple[T, ...], Tuple[T1, T2, ...], List[T])")


def _sequence_parser(tp, optional: bool, field: str = "field"):
    """``(parse, nargs, fixed)`` for a sequence field type, or None if ``tp`` is not one: ``parse`` takes the
    list of value strings and returns the field's container (a tuple for ``Tuple``, a list otherwise),
    or None for a single ``none`` when the field is Optional; ``nargs`` is the count of a fixed-length
    ``Tuple[T1, T2]`` (not Optional) or ``"+"``; ``fixed`` whether the length is fixed."""
    origin = typing.get_origin(tp)
    if origin not in _SEQUENCES and tp not in (tuple, list, typing.Tuple, typing.List):
        return None
    args = typing.get_args(tp)
    if not args:  # bare list / tuple / List / Tuple, and Tuple[()] (no args on Python >= 3.11)
        raise TypeError(f"{field}: a sequence field needs its element type for the command line (e.g. "
                        f"Tuple[int, ...] or List[str]), got {tp!r}")
    container = tuple if origin is tuple or tp is tuple else list
    if origin is tuple and args and args[-1] is not Ellipsis:  # fixed length: one type per position
        elems = [_scalar_parser(a, False, field) for a in args]
        n = len(elems)
    else:
        elems = [_scalar_parser(args[0] if args else str, False, field)]
        n = None

    def parse(values: Sequence[str]):
        if optional and len(values) == 1 and values[0] in _NONE:
            return None
        if n is not None and len(values) != n:
            raise ValueError(f"expected {n} values, got {len(values)}: {list(values)!r}")
        if n is None and not values:
            raise ValueError("expected at least one value")
        return container((elems[i] if n is not None else elems[0])(s) for i, s in enumerate(values))
    return parse, ("+" if n is None or optional else n), n is not None


def _value_parser(tp, field: str = "field"):
    """``str -> value`` for any field type of :func:`add_dataclass_arguments` (Literal choices checked,
    sequences comma-separated); ``ValueError`` (a message without the field) if bad."""
    tp, optional = _unwrap_optional(tp)
    seq = _sequence_parser(tp, optional, field)
    if seq is not None:
        parse_seq = seq[0]
        return lambda s: parse_seq([x.strip() for x in s.split(",") if x.strip()])
    return _scalar_parser(tp, optional, field)


def _argparse_type(parse):
    """``parse`` with its ValueError as argparse's ``ArgumentTypeError`` (argparse prints the message)."""
    def convert(s: str):
        try:
            return parse(s)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    convert.__name__ = parse.__name__
    return convert


class _SequenceAction(argparse.Action):
    """Parses a sequence flag's values with the field's element types; a variable-length flag given
    twice (``--base a=1 --base b=2``) adds to the values given before (``none`` resets)."""

    def __init__(self, option_strings, dest, parse_values=None, extend=True, **kw):
        super().__init__(option_strings, dest, **kw)
        self.parse_values, self.extend = parse_values, extend

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            value = self.parse_values(split_list(values))
        except ValueError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        before = getattr(namespace, self.dest, None)
        if self.extend and value is not None and isinstance(before, (list, tuple)):
            value = type(value)(list(before) + list(value))
        setattr(namespace, self.dest, value)



#: The command-line convention of every script (``--help`` shows it; module docstring).
CONVENTION = ("Flags: dashes and underscores are the same (--num-layers = --num_layers; booleans: --flag / "
              "--no-flag). Lists: values separated by spaces or commas (--d_models 64 128 = --d_models 64,128); "
              "key=value items keep the commas of their value (--base steps=200 batch_size=8 = "
              "--base steps=200,batch_size=8). none: an optional setting unset.")


def split_list(values: Sequence[str]) -> list:
    """The items of a list flag's values: each value split at its commas (``["64,128", "256"]`` ->
    ``["64", "128", "256"]``; empty items dropped); a ``key=value`` value only at a comma followed by
    another ``key=`` (``"steps=2,shapes=1,2"`` -> ``["steps=2", "shapes=1,2"]``)."""
    out = []
    for v in values:
        parts = re.split(r",(?=\s*[A-Za-z_]\w*=)", v) if "=" in v else v.split(",")
        out.extend(p.strip() for p in parts if p.strip())
    return out


class ListAction(argparse.Action):
    """An ``argparse`` action for a list flag in the convention (:data:`CONVENTION`): values separated
    by spaces or commas, each converted by ``elem_type`` (default ``str``), stored as a list; argparse's
    ``type`` must not be given (it would see ``"64,128"`` whole). ``nargs`` defaults to ``"+"``.

    Example: ``parser.add_argument("--contexts", action=ListAction, elem_type=int, default=[1024])``
    reads ``--contexts 1024 2048`` and ``--contexts 1024,2048`` as ``[1024, 2048]``."""

    def __init__(self, option_strings, dest, elem_type=str, nargs="+", **kw):
        if "type" in kw and kw["type"] is not None:
            raise TypeError(f"ListAction {option_strings}: pass elem_type=, not type= (type sees a value before "
                            f"its commas are split)")
        kw.pop("type", None)
        super().__init__(option_strings, dest, nargs=nargs, **kw)
        self.elem_type = elem_type

    def __call__(self, parser, namespace, values, option_string=None):
        items = split_list([values] if isinstance(values, str) else values)
        try:
            setattr(namespace, self.dest, [self.elem_type(x) for x in items])
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentError(self, f"invalid value in {items!r}: {e}") from None


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with the scripts' convention (:data:`CONVENTION`): no abbreviations;
    a flag written with dashes where the parser knows it with underscores (or the reverse) is read as
    that flag; ``--help`` ends with the convention."""

    def __init__(self, *args, **kw):
        kw.setdefault("allow_abbrev", False)
        epilog = kw.get("epilog")
        kw["epilog"] = f"{epilog}\n\n{CONVENTION}" if epilog else CONVENTION
        super().__init__(*args, **kw)

    def _canonical(self, arg: str) -> str:
        """``arg`` as the parser knows it: ``--num-layers`` -> ``--num_layers`` (or the reverse, and
        ``--no-...`` of a boolean likewise), a value after ``=`` kept; anything else unchanged."""
        if not arg.startswith("--") or arg == "--":
            return arg
        name, eq, value = arg.partition("=")
        known = self._option_string_actions
        if name in known:
            return arg
        body = name[2:]
        cands = [body.replace("-", "_"), body.replace("_", "-")]
        if body.startswith(("no-", "no_")):
            cands += ["no-" + body[3:].replace("-", "_"), "no-" + body[3:].replace("_", "-")]
        for c in cands:
            if "--" + c in known:
                return "--" + c + eq + value
        return arg

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        if "--" in args:
            i = args.index("--")
            args = [self._canonical(a) for a in args[:i]] + args[i:]
        else:
            args = [self._canonical(a) for a in args]
        return super().parse_known_args(args, namespace)

def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: Type, defaults: Any = None) -> None:
    """Add one ``--field`` option per field of dataclass ``cls`` to ``parser``.

    Options default to ``argparse.SUPPRESS``: only the flags actually given appear in the parsed
    namespace, and :func:`dataclass_from_args` fills the rest from ``defaults`` (an instance of
    ``cls``) or the dataclass defaults. Field docs for ``--help`` come from
    ``field.metadata["help"]`` if present, else from the comments beside the field in the source
    (the lines right above it and the end of its line).

    Raises:
      TypeError: a field whose type the command line cannot parse (a dict, a nested dataclass, ...),
        naming ``Cls.field``.
    """
    hints = _type_hints(cls)
    comments = _field_comments(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        name = f"{cls.__name__}.{f.name}"
        tp, optional = _unwrap_optional(hints[f.name])
        default = getattr(defaults, f.name) if defaults is not None else _field_default(f)
        help_ = f.metadata.get("help", comments.get(f.name, ""))
        help_ = f"{help_} (default: {default!r})".strip().replace("%", "%%")  # argparse formats help with %
        flag = "--" + f.name
        kw: dict = dict(dest=f.name, default=argparse.SUPPRESS, help=help_)
        seq = _sequence_parser(tp, optional, name)
        if tp is bool and not optional:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif seq is not None:
            parse_seq, nargs, fixed = seq
            args = [a for a in typing.get_args(tp) if a is not Ellipsis] or [str]
            metavar = getattr(args[0], "__name__", "VALUE").upper() if len(set(args)) == 1 else "VALUE"
            parser.add_argument(flag, nargs=nargs, action=_SequenceAction, parse_values=parse_seq, extend=not fixed,
                                metavar=metavar, **kw)
        else:
            parse = _scalar_parser(tp, optional, name)
            if typing.get_origin(tp) is typing.Literal:
                metavar = "{" + ",".join(map(str, typing.get_args(tp))) + "}"
            else:
                metavar = getattr(tp, "__name__", None) or parse.__name__
                metavar = metavar.upper()
            parser.add_argument(flag, type=_argparse_type(parse), metavar=metavar, **kw)


def _field_comments(cls) -> Dict[str, str]:
    """``{field: text}`` of the comments written beside each field of dataclass ``cls`` in its source:
    the comment lines right above the field (not a ``# -- section --`` heading) and the comment at
    the end of its line (``{}`` when the source cannot be read). Fields are the annotated
    assignments of the class body itself (not of its methods). ``--help`` shows them when a field
    has no ``metadata["help"]``."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
        tree = ast.parse(src)
        toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    except (OSError, TypeError, tokenize.TokenError, IndentationError, SyntaxError):
        return {}
    body = next((n.body for n in tree.body if isinstance(n, ast.ClassDef)), [])
    comments = {t.start[0]: t.string.lstrip("#").strip() for t in toks if t.type == tokenize.COMMENT}
    lines = src.splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    out: Dict[str, str] = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in names):
            continue
        i = node.lineno
        above, j = [], i - 1
        while j >= 1 and lines[j - 1].strip().startswith("#"):
            if not comments.get(j, "").startswith("--"):  # "# -- section --" heads a group of fields
                above.insert(0, comments.get(j, ""))
            j -= 1
        end = getattr(node, "end_lineno", i) or i
        text = " ".join(x for x in above + [comments.get(end, "")] if x)
        if text:
            out[node.target.id] = text
    return out


def _field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def make_parser(cls: Type, *, defaults: Any = None, description: Optional[str] = None,
                prog: Optional[str] = None) -> argparse.ArgumentParser:
    """An :class:`ArgumentParser` (the scripts' convention, :data:`CONVENTION`; no abbreviations) with one
    option per field of dataclass ``cls``."""
    parser = ArgumentParser(prog=prog, description=description or (cls.__doc__ or "").strip().split("\n")[0])
    add_dataclass_arguments(parser, cls, defaults)
    return parser


def dataclass_from_args(cls: Type[T], namespace: argparse.Namespace, defaults: Optional[T] = None) -> T:
    """Build ``cls`` from ``defaults`` (or the dataclass defaults) overridden by the given flags.

    Sequence fields are converted to the field's container type (tuple for ``Tuple[...]``).
    """
    hints = _type_hints(cls)
    overrides = {}
    for name, value in vars(namespace).items():
        tp, _ = _unwrap_optional(hints.get(name, object))
        if isinstance(value, list) and typing.get_origin(tp) is tuple:
            value = tuple(value)
        overrides[name] = value
    if defaults is not None:
        return dataclasses.replace(defaults, **overrides)
    return cls(**overrides)


def parse_dataclass(cls: Type[T], argv: Optional[Sequence[str]] = None, *, defaults: Optional[T] = None,
                    description: Optional[str] = None, prog: Optional[str] = None) -> T:
    """Parse ``argv`` (default ``sys.argv[1:]``) into an instance of dataclass ``cls``.

    Raises:
      SystemExit: unknown flag, bad value or ``--help`` (argparse's behaviour).
    """
    parser = make_parser(cls, defaults=defaults, description=description, prog=prog)
    ns = parser.parse_args(None if argv is None else list(argv))
    return dataclass_from_args(cls, ns, defaults)


def parse_overrides(cls: Type, overrides: Sequence[str]) -> Dict[str, Any]:
    """``{field: value}`` of ``field=value`` strings for dataclass ``cls``, each value parsed by the
    field's type as on the command line (``none`` for an Optional's None; bools ``true``/``false``,
    ``1``/``0``, ``yes``/``no``; Literal choices checked; sequences comma-separated). A later
    override of the same field wins.

    Raises:
      ValueError: an item without ``=``, a name that is not a field of ``cls``, or a bad value; the
        message names the item or ``Cls.field``.
      TypeError: ``overrides`` given as one string (it would be read character by character).
    """
    if isinstance(overrides, (str, bytes)):
        raise TypeError(f"overrides must be a list of 'field=value' strings, got the string {overrides!r} (wrap it "
                        f"in a list)")
    hints = _type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    out: Dict[str, Any] = {}
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ValueError(f"overrides are field=value, got {item!r}")
        name, value = item.split("=", 1)
        if name not in names:
            raise ValueError(f"{name!r} is not a {cls.__name__} field (fields: {', '.join(sorted(names))})")
        try:
            out[name] = _value_parser(hints[name], f"{cls.__name__}.{name}")(value)
        except ValueError as e:
            raise ValueError(f"{cls.__name__}.{name}: {e}") from None
    return out


def apply_overrides(cfg: T, overrides: Sequence[str]) -> T:
    """``cfg`` (a dataclass instance) with the ``field=value`` ``overrides`` applied
    (:func:`parse_overrides`), e.g. ``apply_overrides(RecallConfig(), ["steps=2000", "resume=true"])``."""
    return dataclasses.replace(cfg, **parse_overrides(type(cfg), overrides))


def parse_kernel_config(overrides: Sequence[str], **fields) -> Any:
    """A ``gdn_jax.ops.KernelConfig`` from ``name=value`` strings naming its top-level fields or the
    fields of its groups by their own names (``platform=gpu``, ``mid_dtype=f32``, ``save_wy=false``,
    ``state_slots=3``), each parsed by its field's type as :func:`parse_overrides` does; ``fields``:
    top-level defaults (an override wins). The benchmarks' ``--configs`` command lines.

    Raises:
      ValueError: as :func:`parse_overrides` (an unknown name, a bad value).
    """
    from .ops.pallas.config import FLAT_NAMES, GROUP_CLASSES, KernelConfig

    if isinstance(overrides, (str, bytes)):
        raise TypeError(f"overrides must be a list of 'field=value' strings, got the string {overrides!r}")
    by: Dict[str, list] = {}
    for item in overrides:
        name = item.split("=", 1)[0] if isinstance(item, str) else None
        by.setdefault(FLAT_NAMES.get(name, "top"), []).append(item)
    kw = dict(fields, **parse_overrides(KernelConfig, by.pop("top", [])))
    groups = {g: GROUP_CLASSES[g](**parse_overrides(GROUP_CLASSES[g], items)) for g, items in by.items()}
    if "hopper.variants" in groups:
        hop = groups.get("hopper", GROUP_CLASSES["hopper"]())
        groups["hopper"] = dataclasses.replace(hop, variants=groups.pop("hopper.variants"))
    return KernelConfig(**kw, **groups)


def as_flags(message: str, cls: Type) -> str:
    """``message`` with every ``Cls.field`` of dataclass ``cls`` (its class name, a dot and a field
    name) written as the command-line flag ``--field``; ``Cls.field=True`` / ``Cls.field=False`` (a
    boolean setting) as ``--field`` / ``--no-field``, the flags the parser takes."""
    names = {f.name for f in dataclasses.fields(cls)}

    def flag(m):
        name, value = m.group(1), m.group(2)
        if name not in names:
            return m.group(0)
        if value is None:
            return f"--{name}"
        return f"--{name}" if value == "True" else f"--no-{name}"

    return re.sub(rf"\b{re.escape(cls.__name__)}\.(\w+)(?:=(True|False)\b)?", flag, message)


@contextlib.contextmanager
def exit_on_error(prog: str, cls: Optional[Type] = None) -> Iterator[None]:
    """Turn a ``ValueError``/``TypeError`` raised inside into ``SystemExit("<prog>: error: <message>")``
    (exit status 1), the message's ``Cls.field`` names written as flags (:func:`as_flags`) when
    ``cls`` is the script's config dataclass, and a ``KeyboardInterrupt`` (Ctrl-C) into one line
    ``<prog>: interrupted: <message>`` and exit status 130 (no traceback). For scripts: library code
    raises, the script exits."""
    try:
        yield
    except (ValueError, TypeError) as e:
        msg = str(e) if cls is None else as_flags(str(e), cls)
        raise SystemExit(f"{prog}: error: {msg}") from None
    except KeyboardInterrupt as e:  # Ctrl-C: a line (the library says where it checkpointed), status 130
        print(f"{prog}: interrupted" + (f": {e}" if str(e) else ""), file=sys.stderr, flush=True)
        raise SystemExit(130) from None
