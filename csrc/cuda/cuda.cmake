# The CUDA kernels (csrc/cuda), built into the extension when MLX is a CUDA
# build (MLX_GATED_DELTA_CUDA; included by the top-level CMakeLists.txt, in
# whose directory the generated source must be made). nvcc compiles each
# .cu to a fatbin of device code only; the fatbins are embedded in a generated
# source and loaded through the CUDA driver (module.cpp), so the extension
# links no CUDA library. nvcc comes from CUDA_HOME, else NVIDIA's
# nvidia-cuda-nvcc wheel (the build requirement that pyproject.toml's CUDA
# override adds where CUDA_HOME is unset, docs/cuda.md), /usr/local/cuda or
# PATH, in that order (find_program's HINTS come before PATH).

set(GD_CUDA_DIR "${PROJECT_SOURCE_DIR}/csrc/cuda")
set(GD_CUDA_BINARY_DIR "${CMAKE_BINARY_DIR}/cuda")
file(MAKE_DIRECTORY "${GD_CUDA_BINARY_DIR}")

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import importlib.util, os; s = importlib.util.find_spec('nvidia'); print(os.path.join(s.submodule_search_locations[0], 'cu13', 'bin') if s else '')"
  OUTPUT_VARIABLE GD_PIP_CUDA_BIN OUTPUT_STRIP_TRAILING_WHITESPACE)
find_program(
  GD_NVCC nvcc REQUIRED
  HINTS "$ENV{CUDA_HOME}/bin" "${GD_PIP_CUDA_BIN}" /usr/local/cuda/bin)
get_filename_component(GD_CUDA_BIN "${GD_NVCC}" DIRECTORY)
get_filename_component(GD_CUDA_INCLUDE "${GD_CUDA_BIN}/../include" ABSOLUTE)
message(STATUS "mlx_gated_delta: CUDA kernels with ${GD_NVCC}")

# The architectures the fatbin carries: machine code for each, no PTX.
set(MLX_GATED_DELTA_CUDA_ARCHS "90" CACHE STRING "CUDA architectures of the kernels")

# The sanitizer probe (tools/cuda/sanitize.sh): one barrier of chunk_carry left
# out and recurrent_backward's per-token sums in one shared buffer, races that
# racecheck must report. Never for use.
option(MLX_GATED_DELTA_CUDA_PROBE "Build the kernels with the sanitizer's planted races" OFF)
set(GD_NVCC_DEFINES)
if(MLX_GATED_DELTA_CUDA_PROBE)
  set(GD_NVCC_DEFINES -DGD_SANITIZER_PROBE)
endif()

set(GD_CUDA_SOURCES
  recurrent
  chunk_prepare
  chunk_carry
  chunk_output
  recurrent_backward
  chunk_backward
  chunk_qk_backward
  chunk_wy_backward
  channel_pairs_backward
  segment)
set(GD_FATBINS)
foreach(source ${GD_CUDA_SOURCES})
  set(gencode)
  foreach(arch ${MLX_GATED_DELTA_CUDA_ARCHS})
    list(APPEND gencode "-gencode=arch=compute_${arch},code=sm_${arch}")
  endforeach()
  set(fatbin "${GD_CUDA_BINARY_DIR}/${source}.fatbin")
  add_custom_command(
    OUTPUT "${fatbin}"
    COMMAND "${GD_NVCC}" -fatbin -std=c++17 -O3 ${gencode} -Werror all-warnings
            ${GD_NVCC_DEFINES} -I "${PROJECT_SOURCE_DIR}/csrc" -o "${fatbin}"
            "${GD_CUDA_DIR}/${source}.cu"
    DEPENDS "${GD_CUDA_DIR}/${source}.cu"
            "${GD_CUDA_DIR}/chunk_backward_products.cuh"
            "${GD_CUDA_DIR}/chunked_common.cuh"
            "${GD_CUDA_DIR}/device_common.cuh"
            "${GD_CUDA_DIR}/kernel_args.h"
            "${GD_CUDA_DIR}/launch_shapes.h"
            "${GD_CUDA_DIR}/tensor_core.cuh"
    COMMENT "nvcc ${source}.cu"
    VERBATIM)
  list(APPEND GD_FATBINS "${fatbin}")
endforeach()

set(GD_EMBEDDED "${GD_CUDA_BINARY_DIR}/cuda_fatbins.cpp")
add_custom_command(
  OUTPUT "${GD_EMBEDDED}"
  COMMAND "${Python_EXECUTABLE}" "${GD_CUDA_DIR}/embed_fatbin.py"
          "${GD_EMBEDDED}" ${GD_FATBINS}
  DEPENDS ${GD_FATBINS} "${GD_CUDA_DIR}/embed_fatbin.py"
  VERBATIM)

target_sources(
  ${EXT_MODULE}
  PRIVATE "${GD_CUDA_DIR}/executor.cpp" "${GD_CUDA_DIR}/executor_backward.cpp"
          "${GD_CUDA_DIR}/launch.cpp" "${GD_CUDA_DIR}/module.cpp" "${GD_EMBEDDED}")
target_compile_definitions(${EXT_MODULE} PRIVATE MLX_GATED_DELTA_CUDA)
# cuda.h and cuda_runtime.h for MLX's CUDA backend headers; fmt for the few
# messages those headers format (compat/fmt/format.h).
target_include_directories(
  ${EXT_MODULE} PRIVATE "${GD_CUDA_INCLUDE}" "${GD_CUDA_DIR}/compat")
target_link_libraries(${EXT_MODULE} PRIVATE ${CMAKE_DL_LIBS})
