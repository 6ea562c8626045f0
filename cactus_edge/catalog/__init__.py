"""The model catalog: the registry, fetching, quantizing."""
