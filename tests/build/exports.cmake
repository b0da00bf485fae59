# The executables that link LibTorch export no function of their own (cmake/torch_executable.map):
# a libstdc++ or LibTorch function the dynamic linker could bind to our copy instead of its own.
# Exported objects (copies of the libraries' std::cout, vtables and singletons) are allowed.
#
#   cmake -DNM=nm -DEXECUTABLES=bin/vramd,bin/vramd_tests -P exports.cmake
cmake_minimum_required(VERSION 3.25)
if(NOT NM OR NOT EXECUTABLES)
  message(FATAL_ERROR "exports.cmake needs -DNM=... -DEXECUTABLES=...")
endif()
string(REPLACE "," ";" EXECUTABLES "${EXECUTABLES}")
set(failed "")
foreach(executable IN LISTS EXECUTABLES)
  execute_process(COMMAND "${NM}" -D --defined-only "${executable}" OUTPUT_VARIABLE symbols
                  RESULT_VARIABLE result ERROR_VARIABLE error)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "${NM} -D ${executable}: ${error}")
  endif()
  string(REGEX MATCHALL "[0-9a-f]+ [TWiu] [^\n]+" functions "${symbols}")
  list(LENGTH functions count)
  if(count GREATER 0)
    list(SUBLIST functions 0 5 first)
    list(JOIN first "\n  " first)
    string(APPEND failed "${executable} exports ${count} functions of its own, such as\n  ${first}\n")
  endif()
endforeach()
if(failed)
  message(FATAL_ERROR "${failed}LibTorch and libstdc++ would call these instead of their own. "
                      "Link it with cmake/torch_executable.map (vramd::torch does).")
endif()
list(LENGTH EXECUTABLES count)
message(STATUS "${count} executables export no function of their own")
