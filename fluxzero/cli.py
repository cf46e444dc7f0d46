"""The `fluxzero` command line: a Click group whose commands live in `fluxzero.commands.*`.

Commands are loaded lazily by name, so `fluxzero gen-config` imports only what gen-config needs.
"""

from __future__ import annotations

import importlib
import logging

import click

# command name -> "module:attribute"; each module keeps torch/deepspeed imports inside command bodies.
COMMANDS: dict[str, str] = {
    "cache": "fluxzero.commands.cache:cache",
    "tiny-encoders": "fluxzero.commands.cache:tiny_encoders",
    "launch": "fluxzero.commands.launch:launch",
    "doctor": "fluxzero.commands.launch:doctor",
    "monitor": "fluxzero.commands.launch:monitor",
    "gen-config": "fluxzero.commands.config:gen_config",
    "check-config": "fluxzero.commands.config:check_config",
    "convert": "fluxzero.commands.model:convert",
    "estimate": "fluxzero.commands.estimate:estimate",
    "train": "fluxzero.commands.train:train",
    "export": "fluxzero.commands.train:export",
    "sample": "fluxzero.commands.sample:sample",
    "encode-prompts": "fluxzero.commands.sample:encode_prompts_cmd",
}


def _accelerator_note(record: logging.LogRecord) -> bool:
    """False for DeepSpeed's "Setting accelerator to CPU" warning, which its import logs on a machine without a
    GPU: noise for a command that uses no accelerator (its other warnings pass)."""
    return not record.getMessage().startswith("Setting accelerator to CPU")


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        if name != "train":  # the trainer runs on the device DeepSpeed picks; the other commands only import it
            logging.getLogger("DeepSpeed").addFilter(_accelerator_note)
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx, formatter):
        """One whole sentence per command (wrapped), not Click's cut-off "..." summaries."""
        rows = [(name, self.get_command(ctx, name).get_short_help_str(limit=300)) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="fluxzero")
def main():
    """fluxzero: fine-tune the FLUX.1 transformer with DeepSpeed ZeRO, on one GPU or many."""


if __name__ == "__main__":
    main()
