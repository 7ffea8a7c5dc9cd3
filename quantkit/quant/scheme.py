"""The quantization scheme of one linear layer: how its weight (and, for W8A8 / W4A8, its input) is stored."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from quantkit.checks import shown
from quantkit.errors import QuantkitError

WEIGHT_BITS = (2, 3, 4, 8)
FORMATS = ("int", "fp8")
W4A8_ACT_NAMES = {"int": "int8", "fp8": "fp8"}  # act_fmt -> the name's activation word (w4a8-int8, w4a8-fp8)
BLOCK_SIZES = (16, 32, 64, 128, 256, 512)
PROGRESSIVE_GROUP_ALIGN = 32  # the progressive kernel's K tiles (multiples of 32) each lie inside one group
DEFAULT_BLOCK = 128
_KIND_WORDS = {int: "an integer", bool: "true or false", str: "a string"}


@dataclass(frozen=True)
class QuantScheme:
    """Weight bits, grouping and symmetry, plus optional activation quantization.

    - ``bits``: 2, 3, 4 or 8 for integer weights (``fmt="int"``); fp8 weights are e4m3 (``bits=8``).
    - ``group_size``: input channels sharing one scale/zero; ``-1`` means one group per output channel.
      When it does not divide the input size the last group is shorter (ragged).
    - ``sym``: symmetric (zero point fixed at ``2**(bits-1)``) or asymmetric (integer zero point per group).
    - ``act_bits``: ``None`` for weight-only (W*A16); ``8`` for W8A8 (``bits=8``) or W4A8 (``bits=4``).
    - ``act_dynamic``: per-token scales computed at run time (``True``) or one calibrated per-tensor scale.
    - ``act_fmt``: W4A8 only: ``"int"`` (int8 activations, ``w4a8-int8``, the default) or ``"fp8"`` (e4m3,
      ``w4a8-fp8``); the 4-bit weights are stored as W4A16's (GPTQ-v2 buffers, per channel or per group, symmetric
      or not) and the activations are quantized per token at run time. W8A8 activations share ``fmt``.
    - ``block_size``: ``None``, or B for block-wise fp8 W8A8 (DeepSeek-V3's scheme, ``w8a8-fp8-block``): one fp32
      scale per B x B weight block and per 1 x B activation tile (computed at run time); B a power of two, 16-512
      (the GEMM's K tile). Needs ``fmt="fp8"``, ``act_bits=8``, dynamic activations and ``group_size=-1``.
    - ``progressive``: W4A8 with int8 activations only (``w4a8-int8-g128-progressive``): QServe's two-level weight
      format (``quantkit.kernels.w4a8.progressive``): a per-channel fp32 scale s1 over int8 values, and per group of
      ``group_size`` (a positive multiple of 32) 4-bit codes with an integer scale s2 in [1, 15] and zero z in
      [0, 15]. Its groups are asymmetric by construction, so ``sym`` is set to false (whatever was asked).
    """

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    fmt: str = "int"
    act_bits: int | None = None
    act_dynamic: bool = True
    block_size: int | None = None
    act_fmt: str | None = None
    progressive: bool = False

    def __post_init__(self) -> None:
        for name, kind in (("bits", int), ("group_size", int), ("sym", bool), ("act_bits", int),
                           ("act_dynamic", bool), ("fmt", str), ("act_fmt", str), ("progressive", bool)):  # fmt: skip
            value = getattr(self, name)
            if value is None and name in ("act_bits", "act_fmt"):
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
        self._check_activations()
        self._check_progressive()
        if self.block_size is not None:
            b = self.block_size
            if not isinstance(b, int) or isinstance(b, bool) or b not in BLOCK_SIZES:
                raise QuantkitError(f"block_size must be a power of two from 16 to 512 (the GEMM's K tile), got {b!r}")
            if self.fmt != "fp8" or self.act_bits != 8 or not self.act_dynamic:
                raise QuantkitError("block_size is for fp8 W8A8 with dynamic activations (fmt fp8, act_bits 8)")

    def _check_activations(self) -> None:
        """W8A8 and W4A8 rules; fills in ``act_fmt`` ("int") for W4A8 and clears a W8A8 one equal to ``fmt``."""
        if self.act_fmt is not None and self.act_fmt not in FORMATS:
            raise QuantkitError(f"act_fmt must be one of {FORMATS}, got {self.act_fmt!r}")
        if self.act_bits is None:
            if self.act_fmt is not None:
                raise QuantkitError("act_fmt is the format of quantized activations: it needs act_bits 8 (W4A8)")
            return
        if self.bits == 4:
            if self.fmt != "int" or not self.act_dynamic:
                raise QuantkitError("W4A8 needs integer 4-bit weights and dynamic per-token activations "
                                    "(fmt int, act_dynamic true)")  # fmt: skip
            if self.act_fmt is None:
                object.__setattr__(self, "act_fmt", "int")
            return
        if self.bits != 8:
            raise QuantkitError(
                f"8-bit activations need 8-bit weights (W8A8) or 4-bit ones (W4A8), got bits {self.bits}"
            )
        if self.group_size != -1 or not self.sym:
            raise QuantkitError("W8A8 needs 8-bit symmetric per-channel weights (bits 8, group_size -1, sym)")
        if self.act_fmt not in (None, self.fmt):
            raise QuantkitError(f"W8A8 activations take the weights' format (fmt {self.fmt}); act_fmt is for W4A8")
        object.__setattr__(self, "act_fmt", None)

    def _check_progressive(self) -> None:
        """The progressive format's rules; sets ``sym`` false (its level-2 groups are asymmetric)."""
        if not self.progressive:
            return
        if not self.w4a8:
            raise QuantkitError(f"progressive is a W4A8 weight format (bits 4, act_bits 8), not for {self.name}")
        if self.act_fmt != "int":
            raise QuantkitError("progressive W4A8 takes int8 activations (act_fmt int): its kernel sums int8 products "
                                "in one int32 accumulator")  # fmt: skip
        if self.group_size <= 0 or self.group_size % PROGRESSIVE_GROUP_ALIGN:
            raise QuantkitError(f"progressive W4A8 needs a group_size that is a positive multiple of "
                                f"{PROGRESSIVE_GROUP_ALIGN} (the kernel's K tiles), got {self.group_size}")  # fmt: skip
        object.__setattr__(self, "sym", False)

    @property
    def weight_only(self) -> bool:
        return self.act_bits is None

    @property
    def w4a8(self) -> bool:
        """4-bit integer weights with 8-bit activations quantized per token at run time."""
        return self.act_bits == 8 and self.bits == 4

    @property
    def packed(self) -> bool:
        """Whether the weight is stored in GPTQ-v2 buffers (qweight, qzeros, scales, g_idx): W*A16 and W4A8 (not
        progressive W4A8, which has buffers of its own)."""
        return (self.weight_only or self.w4a8) and not self.progressive

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
        """Short human name, e.g. ``w4a16-g128-sym``, ``w8a8-int8-dynamic``, ``w4a8-int8-g128-sym`` or
        ``w4a8-int8-g128-progressive``."""
        g = "pc" if self.group_size == -1 else f"g{self.group_size}"
        if self.progressive and self.w4a8:
            return f"w4a8-int8-{g}-progressive"
        if self.w4a8:
            return f"w4a8-{W4A8_ACT_NAMES[self.act_fmt]}-{g}-{'sym' if self.sym else 'asym'}"
        if self.block_size is not None:
            return "w8a8-fp8-block" + ("" if self.block_size == DEFAULT_BLOCK else str(self.block_size))
        if not self.weight_only:
            return f"w8a8-{'fp8' if self.fmt == 'fp8' else 'int8'}-{'dynamic' if self.act_dynamic else 'static'}"
        return f"w{self.bits}a16-{g}-{'sym' if self.sym else 'asym'}"

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict; ``block_size``, ``act_fmt`` and ``progressive`` only when set (other schemes
        read as before)."""
        data = asdict(self)
        for key in ("block_size", "act_fmt", "progressive"):
            if data[key] in (None, False):
                del data[key]
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
