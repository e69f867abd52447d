# Where this call carries .gpu/part03 (the last part) and the earlier parts wait in $ROOT/g: join the GGUF into
# dflash's cache and check it (bench.sh and launch.sh, whichever call carries the part).
set -uo pipefail
ROOT=${ROOT:-/root}; DFLASH_CACHE=${DFLASH_CACHE:-/root/dcache}
if [ -d "$ROOT/g" ] && [ -f .gpu/part03 ]; then
  mkdir -p "$DFLASH_CACHE/gguf"; cp .gpu/part03 "$ROOT/g/"
  cat "$ROOT"/g/part0? > "$DFLASH_CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
  sha256sum "$DFLASH_CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" \
    | grep -q b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 || { echo "GGUF sha mismatch"; exit 3; }
  echo "GGUF joined and checked"
fi
