"""The `frag` console script of the wheel: runs the frag binary installed beside the package."""
import os
import sys


def main():
    binary = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "frag")
    if not os.path.exists(binary):
        sys.exit(f"frag: error: {binary} is missing (this fragments was not installed by `pip install .`)")
    os.execv(binary, [binary] + sys.argv[1:])
