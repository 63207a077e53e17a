"""The pinned PyTorch's LibTorch and Python as the repository @torch.

tools/install_deps.sh makes the project's venv (${FRAG_VENV:-$HOME/.cache/fragments/venv}, the versions of
tools/requirements.txt). This rule links its torch package in and offers:
  @torch//:libtorch  headers and libraries (CPU; libtorch's RUNPATH finds the wheel's CUDA libraries)
  @torch//:python    the venv's python, for genrules and tests that run the kit
  @torch//:python_extension  what a Python extension adds (Python's headers, libtorch_python): fragments._C
"""

def _venv(ctx):
    venv = ctx.os.environ.get("FRAG_VENV", "")
    if not venv:
        venv = ctx.os.environ.get("HOME", "/root") + "/.cache/fragments/venv"
    return venv

def _torch_repository_impl(ctx):
    venv = _venv(ctx)
    python = venv + "/bin/python"
    found = ctx.execute([python, "-c", "import os, sysconfig, torch; print(os.path.dirname(torch.__file__)); " +
                                        "print(torch.__version__); print(sysconfig.get_paths()['include'])"])
    if found.return_code != 0:
        fail("no PyTorch in the project's venv %s (run tools/install_deps.sh): %s" % (venv, found.stderr))
    torch_dir, version, python_include = found.stdout.strip().split("\n")
    ctx.symlink(torch_dir + "/include", "include")
    ctx.symlink(python_include, "python_include")
    ctx.file("python.sh", "#!/bin/sh\nexec %s \"$@\"\n" % python, executable = True)
    ctx.file("BUILD", """\
package(default_visibility = ["//visibility:public"])

# PyTorch {version} from {venv}
cc_library(
    name = "libtorch",
    hdrs = glob(["include/**"]),
    includes = ["include", "include/torch/csrc/api/include"],
    defines = ["USE_C10D_GLOO"],
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-ltorch", "-ltorch_cpu", "-lc10", "-lpthread"],
)

sh_binary(name = "python", srcs = ["python.sh"])

# For a Python extension module (a cc_binary with linkshared): the venv Python's headers and
# libtorch_python (tensor <-> Python conversions; pybind11's headers come with PyTorch's).
cc_library(
    name = "python_extension",
    hdrs = glob(["python_include/**"]),
    includes = ["python_include"],
    linkopts = ["-L{lib}", "-ltorch_python"],
    deps = [":libtorch"],
)
""".format(version = version, venv = venv, lib = torch_dir + "/lib"))

torch_repository = repository_rule(
    implementation = _torch_repository_impl,
    environ = ["FRAG_VENV", "HOME"],
    local = True,
)
