# shellcheck shell=bash
# Sourced by the ci/ scripts that install things (demo, test, wheels,
# actionlint): where Python packages go (a virtual environment, never the
# system Python), which GPU this machine shows, and apt packages installed
# only when missing, saying which and why.

pz_venv() {  # pz_venv [PYTHON]: PYTHON's own venv if it runs in one, else ${PZ_VENV:-.venv}, made if missing; first on PATH
  local py=${1:-python3} dir want have
  command -v "$py" > /dev/null || { echo "ci: $py not found (Python 3.10 or newer is needed)" >&2; exit 1; }
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || { echo "ci: $py is Python $("$py" -V 2>&1); torch 2.13 needs 3.10 or newer (set PYTHON)" >&2; exit 1; }
  if "$py" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    dir=$("$py" -c 'import sys; print(sys.prefix)')
  else
    dir=${PZ_VENV:-$PWD/.venv}
    if ! "$dir/bin/python" -m pip --version > /dev/null 2>&1; then
      echo "ci: making the virtual environment $dir (PZ_VENV chooses another)" >&2
      "$py" -m venv "$dir" || { echo "ci: $py -m venv failed: install python3-venv (apt) or set PZ_VENV to a venv" >&2; exit 1; }
    fi
    want=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    have=$("$dir/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ "$want" = "$have" ] || { echo "ci: $dir has Python $have, not $py's $want: set PZ_VENV to another folder" >&2; exit 1; }
  fi
  export VIRTUAL_ENV=$dir PATH="$dir/bin:$PATH"
}

pz_gpu() {  # prints nvidia, amd or none: the GPUs this machine shows (not the compilers it has)
  if command -v nvidia-smi > /dev/null && nvidia-smi -L 2> /dev/null | grep -q '^GPU'; then
    echo nvidia
  elif [ -e /dev/kfd ] && { ! command -v rocminfo > /dev/null || rocminfo 2> /dev/null | grep -q 'Name: *gfx'; }; then
    echo amd
  else
    echo none
  fi
}

pz_gpu_archs() {  # the visible GPUs' archs for PZ_ARCHS: "90", "80;90", "gfx942" (empty if unknown)
  case $(pz_gpu) in
    nvidia) nvidia-smi --query-gpu=compute_cap --format=csv,noheader | tr -d '. ' | sort -u | paste -sd';' - ;;
    amd) rocminfo 2> /dev/null | sed -n 's/^ *Name: *\(gfx[0-9a-z]*\) *$/\1/p' | sort -u | paste -sd';' - ;;
  esac
}

pz_torch() {  # pz_torch PYTHON: torch 2.13.0 into PYTHON's environment unless it has torch (the CPU build where no GPU shows)
  local py=$1
  "$py" -c 'import torch' 2> /dev/null && return 0
  case $(pz_gpu) in
    none)  # PyPI's Linux torch is the CUDA build: ~20 NVIDIA packages a CPU machine does not use
      echo "ci: installing torch 2.13.0, the CPU build (no GPU here)" >&2
      # --retries 0: where that index is unreachable (an offline runner with a local wheel), fail over at once.
      "$py" -m pip install -q --retries 0 --timeout 15 torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu ;;
    nvidia)
      echo "ci: installing torch 2.13.0 (the CUDA build, from PyPI)" >&2
      "$py" -m pip install -q torch==2.13.0 ;;
    amd)
      echo "ci: this machine has an AMD GPU: install torch for ROCm into $("$py" -c 'import sys; print(sys.prefix)')" \
        "(pytorch.org gives the command), then run this again" >&2
      exit 1 ;;
  esac
}

pz_build_tools() {  # pz_build_tools [PACKAGE...]: what building portable_zip needs, into the active venv, plus PACKAGEs
  local pkgs=("scikit-build-core>=0.10" "nanobind>=2.0" numpy "$@")
  # CMake 3.24 or newer and ninja from PyPI where the machine lacks them.
  if ! printf '3.24\n%s\n' "$(cmake --version 2> /dev/null | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')" \
       | sort -V -C; then
    pkgs+=("cmake>=3.24")
  fi
  command -v ninja > /dev/null || pkgs+=(ninja)
  python -m pip install -q "${pkgs[@]}"
}

pz_can_apt() { [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; }

pz_apt() {  # pz_apt WHO PACKAGE...: apt-get install PACKAGEs (callers name only what is missing); one update per run
  local who=$1
  shift
  [ $# -gt 0 ] || return 0
  pz_can_apt || { echo "$who: needs the apt packages $*: install them, or run as root where apt-get works" >&2; exit 1; }
  echo "$who: apt-get install $*" >&2
  local wait=(-o DPkg::Lock::Timeout=600)  # another apt run on the machine: wait for it, do not fail
  if [ -z "${PZ_APT_UPDATED:-}" ]; then
    apt-get "${wait[@]}" update -qq > /dev/null
    export PZ_APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get "${wait[@]}" install -y -qq "$@" > /dev/null
}

pz_have_hip_runtime_dev() {  # HIP's headers (Debian's libamdhip64-dev, or a ROCm install)
  [ -f /usr/include/hip/hip_runtime.h ] || compgen -G "/opt/rocm*/include/hip/hip_runtime.h" > /dev/null
}
