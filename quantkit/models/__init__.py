"""Architecture knowledge (as data) and model loading."""

from quantkit.models.arch import ArchSpec, SmoothGroup, arch_for, supported_architectures

__all__ = ["ArchSpec", "SmoothGroup", "arch_for", "supported_architectures"]
