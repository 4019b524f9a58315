"""Built-in write patterns, one module per write family (loaded by ``pcppass.registry``)."""
