# Run by `cmake --install` (python/CMakeLists.txt sets flatshard_python_dir first): writes
# the installed Python package's _paths.py, which names the server installed in the
# same prefix, for flatshard.LocalCluster.
set(paths_file "$ENV{DESTDIR}${CMAKE_INSTALL_PREFIX}/${flatshard_python_dir}/_paths.py")
message(STATUS "Installing: ${paths_file}")
file(WRITE "${paths_file}" "# Written by cmake --install: where the installed binaries are.
SERVER_BINARY = \"${CMAKE_INSTALL_PREFIX}/bin/flatshard-server\"
")
