# Every call on the GPU machine that carries a part of the GGUF (.gpu/partNN, from prepare.sh) runs this: the part is
# kept in $ROOT/g (outside the repository copy, which the next call lays anew), and once the parts there join into
# the registry's file (its sha256 checked) the GGUF goes into dflash's cache. Called by setup.sh, bench.sh and
# launch.sh too; a call after the join finds the file in place. Exits 2 while parts are missing (0 where there are
# none at all: a CPU check with a tiny target needs no GGUF).
set -uo pipefail
ROOT=${ROOT:-/root}; DFLASH_CACHE=${DFLASH_CACHE:-/root/dcache}
GGUF=$DFLASH_CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
[ -f "$GGUF" ] && { echo "GGUF in place"; exit 0; }
mkdir -p "$ROOT/g"
for part in .gpu/part??; do [ -f "$part" ] && cp "$part" "$ROOT/g/"; done
ls "$ROOT"/g/part?? > /dev/null 2>&1 || { echo "no GGUF part here: nothing to join"; exit 0; }
if cat "$ROOT"/g/part?? | sha256sum | grep -q "$SHA"; then
  mkdir -p "$(dirname "$GGUF")" && cat "$ROOT"/g/part?? > "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF"
  echo "GGUF joined and checked"
else
  echo "GGUF parts here: $(cd "$ROOT/g" && ls part?? | tr '\n' ' ')(not all yet)"
  exit 2
fi
