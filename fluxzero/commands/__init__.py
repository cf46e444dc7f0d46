"""One module per command family; each defines Click commands and imports heavy libraries only inside
command bodies, so `fluxzero --help` and the pure commands stay instant."""


def refuse_existing(out, overwrite: bool) -> None:
    """The writers' one rule: OUT is replaced only with --overwrite (a UsageError sentence otherwise)."""
    import click

    if out.exists() and not overwrite:
        raise click.UsageError(f"{out} exists; pass --overwrite to replace it or choose another OUT")
