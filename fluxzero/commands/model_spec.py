"""`--model` for every command: a model spec (preset, PRESET:field=value,..., diffusers config.json) as a Click type."""

from __future__ import annotations

import click

from fluxzero.config.models import MODEL_PRESETS, resolve_model


class ModelSpec(click.ParamType):
    """Checks the spec with `resolve_model` and passes the text on unchanged: the commands resolve it where
    they did a preset name (get_model_config and DSOptions.model take any spec)."""

    name = "MODEL"

    def convert(self, value, param, ctx):
        try:
            resolve_model(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return value

    def get_metavar(self, param, ctx=None):  # `--help` shows the presets, as click.Choice did
        return "[" + "|".join(MODEL_PRESETS) + "|PRESET:field=value,...|config.json]"


MODEL_SPEC = ModelSpec()
