"""Tools for a host without a package index: `python -m tools.bundle` packs wheels and tritonserver,
`bash tools/gpu_session.sh` runs a device session from it (docs/gpu-host.md)."""
