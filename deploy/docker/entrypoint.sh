#!/usr/bin/env bash
# Entry point of the chattts-triton image: checks the model repository, optionally re-configures its instance
# groups, fences the admin APIs, then execs the command (tritonserver ...) as PID 1 so SIGTERM reaches it.
#
# Environment:
#   CHATTTS_GPUS / CHATTTS_INSTANCES   set either to run `make configure` (chattts_triton.repo_config) on a
#                                      writable copy of the repository first: CHATTTS_GPUS=0,1 CHATTTS_INSTANCES=2
#                                      (CHATTTS_GPUS empty: CPU). The copy lives in CHATTTS_WORK_REPOSITORY.
#   CHATTTS_CONFIGURE_ARGS             more repo_config flags, e.g. "--max-queue-size 128 --gpt-slots 64"
#   CHATTTS_RESTRICT_APIS=0            do not fence the admin APIs (default: fenced)
#   TRITON_ADMIN_KEY                   header value that unlocks the fenced APIs (default: random, i.e. nobody);
#                                      the header is `triton-admin-key`
set -euo pipefail

die() { echo "chattts-triton: $*" >&2; exit 64; }

if [ "${1:-}" != "tritonserver" ]; then
    exec "$@"  # a shell, python3 -m ..., configure-repository.sh: run as given
fi

repo=""
for arg in "$@"; do
    case "$arg" in
        --model-repository=*) repo="${arg#--model-repository=}" ;;
        --model-repository|--model-store) die "write --model-repository=PATH as one argument" ;;
    esac
done
[ -n "$repo" ] || die "tritonserver needs --model-repository=PATH"
if [ ! -f "$repo/manifest.json" ]; then
    die "no exported repository at $repo (manifest.json missing): mount one (docker run -v \$PWD/build/repo:$repo:ro ...) \
or bake one in (docker build --build-context model_repository=build/repo ...); export it with \`make export\`"
fi

if [ -n "${CHATTTS_GPUS+x}" ] || [ -n "${CHATTTS_INSTANCES+x}" ]; then
    work="${CHATTTS_WORK_REPOSITORY:-/tmp/chattts-repository}"
    "$(dirname "$(readlink -f "$0")")/configure-repository.sh" "$repo" "$work"
    args=()
    for arg in "$@"; do
        case "$arg" in
            --model-repository=*) args+=("--model-repository=$work") ;;
            *) args+=("$arg") ;;
        esac
    done
    set -- "${args[@]}"
fi

# The 2025 python-backend exploit chain went through the shared-memory registration API; nothing here needs
# it, nor model loading, tracing or log control: fence them behind a header nobody has unless configured.
if [ "${CHATTTS_RESTRICT_APIS:-1}" != "0" ]; then
    key="${TRITON_ADMIN_KEY:-$(python3 -c 'import secrets; print(secrets.token_hex(24))')}"
    fenced="shared-memory,model-repository,trace,logging"
    set -- "$@" "--http-restricted-api=${fenced}:triton-admin-key=${key}" \
        "--grpc-restricted-protocol=${fenced}:triton-admin-key=${key}"
fi

exec "$@"
