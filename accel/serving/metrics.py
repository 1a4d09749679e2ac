"""``GET /metrics`` of ``accel serve``: the engine's metrics and the server's counters in the
Prometheus text format."""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["SERVER_HELP", "prometheus_text"]


# engine.metrics() key -> (Prometheus name, type, help)
_ENGINE_METRICS = {
    "requests_total": ("accel_requests_total", "counter", "Requests the engine has admitted."),
    "requests_running": ("accel_requests_running", "gauge", "Requests decoding now."),
    "requests_waiting": ("accel_requests_waiting", "gauge", "Requests waiting for a batch row."),
    "tokens_generated": ("accel_tokens_generated_total", "counter", "Tokens the engine has emitted."),
    "verify_steps": ("accel_verify_steps_total", "counter", "Verify forward passes."),
    "mean_accepted": ("accel_mean_accepted_tokens", "gauge", "Tokens emitted per verify step, bonus token included."),
    "batch_occupancy": ("accel_batch_occupancy", "gauge", "Live rows per verify step over max_batch."),
    "kv_bytes": ("accel_kv_bytes", "gauge", "Bytes held by the shared KV cache now."),
    "accepted_tokens": ("accel_accepted_draft_tokens_total", "counter", "Draft tokens accepted (bonus tokens excluded)."),
    "batch_rows_stepped": ("accel_batch_rows_stepped_total", "counter", "Rows summed over verify steps."),
    "max_batch": ("accel_max_batch", "gauge", "Rows the engine decodes together at most."),
    "prefills": ("accel_prefills_total", "counter", "Prefill forwards admitting waiting requests."),
    "prefill_seconds": ("accel_prefill_seconds_total", "counter", "Seconds the engine spent admitting requests."),
    "step_seconds": ("accel_step_seconds_total", "counter", "Seconds the engine spent in verify steps."),
    "prefix_hits": ("accel_prefix_hits_total", "counter", "Prompts that reused an earlier prompt's entries."),
    "prefix_tokens_reused": ("accel_prefix_tokens_reused_total", "counter",
                             "Prompt tokens not prefilled: their entries came from an earlier prompt."),
    "prefix_cache_bytes": ("accel_prefix_cache_bytes", "gauge", "Bytes of prompt entries kept for reuse."),
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def prometheus_text(engine_metrics: dict[str, Any], server: dict[str, Counter]) -> str:
    """The Prometheus text exposition of the engine's metrics and the server's counters.

    server: metric name -> Counter of label tuples ``((label, value), ...)`` -> count.
    """
    lines: list[str] = []
    for key, value in engine_metrics.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        name, kind, help_ = _ENGINE_METRICS.get(key, (f"accel_{key}", "gauge", f"engine metric {key}"))
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(value):g}"]
    for name, counts in server.items():
        help_ = SERVER_HELP.get(name, name)
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
        if not counts and name in _UNLABELLED:
            lines.append(f"{name} 0")
        for labels, count in sorted(counts.items()):
            text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels)
            lines.append(f"{name}{{{text}}} {count}" if text else f"{name} {count}")
    return "\n".join(lines) + "\n"


_UNLABELLED = {"accel_http_prompt_tokens_total", "accel_http_completion_tokens_total", "accel_http_cancelled_total"}
SERVER_HELP = {
    "accel_http_requests_total": "HTTP requests answered, by path and status code.",
    "accel_http_finished_total": "Completions finished, by finish reason.",
    "accel_http_prompt_tokens_total": "Prompt tokens of completed requests.",
    "accel_http_completion_tokens_total": "Completion tokens sent to clients.",
    "accel_http_cancelled_total": "Requests the server cancelled unfinished: the client went away, or generation failed.",
}
