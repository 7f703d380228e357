# Sourced by the A/B scripts (scripts/ab-fp8.sh, scripts/ab-layer.sh): their arguments, progress notes and the
# two builds they time against each other.
#   ab_init NAME BASE_COMMIT OUTDIR [ROUNDS]  sets base, out (absolute), rounds (default 3); note() prints progress
#   ab_base_tree                              sets base_tree and base_build: a worktree of the base commit (removed
#                                             on exit) and its build dir; base "-": this tree, build-ab-base
#   ab_build SRC DIR TARGETS [CMAKE_ARGS...]  configures SRC into DIR afresh (an earlier run's options must not
#                                             stay in the cache) and builds TARGETS (one word, space-separated)
ab_init() {
  ab_name=$1
  local usage="usage: scripts/$ab_name.sh BASE_COMMIT OUTDIR [ROUNDS]"
  base=${2:?$usage}
  out=${3:?$usage}
  rounds=${4:-3}
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  export PATH=/usr/local/cuda/bin:$PATH
  ab_start=$(date +%s)
  ab_gtest=()
  [ -f .deps/googletest/CMakeLists.txt ] && ab_gtest=(-DMEGAMOE_GTEST_SOURCE="$PWD/.deps/googletest")
}

note() { printf '[%s %4ss] %s\n' "$ab_name" "$(( $(date +%s) - ab_start ))" "$*"; }

ab_base_tree() {
  if [ "$base" = - ]; then
    base_tree=$PWD
    base_build=$PWD/build-ab-base
    return
  fi
  base_tree=$(mktemp -d "/tmp/$ab_name-base.XXXXXX")
  base_build=$base_tree/build
  git worktree add -f --detach "$base_tree" "$base" >"$out/worktree.log" 2>&1 || { echo "no commit $base"; exit 2; }
  trap 'git worktree remove --force "$base_tree" >/dev/null 2>&1' EXIT
}

ab_build() {
  local src=$1 dir=$2 targets=$3
  shift 3
  rm -f "$dir/CMakeCache.txt"
  # shellcheck disable=SC2086  # the targets are one word on purpose
  cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_WERROR=OFF -DMEGAMOE_BUILD_TESTS=OFF \
    "${ab_gtest[@]}" "$@" >"$dir.log" 2>&1 && cmake --build "$dir" -j "$(nproc)" --target $targets >>"$dir.log" 2>&1
}
