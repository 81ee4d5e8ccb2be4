"""Click parameter types and options shared by several verbs: one rule for every flag of the same kind, and the
decoding flags made from the one options table."""

from __future__ import annotations

import functools

import click

from seq2trt.reference_model.decoding import option_problem


class Seed(click.ParamType):
    """A --seed: an integer torch and numpy can take (DecodeSettings' rule: [0, 2**64)); refused by click as one
    line before the verb runs, the same for every verb (a larger one overflowed deep in torch)."""

    name = "integer"

    def convert(self, value, param, ctx):
        try:
            seed = value if isinstance(value, int) else int(str(value).strip())
        except ValueError:
            self.fail(f"{value!r} is not an integer", param, ctx)
        problem = option_problem("seed", seed)
        if problem is not None:
            self.fail(f"must be {problem}, got {seed}", param, ctx)
        return seed


SEED = Seed()


def renamed_flag(old: str, new: str, param: str, kind: type = int):
    """A decorator: `old`, the deprecated spelling of the flag `new` (whose value the command takes as `param`),
    still accepted as a hidden option; using it writes a warning naming `new` to stderr, and giving both is refused."""
    hidden = "deprecated_" + old.lstrip("-").replace("-", "_")

    def decorate(command):
        @functools.wraps(command)
        def run(**kwargs):
            value = kwargs.pop(hidden)
            if value is not None:
                click.echo(f"warning: {old} is deprecated; use {new}", err=True)
                ctx = click.get_current_context()
                if ctx.get_parameter_source(param) == click.core.ParameterSource.COMMANDLINE:
                    raise click.UsageError(f"{old} is the deprecated spelling of {new}; give {new} alone")
                kwargs[param] = value
            return command(**kwargs)

        return click.option(old, hidden, type=SEED if kind is Seed else kind, default=None, hidden=True,
                            help=f"Deprecated: {new}.")(run)

    return decorate


def decode_options(verb: str):
    """A decorator: the click options of `verb`'s decoding flags, made from the one options table
    (reference_model.decoding.options.DECODE_OPTIONS, in its order), each passed to the command as its field
    (an on-only switch left off as None: the model's own), and each deprecated spelling as a `renamed_flag`."""
    from seq2trt.reference_model.decoding.options import DECODE_OPTIONS

    rows = [o for o in DECODE_OPTIONS if verb in o.verbs]

    def decorate(command):
        @functools.wraps(command)
        def run(**kwargs):
            for o in rows:
                if o.kind is bool and not o.negatable:
                    kwargs[o.field] = kwargs[o.field] or None
            return command(**kwargs)

        for o in reversed(rows):
            for old in o.old_flags:
                run = renamed_flag(old, o.flag, o.field, Seed if o.field == "seed" else o.kind)(run)
            run = click.option(*_declarations(o), o.field, **_attributes(o))(run)
        return run

    return decorate


def _declarations(o) -> tuple[str, ...]:
    return (f"{o.flag}/--no-{o.flag[2:]}",) if o.negatable else (o.flag,)


def _attributes(o) -> dict:
    if o.kind is bool:
        return dict(default=None, help=o.help) if o.negatable else dict(is_flag=True, help=o.help)
    kind = SEED if o.field == "seed" else o.kind
    return dict(type=kind, default=o.default, help=o.help, show_default=o.default is not None)
