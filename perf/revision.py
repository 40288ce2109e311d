"""A CPU kernel module as it was at another git revision, importable beside the working tree's.

Used by the interleaved A/B scripts (``attention_ab.py``, ``linear_ab.py``): both versions run in
one process, alternately, because the VM this project measures on drifts 10-30% between minutes.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# kernels/cpu_<x>.py of the layout before kernels/cpu/ -> today's module name
_OLD_NAMES = {"cpu_cache": "jit_cache", "cpu": "table"}


def _git_show(rev: str, path: str) -> str | None:
    r = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


def load_kernel_module(rev: str, name: str):
    """``kernels/cpu/<name>.py`` at git revision ``rev`` (``kernels/cpu_<name>.py`` in a revision
    from before the kernels/cpu/ folder) as a module named ``<name>_old``, its relative imports
    pointed at the installed ``folio.kernels``, from a file of its own so that Numba caches it
    apart from the working tree's.

    Raises:
        FileNotFoundError: the revision has neither file.
    """
    src = _git_show(rev, f"kernels/cpu/{name}.py")
    if src is not None:
        src = re.sub(r"^(\s*)from \.\. import", r"\1from folio.kernels import", src, flags=re.M)
        src = re.sub(r"^(\s*)from \.\.(\w)", r"\1from folio.kernels.\2", src, flags=re.M)
        src = re.sub(r"^(\s*)from \. import", r"\1from folio.kernels.cpu import", src, flags=re.M)
        src = re.sub(r"^(\s*)from \.(\w)", r"\1from folio.kernels.cpu.\2", src, flags=re.M)
    else:
        src = _git_show(rev, f"kernels/cpu_{name}.py")
        if src is None:
            raise FileNotFoundError(f"{rev} has neither kernels/cpu/{name}.py nor kernels/cpu_{name}.py")
        def new(m):
            old = m.group(2)
            return f"{m.group(1)}from folio.kernels.cpu.{_OLD_NAMES.get(old, old[len('cpu_'):])}"
        src = re.sub(r"^(\s*)from \.(cpu_?\w*)", new, src, flags=re.M)
        src = re.sub(r"^(\s*)from \. import", r"\1from folio.kernels import", src, flags=re.M)
    path = Path(tempfile.mkdtemp()) / f"{name}_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"{name}_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
