# Installation and the package files (docs/packaging.md), all in one place: the shared library
# and its SONAME link, the public headers, the CLI and the server when built, a CMake package
# (certkvConfig.cmake, certkvConfigVersion.cmake, certkvTargets.cmake: imported targets
# certkv::certkv and, with the CUDA backend, certkv::cuda) and a pkg-config file, certkv.pc.
# Every path in the package is relative to the install prefix, so an installed tree can be moved.
include(CMakePackageConfigHelpers)

set(CERTKV_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/certkv" CACHE STRING
    "Where certkvConfig.cmake goes, relative to the install prefix")
set(CERTKV_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_LIBDIR}/pkgconfig" CACHE STRING
    "Where certkv.pc goes, relative to the install prefix")

set(_certkv_exported certkv)
if(TARGET certkv_cuda)
  list(APPEND _certkv_exported certkv_cuda)
endif()
install(TARGETS ${_certkv_exported} EXPORT certkvTargets LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/certkv DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h" PATTERN "*.hpp")

# The CLI and the server find the library beside their own folder: bin/../lib.
if(CERTKV_BUILD_TOOLS)
  file(RELATIVE_PATH _certkv_bin_to_lib "/${CMAKE_INSTALL_BINDIR}" "/${CMAKE_INSTALL_LIBDIR}")
  set_target_properties(certkv_cli certkv_serve PROPERTIES INSTALL_RPATH "$ORIGIN/${_certkv_bin_to_lib}")
  install(TARGETS certkv_cli certkv_serve RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

install(EXPORT certkvTargets NAMESPACE certkv:: DESTINATION ${CERTKV_INSTALL_CMAKEDIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/certkvConfig.cmake.in
  ${PROJECT_BINARY_DIR}/certkvConfig.cmake INSTALL_DESTINATION ${CERTKV_INSTALL_CMAKEDIR})
# While the major version is 0, a minor version may break the ABI (the SONAME is libcertkv.so.0.1):
# only the same major.minor is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/certkvConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/certkvConfig.cmake ${PROJECT_BINARY_DIR}/certkvConfigVersion.cmake
  DESTINATION ${CERTKV_INSTALL_CMAKEDIR})

# pkg-config: the prefix from the .pc file's own folder (${pcfiledir}), as pkgconf and
# pkg-config both define it.
foreach(_dir CMAKE_INSTALL_LIBDIR CMAKE_INSTALL_INCLUDEDIR CERTKV_INSTALL_PKGCONFIGDIR)
  if(IS_ABSOLUTE "${${_dir}}")
    message(FATAL_ERROR "certkv: ${_dir} (${${_dir}}) must be relative to the install prefix "
                        "(the package is relocatable)")
  endif()
endforeach()
file(RELATIVE_PATH CERTKV_PC_TO_PREFIX "/${CERTKV_INSTALL_PKGCONFIGDIR}" "/")
string(REGEX REPLACE "/$" "" CERTKV_PC_TO_PREFIX "${CERTKV_PC_TO_PREFIX}")
configure_file(${CMAKE_CURRENT_LIST_DIR}/certkv.pc.in ${PROJECT_BINARY_DIR}/certkv.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/certkv.pc DESTINATION ${CERTKV_INSTALL_PKGCONFIGDIR})
