"""Shipped YAML recipes, addressable by file name without the extension (e.g. ``--recipe w4a16-rtn``)."""
