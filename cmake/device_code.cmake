# Device code for the kernels in kernels/gpu_kernels.cu, as files the
# package loads at run time: sm_XY.cubin and compute_XY.ptx (NVIDIA),
# amdgcn.hipfb (an AMD code-object bundle). Sets PZ_DEVICE_FILES and
# PZ_BACKEND (the vendors built, ";"-separated, or "cpu").
#
# PZ_BACKEND: cuda, hip, "cuda;hip" (or "cuda,hip", "all"), or cpu; unset:
# every vendor whose compiler is found. PZ_ARCHS sets a single vendor's archs.
#   CUDA: PZ_CUDA_COMPILER=nvcc (the default when nvcc is on PATH) or nvrtc
#     (PyPI's NVRTC, PZ_NVRTC=.../libnvrtc.so.12: ci/nvrtc). One cubin per
#     PZ_CUDA_ARCHS entry, plus PTX for the newest.
#   HIP: PZ_HIP_COMPILER=hipcc (the default when found) or clang (clang-19
#     with -nogpulib). One code-object bundle for PZ_HIP_ARCHS.
# PZ_EMULATE_WAVE64=ON (CUDA only; a test build, never a release): the NVIDIA
#   device code runs AMD's wave64 paths, a wave being two warps in step
#   (include/portable_zip/intrinsics.h; ci/gpu's wave64 stage).

set(PZ_KERNEL_SRC "${CMAKE_CURRENT_SOURCE_DIR}/kernels/gpu_kernels.cu")
file(GLOB PZ_DEVICE_DEPS "${CMAKE_CURRENT_SOURCE_DIR}/include/portable_zip/*.h"
     "${CMAKE_CURRENT_SOURCE_DIR}/kernels/amdgcn_nogpulib.h")
list(APPEND PZ_DEVICE_DEPS "${PZ_KERNEL_SRC}")
set(PZ_DEVICE_DIR "${CMAKE_CURRENT_BINARY_DIR}/device")
file(MAKE_DIRECTORY "${PZ_DEVICE_DIR}")
set(PZ_DEVICE_FILES "")
set(PZ_DEVICE_FLAGS -O3 -std=c++17 "-I${CMAKE_CURRENT_SOURCE_DIR}/include" "-I${CMAKE_CURRENT_SOURCE_DIR}/kernels")

macro(pz_setting name default)
  if(NOT ${name})
    if(DEFINED ENV{${name}} AND NOT "$ENV{${name}}" STREQUAL "")
      set(${name} "$ENV{${name}}")
    else()
      set(${name} "${default}")
    endif()
  endif()
  string(REPLACE "," ";" ${name} "${${name}}")
endmacro()

find_program(PZ_NVCC nvcc HINTS /usr/local/cuda/bin)
find_program(PZ_HIPCC hipcc HINTS /opt/rocm/bin)
find_program(PZ_CLANG NAMES clang-19 clang HINTS /usr/lib/llvm-19/bin)
pz_setting(PZ_NVRTC "")
pz_setting(PZ_BACKEND "")
if(PZ_BACKEND STREQUAL "" OR PZ_BACKEND STREQUAL "auto")
  set(PZ_BACKEND "")
  if(PZ_NVCC OR PZ_NVRTC)
    list(APPEND PZ_BACKEND cuda)
  endif()
  if(PZ_HIPCC)
    list(APPEND PZ_BACKEND hip)
  endif()
  if(NOT PZ_BACKEND)
    set(PZ_BACKEND cpu)
  endif()
elseif(PZ_BACKEND STREQUAL "all")
  set(PZ_BACKEND cuda hip)
endif()
foreach(b ${PZ_BACKEND})
  if(NOT b MATCHES "^(cuda|hip|cpu)$")
    message(FATAL_ERROR "PZ_BACKEND entries must be cuda, hip or cpu (got '${b}')")
  endif()
endforeach()
list(LENGTH PZ_BACKEND pz_nvendors)
if(pz_nvendors EQUAL 1 AND NOT PZ_BACKEND STREQUAL "cpu")
  pz_setting(PZ_ARCHS "")
  if(PZ_BACKEND STREQUAL "cuda" AND PZ_ARCHS)
    set(PZ_CUDA_ARCHS "${PZ_ARCHS}")
  elseif(PZ_BACKEND STREQUAL "hip" AND PZ_ARCHS)
    set(PZ_HIP_ARCHS "${PZ_ARCHS}")
  endif()
endif()

pz_setting(PZ_EMULATE_WAVE64 OFF)
if(PZ_EMULATE_WAVE64)
  if(NOT PZ_BACKEND STREQUAL "cuda")
    message(FATAL_ERROR "PZ_EMULATE_WAVE64 needs PZ_BACKEND=cuda (it emulates wave64 on NVIDIA GPUs; got '${PZ_BACKEND}')")
  endif()
  message(WARNING "portable_zip: PZ_EMULATE_WAVE64: wave64 emulation device code, for tests only (slower)")
endif()

# --- NVIDIA -----------------------------------------------------------------
if("cuda" IN_LIST PZ_BACKEND)
  pz_setting(PZ_CUDA_ARCHS "80;90;100")
  set(pz_cuda_flags ${PZ_DEVICE_FLAGS})
  set(pz_nvrtc_defs "")
  if(PZ_EMULATE_WAVE64)
    list(APPEND pz_cuda_flags -DPZ_EMULATE_WAVE64=1)
    set(pz_nvrtc_defs -D PZ_EMULATE_WAVE64=1)
  endif()
  if(PZ_NVCC)
    pz_setting(PZ_CUDA_COMPILER nvcc)
  else()
    pz_setting(PZ_CUDA_COMPILER nvrtc)
  endif()
  list(SORT PZ_CUDA_ARCHS COMPARE NATURAL)
  list(GET PZ_CUDA_ARCHS -1 pz_newest)
  if(PZ_CUDA_COMPILER STREQUAL "nvcc")
    if(NOT PZ_NVCC)
      message(FATAL_ERROR "PZ_CUDA_COMPILER=nvcc but nvcc is not on PATH")
    endif()
    # The newest arch's cubin comes from its PTX (ptxas alone, the same
    # bytes as from the source): one front-end pass fewer.
    set(ptx "${PZ_DEVICE_DIR}/compute_${pz_newest}.ptx")
    add_custom_command(OUTPUT "${ptx}"
      COMMAND "${PZ_NVCC}" ${pz_cuda_flags} -ptx -arch=compute_${pz_newest} "${PZ_KERNEL_SRC}" -o "${ptx}"
      DEPENDS ${PZ_DEVICE_DEPS} COMMENT "nvcc: compute_${pz_newest} PTX" VERBATIM)
    list(APPEND PZ_DEVICE_FILES "${ptx}")
    foreach(sm ${PZ_CUDA_ARCHS})
      set(out "${PZ_DEVICE_DIR}/sm_${sm}.cubin")
      if(sm STREQUAL pz_newest)
        add_custom_command(OUTPUT "${out}" COMMAND "${PZ_NVCC}" -cubin -arch=sm_${sm} "${ptx}" -o "${out}"
          DEPENDS "${ptx}" COMMENT "nvcc: sm_${sm} cubin from PTX" VERBATIM)
      else()
        add_custom_command(OUTPUT "${out}"
          COMMAND "${PZ_NVCC}" ${pz_cuda_flags} -cubin -gencode arch=compute_${sm},code=sm_${sm} "${PZ_KERNEL_SRC}" -o "${out}"
          DEPENDS ${PZ_DEVICE_DEPS} COMMENT "nvcc: sm_${sm} cubin" VERBATIM)
      endif()
      list(APPEND PZ_DEVICE_FILES "${out}")
    endforeach()
  elseif(PZ_CUDA_COMPILER STREQUAL "nvrtc")
    # NVRTC (PyPI's nvidia-cuda-nvrtc-cu12: ci/nvrtc) is nvcc's front end as
    # a library: a cubin per arch and the newest arch's PTX, no toolkit needed.
    if(NOT EXISTS "${PZ_NVRTC}")
      message(FATAL_ERROR "PZ_CUDA_COMPILER=nvrtc needs PZ_NVRTC, the path of libnvrtc.so.12 (bash ci/nvrtc DIR prints one)")
    endif()
    # The newest arch's compile writes its PTX too: one pass fewer.
    foreach(sm ${PZ_CUDA_ARCHS})
      set(out "${PZ_DEVICE_DIR}/sm_${sm}.cubin")
      set(ptx_args "")
      set(outs "${out}")
      if(sm STREQUAL pz_newest)
        set(ptx_args --ptx "${PZ_DEVICE_DIR}/compute_${sm}.ptx")
        list(APPEND outs "${PZ_DEVICE_DIR}/compute_${sm}.ptx")
      endif()
      add_custom_command(OUTPUT ${outs}
        COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_SOURCE_DIR}/cmake/nvrtc_compile.py" --nvrtc "${PZ_NVRTC}"
                --arch sm_${sm} ${ptx_args} ${pz_nvrtc_defs} -I "${CMAKE_CURRENT_SOURCE_DIR}/include" -I "${CMAKE_CURRENT_SOURCE_DIR}/kernels"
                -I "${CMAKE_CURRENT_SOURCE_DIR}/kernels/nvrtc" "${PZ_KERNEL_SRC}" -o "${out}"
        DEPENDS ${PZ_DEVICE_DEPS} "${CMAKE_CURRENT_SOURCE_DIR}/cmake/nvrtc_compile.py" COMMENT "nvrtc: sm_${sm}" VERBATIM)
      list(APPEND PZ_DEVICE_FILES ${outs})
    endforeach()
  else()
    message(FATAL_ERROR "PZ_CUDA_COMPILER must be nvcc or nvrtc (got '${PZ_CUDA_COMPILER}')")
  endif()
  message(STATUS "portable_zip NVIDIA device code: ${PZ_CUDA_COMPILER}, sm ${PZ_CUDA_ARCHS}")
endif()

# --- AMD --------------------------------------------------------------------
if("hip" IN_LIST PZ_BACKEND)
  if(PZ_HIPCC)
    pz_setting(PZ_HIP_COMPILER hipcc)
  else()
    pz_setting(PZ_HIP_COMPILER clang)
  endif()
  set(out "${PZ_DEVICE_DIR}/amdgcn.hipfb")
  if(PZ_HIP_COMPILER STREQUAL "hipcc")
    pz_setting(PZ_HIP_ARCHS "gfx90a;gfx940;gfx1030")  # what ROCm 5.2's device libraries know
    set(pz_offload "")
    foreach(a ${PZ_HIP_ARCHS})
      list(APPEND pz_offload "--offload-arch=${a}")
    endforeach()
    add_custom_command(OUTPUT "${out}"
      COMMAND ${CMAKE_COMMAND} -E env HIP_PLATFORM=amd "${PZ_HIPCC}" -x hip -c --cuda-device-only --gpu-bundle-output ${pz_offload}
              ${PZ_DEVICE_FLAGS} -Wno-unused-command-line-argument "${PZ_KERNEL_SRC}" -o "${out}"
      DEPENDS ${PZ_DEVICE_DEPS} COMMENT "hipcc: ${PZ_HIP_ARCHS}" VERBATIM)
  elseif(PZ_HIP_COMPILER STREQUAL "clang")
    # One code object per target, then one bundle. -nogpulib: no ROCm device
    # library is linked (amdgcn_nogpulib.h stands in). Generic targets need
    # code object v6 (ROCm >= 6.2 loads them); the rest use clang's v5.
    pz_setting(PZ_HIP_ARCHS "gfx90a;gfx942;gfx1030;gfx1100;gfx1201;gfx9-generic;gfx10-3-generic;gfx11-generic;gfx12-generic")
    find_program(PZ_BUNDLER NAMES clang-offload-bundler-19 clang-offload-bundler HINTS /usr/lib/llvm-19/bin)
    if(NOT PZ_CLANG OR NOT PZ_BUNDLER)
      message(FATAL_ERROR "PZ_HIP_COMPILER=clang needs clang-19, lld-19 and clang-offload-bundler (apt: clang-19 lld-19)")
    endif()
    set(pz_objects "")
    set(pz_targets "host-x86_64-unknown-linux-gnu")
    set(pz_inputs "-input=/dev/null")
    foreach(a ${PZ_HIP_ARCHS})
      set(obj "${CMAKE_CURRENT_BINARY_DIR}/amdgcn/${a}.co")
      set(cov "")
      if(a MATCHES "generic$")
        set(cov -mcode-object-version=6)
      endif()
      add_custom_command(OUTPUT "${obj}"
        COMMAND "${PZ_CLANG}" -x hip --offload-arch=${a} ${cov} --cuda-device-only --no-gpu-bundle-output -nogpulib
                -fuse-ld=lld -D__HIP_PLATFORM_AMD__ ${PZ_DEVICE_FLAGS}
                -include "${CMAKE_CURRENT_SOURCE_DIR}/kernels/amdgcn_nogpulib.h" "${PZ_KERNEL_SRC}" -o "${obj}"
        DEPENDS ${PZ_DEVICE_DEPS} COMMENT "clang: ${a} code object" VERBATIM)
      list(APPEND pz_objects "${obj}")
      list(APPEND pz_targets "hipv4-amdgcn-amd-amdhsa--${a}")
      list(APPEND pz_inputs "-input=${obj}")
    endforeach()
    file(MAKE_DIRECTORY "${CMAKE_CURRENT_BINARY_DIR}/amdgcn")
    string(REPLACE ";" "," pz_targets "${pz_targets}")
    add_custom_command(OUTPUT "${out}"
      COMMAND "${PZ_BUNDLER}" -type=o "-targets=${pz_targets}" ${pz_inputs} "-output=${out}"
      DEPENDS ${pz_objects} COMMENT "bundling ${PZ_HIP_ARCHS}" VERBATIM)
  else()
    message(FATAL_ERROR "PZ_HIP_COMPILER must be hipcc or clang (got '${PZ_HIP_COMPILER}')")
  endif()
  list(APPEND PZ_DEVICE_FILES "${out}")
  message(STATUS "portable_zip AMD device code: ${PZ_HIP_COMPILER}, ${PZ_HIP_ARCHS}")
endif()

if(PZ_DEVICE_FILES)
  add_custom_target(device_code ALL DEPENDS ${PZ_DEVICE_FILES})
endif()
# A CPU-only build on a machine with a GPU is almost always a missing compiler.
if(PZ_BACKEND STREQUAL "cpu" AND (EXISTS /dev/nvidiactl OR EXISTS /dev/kfd))
  message(WARNING "portable_zip: building with NO GPU code on a machine with a GPU (no nvcc, hipcc or "
                  "PZ_NVRTC found). GPU tensors will raise. Install the prebuilt wheel, or set PZ_BACKEND.")
endif()
message(STATUS "portable_zip device code: ${PZ_BACKEND}")
