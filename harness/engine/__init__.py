"""The bundled reference PD engine: real torch model, real processes, real sockets."""

# the one default model preset of serve, up, the router, the workers and the shipped clusters
DEFAULT_PRESET = "tiny"
