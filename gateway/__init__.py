"""OpenAI-compatible speech gateway (`python -m gateway`): `POST /v1/audio/speech` over HTTP, spoken by the
`chattts` models of a Triton server reached over gRPC. See docs/gateway.md."""
