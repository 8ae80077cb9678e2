# Uses ccache for C++ and CUDA compilation when it is installed; a no-op otherwise.
find_program(FLATSHARD_CCACHE ccache)
if(FLATSHARD_CCACHE)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${FLATSHARD_CCACHE})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${FLATSHARD_CCACHE})
endif()
