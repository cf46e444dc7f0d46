"""One module per command family; each defines Click commands and imports heavy libraries only inside
command bodies, so `fluxzero --help` and the pure commands stay instant."""
