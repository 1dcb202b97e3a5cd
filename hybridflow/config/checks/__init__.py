"""The checks ``validate_config`` runs, one module per concern; each takes the config and a ``Report``."""
