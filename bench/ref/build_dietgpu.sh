#!/usr/bin/env bash
# Builds DietGPU (facebookresearch/dietgpu a4d70a14) for side-by-side
# measurement against a new CMake and CUDA 13, with changes to its build
# files only: CUDAToolkit instead of FindCUDA, sm_90, C++17, torch linked into
# libdietgpu.so, glog without gflags, no test binaries. Its sources are not
# changed and none of them enter portable_zip.
#   bash bench/ref/build_dietgpu.sh SRC GLOG_SRC BUILD_DIR   -> BUILD_DIR/lib/libdietgpu.so
set -euo pipefail
src=$1 glog=$2 build=$3
work=$build/src
rm -rf "$work" && mkdir -p "$work" && cp -r "$src"/. "$work"/
rm -rf "$work/third_party/glog" && cp -r "$glog" "$work/third_party/glog"
python3 - "$work" <<'PY'
import pathlib, re, sys
root = pathlib.Path(sys.argv[1])
top = root / "CMakeLists.txt"
s = top.read_text()
s = s.replace("set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)")
s = re.sub(r"if\(NOT DEFINED CMAKE_CUDA_STANDARD\).*?endif\(\)", "set(CMAKE_CUDA_STANDARD 17)", s, flags=re.S)
s = re.sub(r"find_package\(CUDA REQUIRED\).*?\nendif\(\)\n",
           "find_package(CUDAToolkit REQUIRED)\nset(CMAKE_CUDA_ARCHITECTURES 90)\n"
           "set_property(GLOBAL PROPERTY CUDA_ARCHITECTURES 90)\n", s, flags=re.S)
s = s.replace("add_subdirectory(third_party/googletest)\n", "")
top.write_text(s)
for sub in ("ans", "float"):
    p = root / "dietgpu" / sub / "CMakeLists.txt"
    t = p.read_text()
    t = t[: t.index("enable_testing()")]
    name = "gpu_ans" if sub == "ans" else "gpu_float_compress"
    t += f'set_target_properties({name} PROPERTIES CUDA_ARCHITECTURES "90")\n'
    p.write_text(t)
u = root / "dietgpu" / "utils" / "CMakeLists.txt"
t = u.read_text().replace('"${CUDA_INCLUDE_DIRS}"', "").replace("${CUDA_LIBRARIES}", "CUDA::cudart")
u.write_text(t)
d = root / "dietgpu" / "CMakeLists.txt"
t = d.read_text().replace("target_link_libraries(dietgpu PRIVATE\n", "target_link_libraries(dietgpu PRIVATE\n  ${TORCH_LIBRARIES}\n")
d.write_text(t)
PY
torch_dir=$(python3 -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'share/cmake/Torch'))")
cmake -S "$work" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
  -DWITH_GFLAGS=OFF -DWITH_GTEST=OFF -DBUILD_TESTING=OFF -DTorch_DIR="$torch_dir" -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
cmake --build "$build" --target dietgpu -j "$(nproc)"
ls -la "$build"/lib/libdietgpu.so
