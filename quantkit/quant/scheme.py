"""The quantization scheme of one linear layer: how its weight (and, for W8A8, its input) is stored."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from quantkit.checks import shown
from quantkit.errors import QuantkitError

WEIGHT_BITS = (2, 3, 4, 8)
FORMATS = ("int", "fp8")
BLOCK_SIZES = (16, 32, 64, 128, 256, 512)
DEFAULT_BLOCK = 128
_KIND_WORDS = {int: "an integer", bool: "true or false", str: "a string"}


@dataclass(frozen=True)
class QuantScheme:
    """Weight bits, grouping and symmetry, plus optional activation quantization.

    - ``bits``: 2, 3, 4 or 8 for integer weights (``fmt="int"``); fp8 weights are e4m3 (``bits=8``).
    - ``group_size``: input channels sharing one scale/zero; ``-1`` means one group per output channel.
      When it does not divide the input size the last group is shorter (ragged).
    - ``sym``: symmetric (zero point fixed at ``2**(bits-1)``) or asymmetric (integer zero point per group).
    - ``act_bits``: ``None`` for weight-only (W*A16); ``8`` for W8A8.
    - ``act_dynamic``: per-token scales computed at run time (``True``) or one calibrated per-tensor scale.
    - ``block_size``: ``None``, or B for block-wise fp8 W8A8 (DeepSeek-V3's scheme, ``w8a8-fp8-block``): one fp32
      scale per B x B weight block and per 1 x B activation tile (computed at run time); B a power of two, 16-512
      (the GEMM's K tile). Needs ``fmt="fp8"``, ``act_bits=8``, dynamic activations and ``group_size=-1``.
    """

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    fmt: str = "int"
    act_bits: int | None = None
    act_dynamic: bool = True
    block_size: int | None = None

    def __post_init__(self) -> None:
        for name, kind in (("bits", int), ("group_size", int), ("sym", bool), ("act_bits", int),
                           ("act_dynamic", bool), ("fmt", str)):  # fmt: skip
            value = getattr(self, name)
            if value is None and name == "act_bits":
                continue
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise QuantkitError(f"scheme {name} must be {_KIND_WORDS[kind]}, got {value!r}")
        if self.fmt not in FORMATS:
            raise QuantkitError(f"scheme format must be one of {FORMATS}, got {self.fmt!r}")
        if self.bits not in WEIGHT_BITS:
            raise QuantkitError(f"bits must be one of {', '.join(map(str, WEIGHT_BITS))}, got {self.bits}")
        if self.fmt == "fp8" and (self.bits != 8 or not self.sym):
            raise QuantkitError("fp8 weights are 8-bit and symmetric")
        if self.group_size == 0 or self.group_size < -1:
            raise QuantkitError(f"group_size must be a positive integer or -1 (per-channel), got {self.group_size}")
        if not self.act_dynamic and self.act_bits is None:
            raise QuantkitError("static activation scales (act_dynamic false) need W8A8 (act_bits 8)")
        if self.act_bits not in (None, 8):
            raise QuantkitError(f"act_bits must be null (weight-only) or 8, got {self.act_bits}")
        if self.act_bits is not None and (self.bits != 8 or self.group_size != -1 or not self.sym):
            raise QuantkitError("W8A8 needs 8-bit symmetric per-channel weights (bits 8, group_size -1, sym)")
        if self.block_size is not None:
            b = self.block_size
            if not isinstance(b, int) or isinstance(b, bool) or b not in BLOCK_SIZES:
                raise QuantkitError(f"block_size must be a power of two from 16 to 512 (the GEMM's K tile), got {b!r}")
            if self.fmt != "fp8" or self.act_bits != 8 or not self.act_dynamic:
                raise QuantkitError("block_size is for fp8 W8A8 with dynamic activations (fmt fp8, act_bits 8)")

    @property
    def weight_only(self) -> bool:
        return self.act_bits is None

    @property
    def maxq(self) -> int:
        """Largest unsigned integer code."""
        return 2**self.bits - 1

    def group_of(self, in_features: int) -> int:
        """The effective group size for a layer with ``in_features`` inputs."""
        return in_features if self.group_size == -1 else min(self.group_size, in_features)

    def n_groups(self, in_features: int) -> int:
        g = self.group_of(in_features)
        return -(-in_features // g)

    @property
    def name(self) -> str:
        """Short human name, e.g. ``w4a16-g128-sym`` or ``w8a8-int8-dynamic``."""
        if self.block_size is not None:
            return "w8a8-fp8-block" + ("" if self.block_size == DEFAULT_BLOCK else str(self.block_size))
        if not self.weight_only:
            return f"w8a8-{'fp8' if self.fmt == 'fp8' else 'int8'}-{'dynamic' if self.act_dynamic else 'static'}"
        g = "pc" if self.group_size == -1 else f"g{self.group_size}"
        return f"w{self.bits}a16-{g}-{'sym' if self.sym else 'asym'}"

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict; ``block_size`` only when set (per-channel schemes read as before)."""
        data = asdict(self)
        if data["block_size"] is None:
            del data["block_size"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "scheme") -> QuantScheme:
        if not isinstance(data, dict):
            raise QuantkitError(f"{where} must be a mapping such as {{bits: 4, group_size: 128}}, got {shown(data)}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise QuantkitError(f"unknown key {unknown[0]!r} in {where}; allowed: {', '.join(sorted(allowed))}")
        return cls(**data)

    def replace(self, **changes: Any) -> QuantScheme:
        return QuantScheme(**{**self.to_dict(), **changes})
