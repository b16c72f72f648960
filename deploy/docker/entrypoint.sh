#!/usr/bin/env bash
# Entry point of the chattts-triton image: checks the model repository, optionally re-configures its instance
# groups, then execs the launcher `python3 -m chattts_triton.serve` (drains on SIGTERM, exits 70 when a python
# backend stub dies), so that the launcher itself is the container's main process and receives SIGTERM.
#
# Environment:
#   CHATTTS_GPUS / CHATTTS_INSTANCES   set either to run `make configure` (chattts_triton.repo_config) on a
#                                      writable copy of the repository first: CHATTTS_GPUS=0,1 CHATTTS_INSTANCES=2
#                                      (CHATTTS_GPUS empty: CPU). The copy lives in CHATTTS_WORK_REPOSITORY.
#   CHATTTS_CONFIGURE_ARGS             more repo_config flags, e.g. "--max-queue-size 128 --gpt-slots 64"
#   CHATTTS_ADMIN_KEY                  value of the `chattts-admin-key` header that unlocks the fenced admin APIs
#                                      (default: generated into $CHATTTS_ADMIN_KEY_FILE or ~/.chattts-triton/admin.key);
#                                      TRITON_ADMIN_KEY is accepted as its old name. Passed by environment, never logged.
set -euo pipefail

die() { echo "chattts-triton: $*" >&2; exit 64; }

is_launcher() {  # python3 -m chattts_triton.serve ...
    case "${1:-}" in python|python3|python3.*|*/python|*/python3|*/python3.*) ;; *) return 1 ;; esac
    [ "${2:-}" = "-m" ] && [ "${3:-}" = "chattts_triton.serve" ]
}

if [ "${1:-}" = "tritonserver" ]; then
    die "this image runs tritonserver through its launcher: python3 -m chattts_triton.serve --host=0.0.0.0 \
--repo=PATH ... [-- TRITONSERVER FLAGS] (see the image's CMD); for a bare server use --entrypoint tritonserver"
fi
if ! is_launcher "$@"; then
    exec "$@"  # a shell, configure-repository.sh, another python3 -m ...: run as given
fi

# The launcher's --repo (either form), before any `--` (what follows it goes to tritonserver).
repo=""
next=""
for arg in "${@:4}"; do
    [ "$arg" = "--" ] && break
    if [ -n "$next" ]; then repo="$arg"; next=""; continue; fi
    case "$arg" in
        --repo=*) repo="${arg#--repo=}" ;;
        --repo) next=1 ;;
    esac
done
[ -n "$repo" ] || die "the launcher needs --repo=PATH"
if [ ! -f "$repo/manifest.json" ]; then
    die "no exported repository at $repo (manifest.json missing): mount one (docker run -v \$PWD/build/repo:$repo:ro ...) \
or bake one in (docker build --build-context model_repository=build/repo ...); export it with \`make export\`"
fi

if [ -n "${CHATTTS_GPUS+x}" ] || [ -n "${CHATTTS_INSTANCES+x}" ]; then
    work="${CHATTTS_WORK_REPOSITORY:-/tmp/chattts-repository}"
    "$(dirname "$(readlink -f "$0")")/configure-repository.sh" "$repo" "$work"
    args=()
    next=""
    rest=""
    for arg in "$@"; do
        if [ -n "$rest" ]; then args+=("$arg"); continue; fi
        if [ -n "$next" ]; then args+=("$work"); next=""; continue; fi
        case "$arg" in
            --) rest=1; args+=("$arg") ;;
            --repo=*) args+=("--repo=$work") ;;
            --repo) next=1; args+=("$arg") ;;
            *) args+=("$arg") ;;
        esac
    done
    set -- "${args[@]}"
fi

# The launcher fences the shared-memory, model-repository, trace and logging APIs whenever it binds beyond
# 127.0.0.1 (the 2025 python-backend exploit chain went through shared-memory registration).
if [ -z "${CHATTTS_ADMIN_KEY:-}" ] && [ -n "${TRITON_ADMIN_KEY:-}" ]; then
    export CHATTTS_ADMIN_KEY="$TRITON_ADMIN_KEY"
fi
unset TRITON_ADMIN_KEY
if [ "${CHATTTS_RESTRICT_APIS:-1}" = "0" ]; then
    echo "chattts-triton: CHATTTS_RESTRICT_APIS=0 is ignored: the admin APIs stay fenced on a non-loopback host" >&2
fi

exec "$@"
