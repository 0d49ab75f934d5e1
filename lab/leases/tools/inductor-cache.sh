# Sourced by device-bench.sh and device-counters.sh: one Inductor cache for both, so that on a warm lease a
# counters pass finds the kernels an earlier bench (or pass) compiled and tuned, and Triton's tuned block
# sizes (`*.best_config`, one small file a kernel) travel between leases as $OUT/autotune.tgz.
#   BENCH_CACHE: the cache folder (runs/inductor); AUTOTUNE_IN: block sizes carried in (runs/autotune.tgz).
cache=${BENCH_CACHE:-runs/inductor}
carried=${AUTOTUNE_IN:-runs/autotune.tgz}
mkdir -p "$cache"
cache=$(cd "$cache" && pwd)
export TORCHINDUCTOR_CACHE_DIR=$cache

autotune_in() {
  [ -f "$carried" ] || return 0
  tar -xzf "$carried" -C "$cache" || return 2
  echo "$1: $(tar -tzf "$carried" | grep -c '\.best_config$') tuned kernels carried in"
}

autotune_out() {  # OUT_DIR: every block size tuned so far, packed atomically
  (cd "$cache" && find . -name '*.best_config' -print0 | tar -czf "$1/.autotune.tgz" --null -T -) \
    && mv "$1/.autotune.tgz" "$1/autotune.tgz"
}
