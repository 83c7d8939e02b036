"""Every ```python block of the README and docs/ runs, top to bottom per file, so the docs can't rot.

Blocks fenced as ```text are shown, not run. Each page runs in a fresh process on the suite's
own backend: every page on TensorFlow, the pages in ``JAX_PAGES`` in the JAX suite (64-bit types
turned on first, as docs/backends.md tells JAX users to), those in ``TORCH_PAGES`` in the
PyTorch suite.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import keras
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


# Pages that need a package outside pergrad[tensorflow,jax,torch,test]: skipped where it is absent.
EXTRA = {"keras_hub": "hub"}
# What loads TensorFlow on every backend, on purpose (docs/backends.md, "TensorFlow is not loaded
# on JAX"): tf.data's Poisson sampling and TensorBoard's event files. A page using them is
# skipped where pergrad[jax] or pergrad[torch] was installed without pergrad[tensorflow].
NEEDS_TENSORFLOW = re.compile(r"\bpoisson_batches\(|\blog_dir=|^\s*(import|from) tensorflow\b",
                              re.M)


def run_page(page: Path, tmp_path: Path, backend: str, prelude: str = "") -> None:
    code = "\n\n".join(python_blocks(page))
    # Looked up, not imported: importing keras_hub here would load its rules into this process.
    needed = {backend: backend, **{m: e for m, e in EXTRA.items()
                                   if re.search(rf"^\s*(import|from) {m}\b", code, re.M)}}
    if NEEDS_TENSORFLOW.search(code):
        needed["tensorflow"] = "tensorflow"
    for module, extra in needed.items():
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install pergrad[{extra}])")
    script = tmp_path / "page.py"
    script.write_text(prelude + code)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", MPLBACKEND="Agg", KERAS_BACKEND=backend)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{page.name} failed on {backend}:\n{done.stderr[-4000:]}"


def pages_run_here() -> list[str]:
    """The pages whose code this suite's backend runs: every page with ```python blocks on
    TensorFlow, :data:`JAX_PAGES` on JAX, :data:`TORCH_PAGES` on PyTorch."""
    backend = keras.backend.backend()
    if backend == "jax":
        return list(JAX_PAGES)
    if backend == "torch":
        return list(TORCH_PAGES)
    return [p.relative_to(ROOT).as_posix() for p in PAGES if python_blocks(p)]


#: Every page but the README (a newcomer's first page, run by default) is a slow check: a fresh
#: process per page, 7-70 s each.
SLOW_PAGE = pytest.mark.slow(reason="a fresh process runs the page's examples, 7-70 s a page")


@pytest.mark.parametrize("name", [name if name == "README.md" else pytest.param(
    name, marks=SLOW_PAGE) for name in pages_run_here()])
def test_page_code_runs(name, tmp_path):
    """The page's code, top to bottom, in a fresh process on this suite's backend (on JAX with
    64-bit types turned on first, as docs/backends.md tells JAX users to)."""
    page = ROOT / name
    backend = keras.backend.backend()
    assert python_blocks(page), f"{name} has no ```python block to run on {backend}"
    run_page(page, tmp_path, backend, JAX_PRELUDE if backend == "jax" else "")


@pytest.mark.only_on("tensorflow", reason=(
    "a text check of README.md against .ci/run, the same on every backend: run once"))
def test_ci_runs_the_readme_test_command():
    """``.ci/run`` runs the README's test command (the ``bash`` block that installs the test
    extra), each of its ``&&`` steps as a line of its own, in order."""
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    command = next(b for b in blocks if "test" in b and "pytest" in b)
    steps = [" ".join(s.split()) for s in command.strip().split("&&")]
    ci = [" ".join(line.split()) for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    positions = [ci.index(step) if step in ci else -1 for step in steps]
    assert -1 not in positions, [s for s, p in zip(steps, positions, strict=True) if p < 0]
    assert positions == sorted(positions)
