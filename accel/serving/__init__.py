"""Serving: the continuous-batching :class:`~accel.Engine` (:mod:`.service`), the
OpenAI-compatible HTTP server ``accel serve`` (the command :mod:`.serve`, the FastAPI app
:mod:`.app`, its wire format :mod:`.protocol` and Prometheus metrics :mod:`.metrics`) and the
prompt-prefix store that lets requests reuse each other's KV entries (:mod:`.prefix`)."""
