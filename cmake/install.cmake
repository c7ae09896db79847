# `cmake --install BUILD [--prefix P]`: what an operator and an engine developer install.
#   bin/kvd, bin/kvdctl, bin/kvd_example_worker           the daemon, its admin CLI, a worker
#   lib/systemd/system/kvd.service                        the unit, ExecStart naming P/bin/kvd
#   share/doc/kvd/kvd.example.yaml                        the example config (the unit reads
#                                                         /etc/kvd/kvd.yaml: copy it there)
#   lib/libkvd_{client,proto,gpu,vocab}.a                 the worker library, static
#   include/kvd/{client,gpu,proto/vocab}/*.h              its public headers
#   lib/cmake/kvd/                                        find_package(kvd) -> kvd::client
#   lib/pkgconfig/kvd-client.pc                           pkg-config --static kvd-client
# tests/install/install_check.sh builds a worker out of tree against each and runs it.
include(CMakePackageConfigHelpers)

install(TARGETS kvd kvdctl kvd_example_worker RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# Exported as kvd::client, kvd::proto, kvd::gpu, kvd::vocab; engines link kvd::client.
foreach(lib client proto gpu vocab)
  set_target_properties(kvd_${lib} PROPERTIES EXPORT_NAME ${lib})
endforeach()
install(TARGETS kvd_client kvd_proto kvd_gpu kvd_vocab EXPORT kvdTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
# The closure of client/client.h's includes inside the repository (and the default target).
foreach(header client/client.h client/kv_request.h client/step.h gpu/slab_layout.h proto/vocab/block_key.h
               proto/vocab/cache_event.h proto/vocab/cache_types.h proto/vocab/kv_format.h
               proto/vocab/pool_geometry.h proto/vocab/pressure_level.h proto/vocab/types.h
               proto/vocab/default_paths.h)
  get_filename_component(dir ${header} DIRECTORY)
  install(FILES ${PROJECT_SOURCE_DIR}/${header} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvd/${dir})
endforeach()

set(KVD_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvd)
install(EXPORT kvdTargets NAMESPACE kvd:: DESTINATION ${KVD_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/kvdConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/kvdConfig.cmake INSTALL_DESTINATION ${KVD_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/kvdConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/kvdConfig.cmake ${PROJECT_BINARY_DIR}/kvdConfigVersion.cmake
        DESTINATION ${KVD_CMAKE_DIR})
# pkg-config and the unit name the prefix given at install time (--prefix), not at configure time.
if(KVD_HAVE_CUDA)
  get_filename_component(KVD_CUDA_LIBDIR "${CUDA_cudart_static_LIBRARY}" DIRECTORY)
  set(KVD_PC_CUDA_LIBS "-L${KVD_CUDA_LIBDIR} -lcudart_static -ldl -lrt")
else()
  set(KVD_PC_CUDA_LIBS "")
endif()
set(KVD_PC_PREFIX "@KVD_INSTALL_PREFIX@")
configure_file(${PROJECT_SOURCE_DIR}/cmake/kvd.pc.in ${PROJECT_BINARY_DIR}/kvd-client.pc.in @ONLY)
install(CODE "
  set(KVD_INSTALL_PREFIX \"\${CMAKE_INSTALL_PREFIX}\")
  configure_file(\"${PROJECT_BINARY_DIR}/kvd-client.pc.in\" \"${PROJECT_BINARY_DIR}/kvd-client.pc\" @ONLY)
  file(READ \"${PROJECT_SOURCE_DIR}/deploy/systemd/kvd.service\" unit)
  string(REPLACE \"/usr/local/bin/kvd \" \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_BINDIR}/kvd \" unit \"\${unit}\")
  file(WRITE \"${PROJECT_BINARY_DIR}/kvd.service\" \"\${unit}\")
")
install(FILES ${PROJECT_BINARY_DIR}/kvd-client.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
install(FILES ${PROJECT_BINARY_DIR}/kvd.service DESTINATION lib/systemd/system)
install(FILES ${PROJECT_SOURCE_DIR}/deploy/kvd.example.yaml DESTINATION ${CMAKE_INSTALL_DOCDIR})
