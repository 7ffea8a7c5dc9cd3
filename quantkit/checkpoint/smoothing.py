"""The smoothing report of a SmoothQuant checkpoint (``smoothing.md``): per smoothing group, the alpha used and
the activation outlier ratio (largest / median channel abs-max) before and after, read from the ``smoothquant``
records the stage leaves in the quantize report."""

from __future__ import annotations


def outlier_rows(layers: dict[str, dict]) -> list[dict]:
    """The ``smoothquant`` records of a quantize report (``QuantizeResult.layers`` / ``quant_report.json``'s
    ``layers``) as rows: producer, consumers, alpha, outlier ratio before and after."""
    rows = []
    for name, rec in layers.items():
        sq = rec.get("smoothquant")
        if sq is not None:
            rows.append(
                {"producer": name, **{k: sq[k] for k in ("consumers", "alpha", "outlier_before", "outlier_after")}}
            )
    return rows


def outlier_markdown(rows: list[dict]) -> str:
    """A markdown table of :func:`outlier_rows`."""
    lines = [
        "| producer | consumers | alpha | outlier ratio before | after |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        consumers = ", ".join(_relative(c, r["producer"]) for c in r["consumers"])
        lines.append(
            f"| {r['producer']} | {consumers} | {r['alpha']:.2f} | {_ratio(r['outlier_before'])} | "
            f"{_ratio(r['outlier_after'])} |"
        )
    return "\n".join(lines) + "\n"


def _relative(name: str, producer: str) -> str:
    """``name`` without the module path it shares with ``producer`` (at least its last component stays)."""
    parts, other = name.split("."), producer.split(".")
    n = 0
    while n < len(parts) - 1 and n < len(other) and parts[n] == other[n]:
        n += 1
    return ".".join(parts[n:])


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"
