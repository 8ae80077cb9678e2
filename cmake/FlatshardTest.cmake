# flatshard_test(<name> SOURCES <files...> LIBS <targets...>)
# Declares one GoogleTest executable and registers each of its tests with ctest.
find_package(GTest REQUIRED)
include(GoogleTest)

function(flatshard_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  flatshard_target_defaults(${name})
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  set(_environment "")
  if(FLATSHARD_SANITIZE STREQUAL "address")
    # Third-party leaks no code of ours can free (the file says which).
    set(_environment ENVIRONMENT "LSAN_OPTIONS=suppressions=${PROJECT_SOURCE_DIR}/tests/lsan.supp")
  endif()
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 300 ${_environment})
endfunction()
