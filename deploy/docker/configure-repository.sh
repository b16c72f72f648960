#!/usr/bin/env bash
# configure-repository.sh SRC DST: a writable view of the exported repository SRC at DST with its instance
# groups set for this machine, i.e. `make configure` where the repository itself is read-only (baked into the
# image, a read-only volume). Weights are not copied: every file is a symlink into SRC except the files
# repo_config rewrites (manifest.json, */config.pbtxt). SRC must stay mounted at the same path.
#
# Environment: CHATTTS_GPUS (comma-separated ids; empty or unset: CPU), CHATTTS_INSTANCES (default 1),
# CHATTTS_CONFIGURE_ARGS (more `python -m chattts_triton.repo_config` flags), PYTHON (default python3).
set -euo pipefail

die() { echo "configure-repository: $*" >&2; exit 64; }

[ $# -eq 2 ] || die "usage: configure-repository.sh SRC DST"
[ -d "$1" ] || die "$1 is not a directory"
src="$(cd "$1" && pwd -P)"
dst="$2"
[ -f "$src/manifest.json" ] || die "$src has no manifest.json: not an exported repository (make export)"
case "$(cd "$(dirname "$dst")" 2>/dev/null && pwd -P)/$(basename "$dst")" in
    "$src"|"$src"/*) die "DST must lie outside SRC" ;;
esac

rm -rf "$dst"
mkdir -p "$dst"
cp -rs "$src/." "$dst/"
for f in "$dst/manifest.json" "$dst"/*/config.pbtxt; do
    if [ -L "$f" ]; then
        cp --remove-destination "$(readlink "$f")" "$f"
        chmod u+w "$f"
    fi
done

# Word splitting of CHATTTS_CONFIGURE_ARGS is wanted: it holds flags.
# shellcheck disable=SC2086
"${PYTHON:-python3}" -m chattts_triton.repo_config --repo "$dst" \
    --gpus "${CHATTTS_GPUS:-}" --instances "${CHATTTS_INSTANCES:-1}" ${CHATTTS_CONFIGURE_ARGS:-}
