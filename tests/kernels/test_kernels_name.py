"""The top-level ``kernels/`` folder must not hide Hugging Face's ``kernels`` package (a transformers >= 5.25
dependency) when the checkout's root is on sys.path, as it is in every test run."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_an_installed_kernels_package_wins_over_the_checkout_folder(tmp_path):
    installed = tmp_path / "site" / "kernels"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("CUDAProperties = 'the installed package'\n")
    code = "import kernels, quantkit.kernels; print(kernels.CUDAProperties, quantkit.kernels.__name__)"
    first = [str(ROOT), str(tmp_path / "site")]  # the checkout first, as pytest puts it
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path[:0] = {first!r}; {code}"],
        capture_output=True, text=True, cwd=tmp_path, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["the", "installed", "package", "quantkit.kernels"]


def test_without_such_a_package_the_folder_imports_as_itself(tmp_path):
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import kernels; print(kernels.__file__)"
    # -S: no site-packages, so no installed ``kernels`` whatever this environment holds
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert out.stdout.strip() == str(ROOT / "kernels" / "__init__.py")
