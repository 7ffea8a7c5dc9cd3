"""Shipped YAML recipes, addressable by file name without the extension (e.g. ``--recipe gptq-w4g128``)."""
