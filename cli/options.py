"""Click parameter types shared by several verbs: one rule for every flag of the same kind."""

from __future__ import annotations

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
