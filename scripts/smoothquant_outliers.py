"""Print the activation outlier table of a SmoothQuant checkpoint: per smoothing group, the largest channel
abs-max of the consumers' input divided by the median channel abs-max, before and after smoothing.

    quantkit quantize --method smoothquant --alpha 0.5 --out out/smollm2-sq
    python scripts/smoothquant_outliers.py out/smollm2-sq --layers 0,1,15,29 --out out/smollm2-sq/outliers.md

The numbers come from the checkpoint's ``quant_report.json`` (the smoothquant stage records them while
quantizing, from the abs-max over all calibration tokens); a path to that file works too. ``--out`` writes the
markdown table and a JSON of the same rows beside it.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from quantkit.checkpoint.smoothing import outlier_markdown, outlier_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="checkpoint folder, or its quant_report.json")
    ap.add_argument("--layers", default=None, help="comma-separated decoder layer indices (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here (and .json beside it)")
    args = ap.parse_args()
    path = args.checkpoint / "quant_report.json" if args.checkpoint.is_dir() else args.checkpoint
    if not path.is_file():
        raise SystemExit(f"{path} not found (pass a checkpoint folder or its quant_report.json)")
    rows = outlier_rows(json.loads(path.read_text())["layers"])
    if not rows:
        raise SystemExit(f"{path} has no smoothquant records (was the checkpoint smoothed?)")
    if args.layers is not None:
        wanted = {int(i) for i in args.layers.split(",")}
        rows = [r for r in rows if _layer_index(r["producer"]) in wanted]
    table = outlier_markdown(rows)
    print(table, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"{describe(path)}\n\n{table}")
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")


def describe(report: Path) -> str:
    """One line on what was measured: the checkpoint's smoothquant parameters and calibration, when known."""
    text = "Activation outlier ratio (largest / median channel abs-max of a group's input) before and after smoothing"
    config = report.parent / "config.json"
    if not config.is_file():
        return f"{text}; from {report.name}."
    qc = json.loads(config.read_text()).get("quantization_config", {})
    stages = qc.get("recipe", {}).get("stages", [])
    params = next((s.get("params", {}) for s in stages if s.get("method") == "smoothquant"), {})
    keys = ("alpha_search", "alpha_grid", "producers") if params.get("alpha_search") else ("alpha", "producers")
    shown = {k: v for k, v in params.items() if k in keys}
    calib = qc.get("calibration") or {}
    return (
        f"{text}. Checkpoint {report.parent.name}: methods {' + '.join(s.get('method', '?') for s in stages)}, "
        f"schemes {', '.join(qc.get('schemes', {}))}, smoothquant {shown}; calibration {calib.get('source')} "
        f"{calib.get('nsamples')} x {calib.get('seqlen')} tokens."
    )


def _layer_index(name: str) -> int | None:
    m = re.search(r"\.(\d+)\.", name)
    return int(m.group(1)) if m else None


if __name__ == "__main__":
    main()
