"""Every ```python block of the README and docs/ runs, top to bottom per file, so the docs can't rot.

Blocks fenced as ```text are shown, not run. Every page runs on TensorFlow; the pages in
``JAX_PAGES`` run on JAX too, each in a fresh ``KERAS_BACKEND=jax`` subprocess with 64-bit
types turned on first, as docs/backends.md tells JAX users to, and those in ``TORCH_PAGES`` on
PyTorch (``KERAS_BACKEND=torch``). The children are launched from the TensorFlow run of the
suite (these tests are not marked ``all_backends``), as in tests/test_jax_distribution.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
TIMEOUT_S = 600

# The pages whose examples are backend-neutral (keras.ops and NumPy): today every page that has
# ```python examples.
JAX_PAGES = (
    "README.md",
    "docs/backends.md",
    "docs/jacobian.md",
    "docs/migrating_from_tf_privacy.md",
    "docs/per_example_gradients.md",
    "docs/privacy.md",
    "docs/writing_rules.md",
    "docs/training.md",
    "docs/analysis.md",
)
JAX_PRELUDE = 'import jax\njax.config.update("jax_enable_x64", True)\n'
# The pages whose examples are run on PyTorch too (the others have not been run there yet).
TORCH_PAGES = ("README.md", "docs/jacobian.md", "docs/fine_tuning.md")


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


def run_page(page: Path, tmp_path: Path, backend: str, prelude: str = "") -> None:
    script = tmp_path / "page.py"
    script.write_text(prelude + "\n\n".join(python_blocks(page)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", MPLBACKEND="Agg", KERAS_BACKEND=backend)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{page.name} failed on {backend}:\n{done.stderr[-4000:]}"


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_code_runs(page, tmp_path):
    run_page(page, tmp_path, "tensorflow")


@pytest.mark.parametrize("name", JAX_PAGES)
def test_page_code_runs_on_jax(name, tmp_path):
    page = ROOT / name
    assert python_blocks(page), f"{name} has no ```python block to run on JAX"
    run_page(page, tmp_path, "jax", JAX_PRELUDE)


@pytest.mark.parametrize("name", TORCH_PAGES)
def test_page_code_runs_on_torch(name, tmp_path):
    page = ROOT / name
    assert python_blocks(page), f"{name} has no ```python block to run on PyTorch"
    run_page(page, tmp_path, "torch")
