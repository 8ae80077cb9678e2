# `cmake --install` puts the binaries, the client library with its headers and a CMake
# package in the prefix, so a training program elsewhere does:
#   find_package(flatshard REQUIRED)
#   target_link_libraries(trainer PRIVATE flatshard::client)
include(CMakePackageConfigHelpers)

install(TARGETS flatshard-server flatshard RUNTIME DESTINATION bin)
set(_flatshard_exported flatshard_client flatshard_core flatshard_transport flatshard_tls flatshard_proto
                         flatshard_proto_convert)
set(_flatshard_cuda_dependency "")
if(FLATSHARD_HAVE_CUDA)
  # The client handles device buffers (CUDA IPC, staging): its static library needs the
  # CUDA kernels library and the CUDA runtime.
  list(APPEND _flatshard_exported flatshard_kernels_cuda flatshard_kernels)
  set(_flatshard_cuda_dependency "find_dependency(CUDAToolkit)")
endif()
install(TARGETS ${_flatshard_exported}
        EXPORT flatshardTargets
        ARCHIVE DESTINATION lib
        LIBRARY DESTINATION lib
        INCLUDES DESTINATION include)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/client/include/flatshard DESTINATION include)
install(FILES ${PROJECT_SOURCE_DIR}/core/checkpoint_kind.h
              ${PROJECT_SOURCE_DIR}/core/dtype.h ${PROJECT_SOURCE_DIR}/core/layout.h
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
find_dependency(OpenSSL)
@_flatshard_cuda_dependency@
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
