# Sourced by install_check.sh and packages_check.sh: builds tests/install/consumer, an engine's
# worker, out of kvd's tree.
#   consumer_cmake BUILD_DIR PREFIX OUT_DIR LOG    with find_package(kvd) from PREFIX
#   consumer_pkg_config BUILD_DIR PC_DIR OUT_FILE LOG   with pkg-config --static kvd-client
# Both use the compiler and linker flags BUILD_DIR was built with: an engine links kvd's static
# libraries with the flags they were compiled with (the sanitizer pass instruments them).

consumer_flags() {  # BUILD_DIR KEY: a flags entry of BUILD_DIR's CMake cache
  sed -n "s/^$2:STRING=//p" "$1/CMakeCache.txt"
}

consumer_cmake() {
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S "$(dirname "${BASH_SOURCE[0]}")/consumer" -B "$3" "${gen[@]}" -DCMAKE_PREFIX_PATH="$2" \
    "-DCMAKE_CXX_FLAGS=$(consumer_flags "$1" CMAKE_CXX_FLAGS)" \
    "-DCMAKE_EXE_LINKER_FLAGS=$(consumer_flags "$1" CMAKE_EXE_LINKER_FLAGS)" >"$4" 2>&1 &&
    cmake --build "$3" >>"$4" 2>&1
}

consumer_pkg_config() {
  local flags
  flags=$(PKG_CONFIG_PATH="$2" pkg-config --cflags --libs --static kvd-client) || return 1
  # shellcheck disable=SC2046,SC2086
  ${CXX:-g++} -std=c++20 $(consumer_flags "$1" CMAKE_CXX_FLAGS) -o "$3" \
    "$(dirname "${BASH_SOURCE[0]}")/consumer/consumer_worker.cc" $flags $(consumer_flags "$1" CMAKE_EXE_LINKER_FLAGS) >"$4" 2>&1
}
