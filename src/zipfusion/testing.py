"""Helpers for tests and benchmarks that drive an engine step by step (nothing in the engine
calls this module)."""

from __future__ import annotations


def run_to_completion(engine, reqs=(), keep_logits: bool = False) -> None:
    """Step ``engine`` until it has no work. With ``keep_logits``, each request of ``reqs`` gets
    ``logits``: the rows its tokens were sampled from, on the CPU (one per generated token)."""
    want = {r.request_id: r for r in reqs} if keep_logits else {}
    for r in want.values():
        r.logits = []
    while engine.has_work():
        res = engine.step()
        if want and res.logits is not None:
            rows = res.logits.detach().cpu()
            for r, row in zip(res.sampled, rows):
                if r.request_id in want:
                    want[r.request_id].logits.append(row.clone())
