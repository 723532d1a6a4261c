"""The bundled reference PD engine: real torch model, real processes, real sockets."""
