# cmake/FragHelpers.cmake - reference model exports, Python tests, and a check
# that the source lists of CMakeLists.txt still cover the tree.

include_guard(GLOBAL)

# The Python kit: a change to it remakes the exports.
file(GLOB_RECURSE FRAG_FRAGKIT_SOURCES CONFIGURE_DEPENDS
  "${CMAKE_SOURCE_DIR}/fragkit/*.py")

# frag_export_model(<name> <flags of tools/export_model.py...>)
#
# Like export_model in tests/models/exports.bzl: runs
#   FRAG_PYTHON tools/export_model.py <flags> --out ${CMAKE_BINARY_DIR}/tests/models/<name>
# which writes rank{r}.pt for r < --tp. Appends the files to FRAG_MODEL_FILES.
function(frag_export_model name)
  set(flags ${ARGN})
  list(FIND flags --tp _at)
  if(_at LESS 0)
    message(FATAL_ERROR "frag_export_model(${name}): no --tp in '${flags}'")
  endif()
  math(EXPR _at "${_at} + 1")
  list(GET flags ${_at} tp)
  set(dir "${CMAKE_BINARY_DIR}/tests/models/${name}")
  # --format export writes torch.export archives, rank{r}.pt2.
  set(suffix "pt")
  list(FIND flags export _export_at)
  if(NOT _export_at LESS 0)
    set(suffix "pt2")
  endif()
  set(outs "")
  math(EXPR last "${tp} - 1")
  foreach(r RANGE 0 ${last})
    list(APPEND outs "${dir}/rank${r}.${suffix}")
  endforeach()
  list(JOIN flags " " flags_text)
  add_custom_command(
    OUTPUT ${outs}
    # A fresh folder: model_files() takes every rank file it finds, so none may
    # be left over from an export with a larger --tp.
    COMMAND "${CMAKE_COMMAND}" -E rm -rf "${dir}"
    COMMAND "${CMAKE_COMMAND}" -E env PYTHONDONTWRITEBYTECODE=1
            "${FRAG_PYTHON}" "${CMAKE_SOURCE_DIR}/tools/export_model.py" ${flags} --out "${dir}"
            > /dev/null
    DEPENDS "${CMAKE_SOURCE_DIR}/tools/export_model.py" ${FRAG_FRAGKIT_SOURCES}
    WORKING_DIRECTORY "${CMAKE_SOURCE_DIR}"
    COMMENT "Exporting reference model ${name} (${flags_text})"
    VERBATIM)
  set(FRAG_MODEL_FILES ${FRAG_MODEL_FILES} ${outs} PARENT_SCOPE)
endfunction()

# frag_python_test(<name> TIMEOUT <seconds> ENVIRONMENT <VAR=value;...> COMMAND <arguments...>)
#
# A ctest entry <name> (tests/python/real_model_test) running FRAG_PYTHON <arguments> from the source tree,
# as tests/test_rules.bzl's python_script_test runs a test file with the project's Python.
function(frag_python_test name)
  # ${ARGN}, not PARSE_ARGV: the latter keeps ENVIRONMENT's "A;B" one element (escaped), ctest one variable.
  cmake_parse_arguments(arg "" "TIMEOUT" "ENVIRONMENT;COMMAND" ${ARGN})
  if(NOT arg_TIMEOUT OR NOT arg_COMMAND)
    message(FATAL_ERROR "frag_python_test(${name}): TIMEOUT and COMMAND are required")
  endif()
  add_test(NAME ${name} COMMAND "${FRAG_PYTHON}" ${arg_COMMAND} WORKING_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}")
  set_tests_properties(${name} PROPERTIES ENVIRONMENT "${arg_ENVIRONMENT}" TIMEOUT ${arg_TIMEOUT})
endfunction()

# Turns the exports of tests/models/BUILD into entries like those of
# FRAG_MODEL_EXPORTS ("<name> <flags>"): export_model(...) calls, with flags
# built as exports.bzl does, and plain genrules that run export_model.py, with
# the flags of their cmd.
function(frag_bazel_model_exports build_file out)
  file(READ "${build_file}" text)
  # As a CMake list of lines; brackets and semicolons would upset list splitting.
  string(REGEX REPLACE "[][;]" " " text "${text}")
  string(REPLACE "\n" ";" lines "${text}")
  # Top-level statements: a line starting with "name(" opens one.
  set(blocks "")
  set(block "")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "#.*" "" line "${line}")
    if(line MATCHES "^[A-Za-z_]+\\(")
      if(block)
        list(APPEND blocks "${block}")
      endif()
      set(block "")
    endif()
    string(APPEND block " ${line}")
  endforeach()
  if(block)
    list(APPEND blocks "${block}")
  endif()

  set(entries "")
  foreach(call IN LISTS blocks)
    string(STRIP "${call}" call)
    set(name "")
    if(call MATCHES "[(, ]name *= *\"([^\"]+)\"")
      set(name "${CMAKE_MATCH_1}")
    endif()
    if(call MATCHES "^export_model\\(")
      foreach(key model tp kv_heads ep layers seed dtype mlp vocab_padding format)
        set(${key} "")
        if(call MATCHES "[(, ]${key} *= *\"?([A-Za-z0-9_.]+)\"?")
          set(${key} "${CMAKE_MATCH_1}")
        endif()
      endforeach()
      set(entry "${name} --model ${model} --tp ${tp}")
      if(kv_heads)
        string(APPEND entry " --kv-heads ${kv_heads}")
      endif()
      if(ep STREQUAL "True")
        string(APPEND entry " --ep")
      endif()
      if(NOT layers STREQUAL "")
        string(APPEND entry " --layers ${layers}")
      endif()
      if(NOT seed STREQUAL "")
        string(APPEND entry " --seed ${seed}")
      endif()
      if(dtype)
        string(APPEND entry " --dtype ${dtype}")
      endif()
      if(mlp)
        string(APPEND entry " --mlp ${mlp}")
      endif()
      if(vocab_padding)
        string(APPEND entry " --vocab-padding ${vocab_padding}")
      endif()
      if(format)
        string(APPEND entry " --format ${format}")
      endif()
      list(APPEND entries "${entry}")
    elseif(call MATCHES "^genrule\\(" AND call MATCHES "export_model\\.py\\)")
      # cmd = ("... $(location //tools:export_model.py) " + "<flags>" + " --out ..."):
      # join the string literals and take what lies between the script and --out.
      string(REGEX MATCHALL "\"[^\"]*\"" literals "${call}")
      list(JOIN literals "" joined)
      string(REPLACE "\"" "" joined "${joined}")
      if(joined MATCHES "export_model\\.py\\) *(.*) --out ")
        separate_arguments(flags UNIX_COMMAND "${CMAKE_MATCH_1}")
        list(JOIN flags " " flags)
        list(APPEND entries "${name} ${flags}")
      endif()
    endif()
  endforeach()
  set(${out} "${entries}" PARENT_SCOPE)
endfunction()

# Warns about .cpp files under the project's folders that no list of
# CMakeLists.txt names, and about reference exports that differ from
# tests/models/BUILD. The globs re-run on every build (CONFIGURE_DEPENDS), so a
# new file brings the warning on the next build.
function(frag_check_lists)
  file(GLOB_RECURSE found CONFIGURE_DEPENDS RELATIVE "${CMAKE_SOURCE_DIR}"
    "${CMAKE_SOURCE_DIR}/ir/*.cpp" "${CMAKE_SOURCE_DIR}/passes/*.cpp"
    "${CMAKE_SOURCE_DIR}/runtime/*.cpp" "${CMAKE_SOURCE_DIR}/program/*.cpp" "${CMAKE_SOURCE_DIR}/cli/*.cpp"
    "${CMAKE_SOURCE_DIR}/bench/*.cpp" "${CMAKE_SOURCE_DIR}/examples/*.cpp" "${CMAKE_SOURCE_DIR}/tests/*.cpp")
  set(listed ${FRAG_IR_SOURCES} ${FRAG_PASSES_SOURCES} ${FRAG_RUNTIME_SOURCES} ${FRAG_PROGRAM_SOURCES}
             ${FRAG_CLI_SOURCES} ${FRAG_TEST_SUPPORT_SOURCES} ${FRAG_TEST_SOURCES} ${FRAG_FUZZ_SOURCES})
  foreach(entry IN LISTS FRAG_BINARIES)
    separate_arguments(entry UNIX_COMMAND "${entry}")
    list(GET entry 1 source)
    list(APPEND listed "${source}")
  endforeach()
  foreach(source IN LISTS listed)
    if(NOT EXISTS "${CMAKE_SOURCE_DIR}/${source}")
      message(FATAL_ERROR "CMakeLists.txt lists ${source}, which does not exist")
    endif()
  endforeach()
  list(REMOVE_ITEM found ${listed})
  if(found)
    list(JOIN found "\n    " text)
    message(WARNING "C++ sources in no list of CMakeLists.txt (add them to the list of "
                    "their folder, as in their BUILD file):\n    ${text}")
  endif()

  set(build_file "${CMAKE_SOURCE_DIR}/tests/models/BUILD")
  if(EXISTS "${build_file}")
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${build_file}")
    frag_bazel_model_exports("${build_file}" bazel)
    set(ours "")
    foreach(entry IN LISTS FRAG_MODEL_EXPORTS)
      separate_arguments(entry UNIX_COMMAND "${entry}")
      list(JOIN entry " " entry)
      list(APPEND ours "${entry}")
    endforeach()
    set(only_bazel ${bazel})
    set(only_ours ${ours})
    if(ours)
      list(REMOVE_ITEM only_bazel ${ours})
    endif()
    if(bazel)
      list(REMOVE_ITEM only_ours ${bazel})
    endif()
    # Exports written as plain genrules in the BUILD file are not parsed: an
    # entry of ours counts as matched when its name is a target there.
    file(READ "${build_file}" build_text)
    foreach(entry IN LISTS only_ours)
      string(REGEX MATCH "^[^ ]+" entry_name "${entry}")
      if(build_text MATCHES "name *= *\"${entry_name}\"" AND NOT bazel MATCHES "(^|;)${entry_name} ")
        list(REMOVE_ITEM only_ours "${entry}")
      endif()
    endforeach()
    if(only_bazel OR only_ours)
      list(JOIN only_bazel "\n    " a)
      list(JOIN only_ours "\n    " b)
      if(NOT a)
        set(a "(none)")
      endif()
      if(NOT b)
        set(b "(none)")
      endif()
      message(WARNING "FRAG_MODEL_EXPORTS of CMakeLists.txt differs from tests/models/BUILD.\n"
                      "  Only in tests/models/BUILD:\n    ${a}\n  Only in CMakeLists.txt:\n    ${b}")
    endif()
  endif()
endfunction()
