# `cmake --install` puts the binaries, the client library with its headers and a CMake
# package in the prefix, so a training program elsewhere does:
#   find_package(flatshard REQUIRED)
#   target_link_libraries(trainer PRIVATE flatshard::client)
include(CMakePackageConfigHelpers)

install(TARGETS flatshard-server flatshard RUNTIME DESTINATION bin)
install(TARGETS flatshard_client flatshard_core flatshard_transport flatshard_proto
                flatshard_proto_convert
        EXPORT flatshardTargets
        ARCHIVE DESTINATION lib
        LIBRARY DESTINATION lib
        INCLUDES DESTINATION include)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/client/include/flatshard DESTINATION include)
install(FILES ${PROJECT_SOURCE_DIR}/core/dtype.h ${PROJECT_SOURCE_DIR}/core/layout.h
              ${PROJECT_SOURCE_DIR}/core/flat_buffer.h ${PROJECT_SOURCE_DIR}/core/float_bits.h
              ${PROJECT_SOURCE_DIR}/core/status_macros.h
        DESTINATION include/core)
install(EXPORT flatshardTargets NAMESPACE flatshard:: DESTINATION lib/cmake/flatshard)

file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/flatshardConfig.cmake.in [[
@PACKAGE_INIT@
include(CMakeFindDependencyMacro)
find_dependency(absl CONFIG)
find_dependency(nlohmann_json 3)
find_dependency(Protobuf)
find_dependency(gRPC CONFIG)
include("${CMAKE_CURRENT_LIST_DIR}/flatshardTargets.cmake")
]])
configure_package_config_file(${CMAKE_CURRENT_BINARY_DIR}/flatshardConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/flatshardConfig.cmake
                              INSTALL_DESTINATION lib/cmake/flatshard)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/flatshardConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/flatshardConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/flatshardConfigVersion.cmake
        DESTINATION lib/cmake/flatshard)
