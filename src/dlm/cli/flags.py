"""Flags several subcommands share (sampling options, device and precision) and the library defaults flags show."""

from __future__ import annotations

import argparse

DTYPES = ("auto", "float32", "bfloat16", "float16")  # dlm.modeling.device.DTYPES (tested equal), without torch


def library_default(owner, name: str):
    """The default a library function or dataclass gives parameter `name`: a flag shows it, never writes it again."""
    import inspect

    return inspect.signature(owner).parameters[name].default


def option_flags(name: str) -> list[str]:
    """--field-name, then its short names (the papers' symbols and the spellings the docs use: --tau, --u, ...)."""
    from dlm.sampling.options import ALIASES

    return ["--" + k.replace("_", "-") for k in (name, *(a for a, f in ALIASES.items() if f == name))]


def add_sampling_flags(p) -> None:
    """One flag per sampling option, generated from its field: name, help, type, choices; unset = the default."""
    from typing import Literal, get_args, get_origin

    from dlm.sampling.options import OPTIONS

    for family, cls in OPTIONS.items():
        if not cls.model_fields:
            continue
        group = p.add_argument_group(f"{family} sampler (flags other models ignore)")
        for name, field in cls.model_fields.items():
            kind = _value_type(field.annotation)
            default = "" if field.default is None else f" (default: {field.default})"
            text = f"{field.description}{default}".replace("%", "%%")
            if kind is bool:
                group.add_argument(*option_flags(name), dest=name, action=argparse.BooleanOptionalAction,
                                   default=None, help=text)
            elif get_origin(kind) is Literal:
                group.add_argument(*option_flags(name), dest=name, choices=get_args(kind), help=text)
            else:
                group.add_argument(*option_flags(name), dest=name, type=kind, metavar=name.upper(), help=text)


def _value_type(annotation):
    """An option's value type: Optional and Annotated unwrapped, a Literal kept (its values are the choices)."""
    from types import UnionType
    from typing import Annotated, Union, get_args, get_origin

    origin = get_origin(annotation)
    if origin is Annotated:
        return _value_type(get_args(annotation)[0])
    if origin in (Union, UnionType):
        return _value_type(next(t for t in get_args(annotation) if t is not type(None)))
    return annotation


def flag_names() -> dict[str, str]:
    """Each sampling option's shortest flag (--tau, --u, ...): how messages name the options a user gave."""
    from dlm.sampling.options import OWNER

    return {name: option_flags(name)[-1] for name in OWNER}


def sampling_settings(a):
    """The sampling flags given (None = unset) as validated SamplingSettings; errors name the flag."""
    from dlm.sampling.options import OWNER, parse_settings

    return parse_settings({name: getattr(a, name) for name in OWNER}, names=flag_names())


def add_device_flags(p, what: str = "the model is loaded and run") -> None:
    """--device, --dtype and --threads: where and at what precision `what` (resolved by dlm.modeling.device)."""
    g = p.add_argument_group("device and precision")
    g.add_argument("--device", default="auto", help=f"where {what}: auto (default: CUDA if present, then MPS, "
                   "else the CPU), cpu, cuda, cuda:N, mps; a device this machine lacks is an error naming those it has")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help=f"precision {what} at (default auto: bfloat16 on a GPU that supports it, else float32). "
                   "bfloat16 halves weight memory and, on CPUs with bf16 matrix units or on GPUs, speeds up "
                   "multi-token passes (block/masked decoding) more than one-token AR steps; results are measured "
                   "at that precision and record it")
    g.add_argument("--threads", type=int, help="CPU threads for tensor work (default: every core this process may "
                   "use)")


def device_first(a) -> None:
    """Threads set and the device checked before any work: a device this machine lacks is the first thing said."""
    from dlm.modeling.device import resolve_device, set_threads

    set_threads(a.threads)
    resolve_device(a.device)
