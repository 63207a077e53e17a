"""fragments' counters on vLLM's /metrics (the OpenAI server's API process; docs/vllm.md, "The OpenAI server").

prometheus_client's default registry is the one vLLM's /metrics serves (one API server process), so these
appear beside vLLM's own `vllm:` series:
  fragments:requests_with_plan_total{route}  requests whose plan passed the checks and went to the engine
  fragments:plans_refused_total{reason}      plans answered 400 before the engine saw them
  fragments:saves_returned_bytes_total       bytes of saves (safetensors) returned to clients
  fragments:saves_dropped_total{reason}      requests whose saves the workers dropped or truncated
                                             (_saves.py's reasons: expired, store_full, too_many_requests,
                                             request_cap, disconnected)
  fragments:saves_held_bytes, fragments:saves_held_requests   what rank 0's store holds now
  fragments:worker_live_plans, fragments:worker_hooks         the most over ranks: plans of running
                                             requests and hooks placed for them (0 when nothing runs)
The worker-side series are read from the workers (collective_rpc "fragments_saves" "stats") when /metrics
is scraped, at most once a second.
"""
from __future__ import annotations

import time
from typing import Optional

_metrics: Optional["Metrics"] = None


class Metrics:
    def __init__(self):
        from prometheus_client import Counter, Gauge
        self.plans = Counter("fragments:requests_with_plan", "Requests whose fragments plan passed the server's "
                             "checks and went to the engine", ["route"])
        self.refused = Counter("fragments:plans_refused", "fragments plans refused (HTTP 400) before the engine "
                               "saw them", ["reason"])
        self.returned = Counter("fragments:saves_returned_bytes", "Bytes of fragments saves returned to clients")
        self.dropped = Counter("fragments:saves_dropped", "Requests whose fragments saves the workers dropped or "
                               "truncated", ["reason"])
        self.held_bytes = Gauge("fragments:saves_held_bytes", "Bytes of fragments saves rank 0 holds for callers")
        self.held_requests = Gauge("fragments:saves_held_requests", "Requests whose fragments saves rank 0 holds")
        self.live_plans = Gauge("fragments:worker_live_plans", "fragments plans of running requests (most over "
                                "ranks)")
        self.hooks = Gauge("fragments:worker_hooks", "Hooks fragments placed for running plans (most over ranks)")
        self._seen_dropped: dict = {}
        self._refreshed = 0.0

    def refused_for(self, reason: str) -> None:
        self.refused.labels(reason=reason).inc()

    def update_from_workers(self, answers) -> None:
        """The workers' "stats" answers (one per rank) into the gauges and the dropped counter (by the
        increase since the last look: the workers count from their start)."""
        answers = [a for a in answers or () if a]
        if not answers:
            return
        first = next((a for a in answers if a.get("rank") == 0), answers[0])
        # every pipeline stage's tensor-parallel rank 0 holds its own stage's tensors: the bytes add up
        self.held_bytes.set(sum(a["bytes"] for a in answers if a.get("rank") == 0) or first["bytes"])
        self.held_requests.set(first["requests"])
        self.live_plans.set(max(a["plans"] for a in answers))
        self.hooks.set(max(a["hooks"] for a in answers))
        for reason, count in first["dropped"].items():
            new = count - self._seen_dropped.get(reason, 0)
            if new > 0:
                self.dropped.labels(reason=reason).inc(new)
            self._seen_dropped[reason] = count

    def due(self) -> bool:
        """At most one look at the workers a second (a scrape costs the engine one RPC between steps)."""
        now = time.monotonic()
        if now - self._refreshed < 1.0:
            return False
        self._refreshed = now
        return True


def metrics() -> Metrics:
    """The one set of series of this process (prometheus_client refuses to register a name twice)."""
    global _metrics
    if _metrics is None:
        _metrics = Metrics()
    return _metrics
