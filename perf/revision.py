"""A CPU kernel module as it was at another git revision, importable beside the working tree's.

Used by the interleaved A/B scripts (``attention_ab.py``, ``linear_ab.py``): both versions run in
one process, alternately, because the VM this project measures on drifts 10-30% between minutes.
"""

from __future__ import annotations

import importlib.util
import subprocess
import tempfile
from pathlib import Path


def load_kernel_module(rev: str, name: str):
    """``kernels/<name>.py`` at git revision ``rev`` as a module named ``<name>_old`` (its
    relative imports pointed at the installed ``folio.kernels``), from a file of its own so that
    Numba caches it apart from the working tree's."""
    root = Path(__file__).resolve().parent.parent
    src = subprocess.run(["git", "show", f"{rev}:kernels/{name}.py"], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"{name}_old.py"
    path.write_text(src.replace("from .cpu_", "from folio.kernels.cpu_"))
    spec = importlib.util.spec_from_file_location(f"{name}_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
