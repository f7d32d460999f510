"""The checkout's kernels/ folder is batchjob.kernels; a Python started in the checkout's root (pytest's, `python -m`
there) also finds it as a top-level `kernels`, Hugging Face's package's name, which transformers imports. The folder
then gives the name back: `import kernels` is Hugging Face's package where it is installed."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import importlib.util, sys; import kernels; print(kernels.__file__); "
         "import batchjob.kernels as ours; print(ours.__file__)")


def _hugging_face_kernels() -> str | None:
    """Where Hugging Face's `kernels` is installed (None: it is not), seen from outside the checkout."""
    done = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"], cwd="/",
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def test_import_kernels_in_the_checkouts_root_is_hugging_faces_package():
    theirs = _hugging_face_kernels()
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    found, ours = done.stdout.split()
    assert Path(ours) == ROOT / "kernels" / "__init__.py"
    # Hugging Face's package where it is installed (transformers >= 5.25 requires it); else the folder stays
    assert found == (theirs or ours)


def test_transformers_loads_a_model_from_the_checkouts_root(tiny_model_dir):
    # transformers >= 5.25 imports Hugging Face's `kernels`; started here, it meets our folder first
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (the test extras: make install-test)")
    path = tiny_model_dir("llama", max_positions=64)
    code = (f"import transformers, torch; m = transformers.AutoModelForCausalLM.from_pretrained({str(path)!r}); "
            "print(transformers.__version__, m(torch.tensor([[5, 6, 7]])).logits.shape[-1])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    version, vocab = done.stdout.split()
    assert int(vocab) > 0
