"""Serving: the continuous-batching :class:`~accel.Engine` (:mod:`.service`), the
OpenAI-compatible HTTP server ``accel serve`` (:mod:`.serve`) and the prompt-prefix store
that lets requests reuse each other's KV entries (:mod:`.prefix`)."""
