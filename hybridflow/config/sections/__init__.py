"""The schema's sections, one module per area; ``hybridflow.config.schema`` assembles them into ``Config``."""
