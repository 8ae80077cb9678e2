# ctest script: install the build tree into a scratch prefix, build the consumer project
# against it with find_package(flatshard) and run it; then, when the build has the
# Python package, use the installed one (python_consumer.py).
#   cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DSCRATCH=... [-DPYTHON=... -DPYTHON_DIR=...] -P package_test.cmake
file(REMOVE_RECURSE ${SCRATCH})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${SCRATCH}/prefix
                RESULT_VARIABLE result OUTPUT_QUIET)
if(result)
  message(FATAL_ERROR "cmake --install failed: ${result}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/package/consumer
                        -B ${SCRATCH}/build -DCMAKE_PREFIX_PATH=${SCRATCH}/prefix
                RESULT_VARIABLE result)
if(result)
  message(FATAL_ERROR "configuring the consumer with find_package(flatshard) failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${SCRATCH}/build RESULT_VARIABLE result)
if(result)
  message(FATAL_ERROR "building the consumer against flatshard::client failed")
endif()
execute_process(COMMAND ${SCRATCH}/build/consumer RESULT_VARIABLE result OUTPUT_VARIABLE out)
message(STATUS "consumer: ${out}")
if(result)
  message(FATAL_ERROR "the consumer exited with ${result}")
endif()

# The Python package installed beside them (PYTHON, PYTHON_DIR: given when the build has
# it), imported from the prefix alone.
if(PYTHON)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=FLATSHARD_SERVER_BINARY
                          PYTHONPATH=${SCRATCH}/prefix/${PYTHON_DIR} PYTHONDONTWRITEBYTECODE=1
                          ${PYTHON} ${SOURCE_DIR}/tests/package/python_consumer.py ${SCRATCH}/prefix
                  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "python consumer: ${out}")
  if(result)
    message(FATAL_ERROR "the installed Python package failed (${result}): ${err}")
  endif()
endif()
