# cmake/FragOptions.cmake - helpers for the AUTO/ON/OFF feature switches.
#
# frag_feature_option(NAME DOC) declares a cache variable NAME whose value is
# AUTO (use the feature when its dependencies are found), ON (require them:
# configuring fails without them) or OFF (compile it out). Any CMake boolean
# spelling (1/0, TRUE/FALSE, YES/NO) is accepted for ON/OFF.
#
# frag_feature_resolve(NAME FOUND REASON OUT) turns the switch and the result of
# the search into OUT (TRUE/FALSE), failing for ON without FOUND.

include_guard(GLOBAL)

function(frag_feature_option name doc)
  set(${name} AUTO CACHE STRING "${doc} (AUTO: when found, ON: required, OFF: compiled out)")
  set_property(CACHE ${name} PROPERTY STRINGS AUTO ON OFF)
endfunction()

# Normalises NAME's value to AUTO, ON or OFF in OUT.
function(frag_feature_mode name out)
  string(TOUPPER "${${name}}" value)
  if(value STREQUAL "AUTO" OR value STREQUAL "")
    set(${out} AUTO PARENT_SCOPE)
  elseif(${name})
    set(${out} ON PARENT_SCOPE)
  else()
    set(${out} OFF PARENT_SCOPE)
  endif()
endfunction()

function(frag_feature_resolve name found reason out)
  frag_feature_mode(${name} mode)
  if(mode STREQUAL "OFF")
    set(${out} FALSE PARENT_SCOPE)
    set(${out}_WHY "disabled (${name}=OFF)" PARENT_SCOPE)
  elseif(found)
    set(${out} TRUE PARENT_SCOPE)
    set(${out}_WHY "${reason}" PARENT_SCOPE)
  elseif(mode STREQUAL "ON")
    message(FATAL_ERROR "${name}=ON but ${reason}")
  else()
    set(${out} FALSE PARENT_SCOPE)
    set(${out}_WHY "${reason}" PARENT_SCOPE)
  endif()
endfunction()
