"""Calibration: token windows from real text, layer-by-layer capture and per-linear statistics."""
