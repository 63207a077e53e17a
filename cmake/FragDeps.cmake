# cmake/FragDeps.cmake - finds LibTorch and the other dependencies of fragments.
#
# Builds against the LibTorch of the project's Python (the pinned PyTorch of
# tools/requirements.txt in the venv of tools/install_deps.sh) unless Torch_DIR or
# CMAKE_PREFIX_PATH points at another PyTorch 2.x. Pip wheels ship no gloo headers:
# Debian's libgloo-dev provides them.
#
# Defines these targets for CMakeLists.txt:
#   frag_torch   LibTorch (TORCH_LIBRARIES, TORCH_CXX_FLAGS), plus c10_cuda where found
#   frag_fmt     fmt, compiled (libfmt) or header-only (FMT_HEADER_ONLY)
#   frag_json    nlohmann/json (header-only)
#   frag_cli11   CLI11 (header-only)
#   frag_gloo    gloo (when FRAG_HAVE_GLOO)
#   frag_nccl    nccl + cudart (when FRAG_HAVE_NCCL)
#   frag_gtest_main  GoogleTest (and GoogleMock) with main() (when FRAG_BUILD_TESTS)
# and the results FRAG_HAVE_GLOO, FRAG_HAVE_NCCL, FRAG_HAVE_C10_CUDA.
#
# Copies of the header-only dependencies and googletest's sources can come from
# FRAG_DEPS_DIR (made by tools/device/stage_deps.sh): include/{fmt,nlohmann,CLI}
# and googletest/. What that folder holds wins over the system's copy.

include_guard(GLOBAL)
include(FragOptions)

# ---------------------------------------------------------------------------
# Python with torch: runs tools/export_model.py and the kit's tests
# ---------------------------------------------------------------------------
if(NOT DEFINED CACHE{FRAG_PYTHON})
  # The project's Python: the venv of tools/install_deps.sh (FRAG_VENV or ~/.cache/fragments/venv).
  if(DEFINED ENV{FRAG_VENV})
    set(_frag_python "$ENV{FRAG_VENV}/bin/python")
  else()
    set(_frag_python "$ENV{HOME}/.cache/fragments/venv/bin/python")
  endif()
  if(NOT EXISTS "${_frag_python}")
    find_program(FRAG_PYTHON3_ON_PATH NAMES python3)
    mark_as_advanced(FRAG_PYTHON3_ON_PATH)
    set(_frag_python "${FRAG_PYTHON3_ON_PATH}")
  endif()
  set(FRAG_PYTHON "${_frag_python}" CACHE STRING
    "Python interpreter with torch: runs tools/export_model.py and tests/python")
endif()
execute_process(COMMAND "${FRAG_PYTHON}" -c "import torch; print(torch.__version__)"
  RESULT_VARIABLE _rc OUTPUT_VARIABLE FRAG_PYTHON_TORCH_VERSION ERROR_QUIET
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _rc EQUAL 0)
  set(FRAG_PYTHON_TORCH_VERSION "")
  message(WARNING "FRAG_PYTHON=${FRAG_PYTHON} cannot import torch: the reference model "
                  "exports and the Python tests will fail. Set -DFRAG_PYTHON=...")
endif()

# ---------------------------------------------------------------------------
# LibTorch
# ---------------------------------------------------------------------------
# Default: the LibTorch of the project's Python (one PyTorch for the C++ and Python sides).
if(NOT Torch_DIR AND FRAG_PYTHON_TORCH_VERSION)
  execute_process(COMMAND "${FRAG_PYTHON}" -c "import torch; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE _frag_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  list(APPEND CMAKE_PREFIX_PATH "${_frag_torch_prefix}")
endif()
find_package(Torch REQUIRED)

# TorchConfig puts TORCH_CXX_FLAGS (the libstdc++ ABI, -D_GLIBCXX_USE_CXX11_ABI=0|1)
# on the torch target only. Everything in this build has to agree with it,
# googletest built from source included, so apply it to the whole directory.
separate_arguments(FRAG_TORCH_CXX_FLAGS UNIX_COMMAND "${TORCH_CXX_FLAGS}")
add_compile_options(${FRAG_TORCH_CXX_FLAGS})
set(FRAG_TORCH_OLD_ABI FALSE)
if(TORCH_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=0")
  # Prebuilt C++ libraries of the system (libfmt, libgtest) use the new ABI:
  # prefer header-only fmt and googletest from source then.
  set(FRAG_TORCH_OLD_ABI TRUE)
endif()

get_filename_component(FRAG_TORCH_LIBRARY_DIR "${TORCH_LIBRARY}" DIRECTORY)

add_library(frag_torch INTERFACE)
target_link_libraries(frag_torch INTERFACE ${TORCH_LIBRARIES})
target_include_directories(frag_torch SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS})

# c10_cuda exists only in a LibTorch built with CUDA.
frag_feature_option(FRAG_WITH_C10_CUDA "Run NCCL on PyTorch's current CUDA stream (needs c10_cuda)")
set(_frag_c10_cuda "")
if(TARGET c10_cuda)
  set(_frag_c10_cuda c10_cuda)
else()
  find_library(FRAG_C10_CUDA_LIBRARY c10_cuda
    PATHS "${FRAG_TORCH_LIBRARY_DIR}" "${TORCH_INSTALL_PREFIX}/lib"
    NO_DEFAULT_PATH)
  if(FRAG_C10_CUDA_LIBRARY)
    set(_frag_c10_cuda "${FRAG_C10_CUDA_LIBRARY}")
  endif()
endif()
if(_frag_c10_cuda)
  set(_why "c10_cuda found (${_frag_c10_cuda})")
else()
  set(_why "c10_cuda not found: this LibTorch has no CUDA")
endif()
frag_feature_resolve(FRAG_WITH_C10_CUDA "${_frag_c10_cuda}" "${_why}" FRAG_HAVE_C10_CUDA)
if(FRAG_HAVE_C10_CUDA)
  target_link_libraries(frag_torch INTERFACE ${_frag_c10_cuda})
endif()

# NativeRT (torch::nativert::ModelRunnerHandle, PyTorch's C++ runtime for exported programs: frag run and the
# C++ API on .pt2 rank files). PyTorch 2.11's wheels export it from libtorch_cpu; 2.13's ship the header but not
# the code (no torch::nativert symbol at all). Without it a .pt2 is refused in one line by frag run and the C++
# API (program/nativert_program.cpp) and still runs through the Python front end (fragments.load).
frag_feature_option(FRAG_WITH_NATIVERT "Run .pt2 rank files in C++ with PyTorch's NativeRT (libtorch_cpu)")
set(_frag_nativert "")
set(_why "libtorch_cpu exports no torch::nativert::ModelRunnerHandle (torch ${Torch_VERSION})")
find_library(FRAG_TORCH_CPU_LIBRARY torch_cpu PATHS "${FRAG_TORCH_LIBRARY_DIR}" "${TORCH_INSTALL_PREFIX}/lib"
  NO_DEFAULT_PATH)
if(FRAG_TORCH_CPU_LIBRARY)
  execute_process(COMMAND sh -c "nm -D --defined-only '${FRAG_TORCH_CPU_LIBRARY}' | grep -q _ZN5torch8nativert17ModelRunnerHandleC"
    RESULT_VARIABLE _frag_nativert_rc)
  if(_frag_nativert_rc EQUAL 0)
    set(_frag_nativert TRUE)
    set(_why "libtorch_cpu exports torch::nativert::ModelRunnerHandle")
  endif()
endif()
frag_feature_resolve(FRAG_WITH_NATIVERT "${_frag_nativert}" "${_why}" FRAG_HAVE_NATIVERT)

# The fused CUDA kernels of the kit's layer ops (runtime/layer_ops_cuda.cu): a CUDA compiler and a CUDA
# LibTorch. Without them the reference kernels (runtime/layer_ops.cpp) serve CUDA tensors too.
frag_feature_option(FRAG_WITH_CUDA_KERNELS "Fused CUDA kernels of frag::rms_norm, rotary_embedding, silu_and_mul")
set(_frag_cuda_kernels "")
set(_why "needs FRAG_WITH_C10_CUDA (a LibTorch with CUDA)")
frag_feature_mode(FRAG_WITH_CUDA_KERNELS _frag_cuda_kernels_mode)
# AUTO builds them only where a target GPU is named (TORCH_CUDA_ARCH_LIST, as tools/device/build_and_test.sh
# sets it): without one, torch's CMake config asks nvcc for every architecture it knows, some of which a
# newer nvcc has dropped (compute_50 under CUDA 13), on machines that have a CUDA LibTorch but no GPU.
if(FRAG_HAVE_C10_CUDA AND _frag_cuda_kernels_mode STREQUAL "AUTO" AND "$ENV{TORCH_CUDA_ARCH_LIST}" STREQUAL "")
  set(_why "no target GPU named (TORCH_CUDA_ARCH_LIST, e.g. 9.0): the reference kernels serve CUDA tensors")
elseif(FRAG_HAVE_C10_CUDA AND NOT _frag_cuda_kernels_mode STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    set(_frag_cuda_kernels TRUE)
    # (A CUDA LibTorch's CMake config adds the -gencode flags of TORCH_CUDA_ARCH_LIST itself.)
    set(_why "${CMAKE_CUDA_COMPILER} ${CMAKE_CUDA_COMPILER_VERSION}, TORCH_CUDA_ARCH_LIST '$ENV{TORCH_CUDA_ARCH_LIST}'")
  else()
    set(_why "no CUDA compiler (nvcc) found")
  endif()
endif()
frag_feature_resolve(FRAG_WITH_CUDA_KERNELS "${_frag_cuda_kernels}" "${_why}" FRAG_HAVE_CUDA_KERNELS)

# ---------------------------------------------------------------------------
# Header-only and small dependencies: FRAG_DEPS_DIR first, then the system
# ---------------------------------------------------------------------------
set(FRAG_DEPS_DIR "" CACHE PATH
  "Folder with copies of dependencies: include/{fmt,nlohmann,CLI} and googletest/ (see tools/device/stage_deps.sh)")
set(_frag_deps_include "")
if(FRAG_DEPS_DIR)
  get_filename_component(_frag_deps_abs "${FRAG_DEPS_DIR}" ABSOLUTE BASE_DIR "${CMAKE_SOURCE_DIR}")
  set(FRAG_DEPS_DIR_ABS "${_frag_deps_abs}")
  if(NOT IS_DIRECTORY "${FRAG_DEPS_DIR_ABS}")
    message(FATAL_ERROR "FRAG_DEPS_DIR=${FRAG_DEPS_DIR} is not a folder")
  endif()
  set(_frag_deps_include "${FRAG_DEPS_DIR_ABS}/include")
endif()

# Looks for HEADER under FRAG_DEPS_DIR/include, then the system; sets VAR to the
# include root (cached, so it can be overridden).
function(frag_find_header var header)
  if(_frag_deps_include AND EXISTS "${_frag_deps_include}/${header}")
    set(${var} "${_frag_deps_include}" PARENT_SCOPE)
  else()
    find_path(${var} "${header}" HINTS ${ARGN})
  endif()
endfunction()

# fmt: the copy PyTorch ships in its include folder, header-only. It is first on
# the include path anyway (LibTorch's folders are), so a system libfmt of another
# version would be compiled against these headers: never link one.
add_library(frag_fmt INTERFACE)
if(NOT EXISTS "${TORCH_INSTALL_PREFIX}/include/fmt/format.h")
  message(FATAL_ERROR "fmt not found in this LibTorch (${TORCH_INSTALL_PREFIX}/include/fmt): use PyTorch 2.x")
endif()
target_link_libraries(frag_fmt INTERFACE frag_torch)
target_compile_definitions(frag_fmt INTERFACE FMT_HEADER_ONLY)
set(FRAG_FMT_WHY "header-only from ${TORCH_INSTALL_PREFIX}/include (PyTorch's copy)")

# nlohmann/json
frag_find_header(FRAG_JSON_INCLUDE_DIR nlohmann/json.hpp)
if(NOT FRAG_JSON_INCLUDE_DIR)
  message(FATAL_ERROR "nlohmann/json.hpp not found: install nlohmann-json3-dev or set FRAG_DEPS_DIR")
endif()
add_library(frag_json INTERFACE)
target_include_directories(frag_json INTERFACE "${FRAG_JSON_INCLUDE_DIR}")

# CLI11
frag_find_header(FRAG_CLI11_INCLUDE_DIR CLI/CLI.hpp)
if(NOT FRAG_CLI11_INCLUDE_DIR)
  message(FATAL_ERROR "CLI/CLI.hpp not found: install libcli11-dev or set FRAG_DEPS_DIR")
endif()
add_library(frag_cli11 INTERFACE)
target_include_directories(frag_cli11 INTERFACE "${FRAG_CLI11_INCLUDE_DIR}")

# ---------------------------------------------------------------------------
# GoogleTest: FRAG_DEPS_DIR/googletest sources, else an installed GTest,
# else Debian's sources in /usr/src/googletest.
# ---------------------------------------------------------------------------
function(frag_add_googletest_sources dir)
  set(BUILD_GMOCK ON CACHE BOOL "" FORCE)
  set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
  set(_system "")
  if(CMAKE_VERSION VERSION_GREATER_EQUAL 3.25)
    set(_system SYSTEM)
  endif()
  add_subdirectory("${dir}" "${CMAKE_BINARY_DIR}/_deps/googletest" EXCLUDE_FROM_ALL ${_system})
endfunction()

if(FRAG_BUILD_TESTS)
  set(FRAG_GTEST_SOURCE_DIR "" CACHE PATH "googletest sources to build (default: FRAG_DEPS_DIR/googletest, else an installed GTest, else /usr/src/googletest)")
  set(_gtest_src "${FRAG_GTEST_SOURCE_DIR}")
  if(NOT _gtest_src AND FRAG_DEPS_DIR AND EXISTS "${FRAG_DEPS_DIR_ABS}/googletest/CMakeLists.txt")
    set(_gtest_src "${FRAG_DEPS_DIR_ABS}/googletest")
  endif()
  if(NOT _gtest_src)
    if(NOT FRAG_TORCH_OLD_ABI)
      find_package(GTest QUIET)
    endif()
    if(NOT GTest_FOUND AND EXISTS /usr/src/googletest/CMakeLists.txt)
      set(_gtest_src /usr/src/googletest)
    endif()
  endif()
  add_library(frag_gtest_main INTERFACE)
  if(_gtest_src)
    frag_add_googletest_sources("${_gtest_src}")
    target_link_libraries(frag_gtest_main INTERFACE gtest_main gmock gtest)
    set(FRAG_GTEST_WHY "built from ${_gtest_src}")
  elseif(TARGET GTest::gtest_main)
    target_link_libraries(frag_gtest_main INTERFACE GTest::gtest_main GTest::gtest)
    if(TARGET GTest::gmock)
      target_link_libraries(frag_gtest_main INTERFACE GTest::gmock)
    endif()
    set(FRAG_GTEST_WHY "installed GTest ${GTest_VERSION}")
  elseif(TARGET GTest::Main)
    target_link_libraries(frag_gtest_main INTERFACE GTest::Main GTest::GTest)
    set(FRAG_GTEST_WHY "installed GTest")
  else()
    message(FATAL_ERROR "GoogleTest not found: install libgtest-dev/googletest, set FRAG_DEPS_DIR "
                        "(googletest/) or FRAG_GTEST_SOURCE_DIR, or -DFRAG_BUILD_TESTS=OFF")
  endif()
endif()

# ---------------------------------------------------------------------------
# Gloo (CPU collectives through c10d::ProcessGroupGloo): gloo's headers only
# ---------------------------------------------------------------------------
# PyTorch's wheels compile Gloo into libtorch_cpu but ship no gloo headers, which
# c10d's ProcessGroupGloo.hpp needs for its declarations. Debian's libgloo-dev
# provides them; its libgloo is NOT linked (a second copy of Gloo's symbols).
frag_feature_option(FRAG_WITH_GLOO "Build the Gloo communicator (needs gloo headers; the code is libtorch's)")
frag_feature_mode(FRAG_WITH_GLOO _mode)
set(_found FALSE)
set(_why "")
if(NOT _mode STREQUAL "OFF")
  set(FRAG_GLOO_ROOT "" CACHE PATH "Where gloo's headers are installed (include/gloo); default: searched")
  set(_inc_hints "")
  if(FRAG_GLOO_ROOT)
    set(_inc_hints "${FRAG_GLOO_ROOT}/include")
  endif()
  find_path(FRAG_GLOO_INCLUDE_DIR gloo/config.h HINTS ${_inc_hints})
  if(FRAG_GLOO_INCLUDE_DIR)
    set(_found TRUE)
    set(_why "gloo headers found (${FRAG_GLOO_INCLUDE_DIR}/gloo)")
  else()
    set(_why "gloo headers (gloo/config.h) not found")
  endif()
endif()
frag_feature_resolve(FRAG_WITH_GLOO "${_found}" "${_why}" FRAG_HAVE_GLOO)
if(FRAG_HAVE_GLOO)
  add_library(frag_gloo INTERFACE)
  target_include_directories(frag_gloo SYSTEM INTERFACE "${FRAG_GLOO_INCLUDE_DIR}")
  # c10d declares ProcessGroupGloo only under USE_C10D_GLOO.
  target_compile_definitions(frag_gloo INTERFACE USE_C10D_GLOO)
endif()

# ---------------------------------------------------------------------------
# NCCL + CUDA runtime (GPU collectives; compiled and linked even without a GPU)
# ---------------------------------------------------------------------------
frag_feature_option(FRAG_WITH_NCCL "Build the NCCL communicator (needs nccl.h, libnccl, cuda_runtime.h, libcudart)")
frag_feature_mode(FRAG_WITH_NCCL _mode)
set(_found FALSE)
set(_why "")
if(NOT _mode STREQUAL "OFF")
  # CUDA runtime: the toolkit.
  set(_cuda_default /usr/local/cuda)
  if(DEFINED ENV{CUDA_HOME})
    set(_cuda_default "$ENV{CUDA_HOME}")
  elseif(DEFINED ENV{CUDA_PATH})
    set(_cuda_default "$ENV{CUDA_PATH}")
  endif()
  set(FRAG_CUDA_ROOT "${_cuda_default}" CACHE PATH "CUDA toolkit (include/cuda_runtime.h, lib64/libcudart.so)")
  find_path(FRAG_CUDART_INCLUDE_DIR cuda_runtime.h
    HINTS "${FRAG_CUDA_ROOT}/include" "${FRAG_CUDA_ROOT}/targets/x86_64-linux/include"
          "${FRAG_CUDA_ROOT}/targets/sbsa-linux/include"
    NO_DEFAULT_PATH)
  find_library(FRAG_CUDART_LIBRARY NAMES cudart libcudart.so.13 libcudart.so.12
    HINTS "${FRAG_CUDA_ROOT}/lib64" "${FRAG_CUDA_ROOT}/lib" "${FRAG_CUDA_ROOT}/targets/x86_64-linux/lib"
          "${FRAG_CUDA_ROOT}/targets/sbsa-linux/lib"
    NO_DEFAULT_PATH)

  # NCCL: the first root holding both nccl.h and libnccl. With a CUDA LibTorch
  # from pip, its own NCCL (site-packages/nvidia/nccl) comes first, so both use
  # one libnccl.so.2.
  set(FRAG_NCCL_ROOT "" CACHE PATH "Where NCCL is (include/nccl.h, lib/libnccl.so[.2]); default: searched")
  set(_roots "")
  if(FRAG_NCCL_ROOT)
    list(APPEND _roots "${FRAG_NCCL_ROOT}")
  endif()
  foreach(_env NCCL_ROOT NCCL_HOME NCCL_DIR)
    if(DEFINED ENV{${_env}})
      list(APPEND _roots "$ENV{${_env}}")
    endif()
  endforeach()
  # The pip package nvidia-nccl-cu*: next to torch, or wherever FRAG_PYTHON has it.
  list(APPEND _roots "${TORCH_INSTALL_PREFIX}/../nvidia/nccl")
  execute_process(COMMAND "${FRAG_PYTHON}" -c
      "import nvidia.nccl as m, os; print(os.path.dirname(m.__file__) if getattr(m, '__file__', None) else list(m.__path__)[0])"
    RESULT_VARIABLE _rc OUTPUT_VARIABLE _py_nccl ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_rc EQUAL 0 AND _py_nccl)
    list(APPEND _roots "${_py_nccl}")
  endif()
  list(APPEND _roots "${FRAG_CUDA_ROOT}" /usr /usr/local)

  if(NOT FRAG_NCCL_INCLUDE_DIR OR NOT FRAG_NCCL_LIBRARY)
    foreach(_root IN LISTS _roots)
      get_filename_component(_root "${_root}" ABSOLUTE)
      if(NOT EXISTS "${_root}/include/nccl.h")
        continue()
      endif()
      set(_lib "")
      foreach(_dir lib lib64 "lib/${CMAKE_LIBRARY_ARCHITECTURE}" lib/x86_64-linux-gnu)
        foreach(_name libnccl.so libnccl.so.2)
          if(NOT _lib AND EXISTS "${_root}/${_dir}/${_name}")
            set(_lib "${_root}/${_dir}/${_name}")
          endif()
        endforeach()
      endforeach()
      if(_lib)
        set(FRAG_NCCL_INCLUDE_DIR "${_root}/include" CACHE PATH "Folder holding nccl.h" FORCE)
        set(FRAG_NCCL_LIBRARY "${_lib}" CACHE FILEPATH "libnccl" FORCE)
        break()
      endif()
    endforeach()
  endif()

  if(NOT FRAG_CUDART_INCLUDE_DIR OR NOT FRAG_CUDART_LIBRARY)
    set(_why "CUDA runtime not found under FRAG_CUDA_ROOT=${FRAG_CUDA_ROOT}")
  elseif(NOT FRAG_NCCL_INCLUDE_DIR OR NOT FRAG_NCCL_LIBRARY)
    set(_why "NCCL (nccl.h + libnccl) not found; set FRAG_NCCL_ROOT")
  else()
    set(_found TRUE)
    set(_why "nccl ${FRAG_NCCL_LIBRARY}, cudart ${FRAG_CUDART_LIBRARY}")
  endif()
endif()
frag_feature_resolve(FRAG_WITH_NCCL "${_found}" "${_why}" FRAG_HAVE_NCCL)
if(FRAG_HAVE_NCCL)
  add_library(frag_nccl INTERFACE)
  target_include_directories(frag_nccl SYSTEM INTERFACE "${FRAG_NCCL_INCLUDE_DIR}" "${FRAG_CUDART_INCLUDE_DIR}")
  target_link_libraries(frag_nccl INTERFACE "${FRAG_NCCL_LIBRARY}" "${FRAG_CUDART_LIBRARY}")
  # Versioned file names (libnccl.so.2 of the pip package) get no RPATH entry
  # by themselves: add the folders, for the build tree and the install.
  get_filename_component(_nccl_dir "${FRAG_NCCL_LIBRARY}" DIRECTORY)
  get_filename_component(_cudart_dir "${FRAG_CUDART_LIBRARY}" DIRECTORY)
  set(FRAG_NCCL_RPATH "${_nccl_dir};${_cudart_dir}")
  list(REMOVE_DUPLICATES FRAG_NCCL_RPATH)
endif()
