"""Shipped calibration and evaluation texts (see manifest.json for sources, licences and sha256)."""
