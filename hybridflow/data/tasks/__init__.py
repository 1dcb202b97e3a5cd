"""Built-in tasks: small datasets generated on the spot, so a run needs no downloads."""
