"""Summarize perf_analyzer profile exports as one table row per experiment (one concurrency level).

    python client/perf/report.py PROFILE.json [PROFILE.json ...]

An export lists, per experiment, every measured request with its send time, the arrival time of each of
its responses and each response's outputs. From those:
- requests/s and output tokens/s are counted over the experiment's measurement windows;
- time to first response is the first response's arrival minus the send time; request latency is the
  last response's arrival minus the send time;
- output tokens are the model's own `num_output_tokens` on the final response (the input data must send
  `return_num_output_tokens`), so nothing is re-tokenized.
Only the standard library is used, so the script runs wherever the export lands.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass

NS_PER_S = 1e9
NS_PER_MS = 1e6
COLUMNS = ("concurrency", "requests", "requests/s", "output tokens/s", "TTFR p50 ms", "TTFR p99 ms",
           "latency p50 ms", "latency p99 ms")


@dataclass(frozen=True)
class ExperimentSummary:
    concurrency: int
    num_requests: int
    requests_per_s: float
    output_tokens_per_s: float
    ttfr_p50_ms: float  # time to first response
    ttfr_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float

    def row(self) -> list[str]:
        return [str(self.concurrency), str(self.num_requests), f"{self.requests_per_s:.2f}",
                f"{self.output_tokens_per_s:.1f}", f"{self.ttfr_p50_ms:.1f}", f"{self.ttfr_p99_ms:.1f}",
                f"{self.latency_p50_ms:.1f}", f"{self.latency_p99_ms:.1f}"]


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile: the smallest value with at least p% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def output_tokens(request: dict) -> int:
    """The model's `num_output_tokens` on the request's final response."""
    outputs = request["response_outputs"]
    if not outputs or "num_output_tokens" not in outputs[-1]:
        raise ValueError("the profile has no num_output_tokens output: send return_num_output_tokens=true "
                         "in the perf_analyzer input data")
    return int(outputs[-1]["num_output_tokens"])


def summarize(experiment: dict) -> ExperimentSummary:
    requests = experiment["requests"]
    if not requests or any(not request["response_timestamps"] for request in requests):
        raise ValueError(f"experiment {experiment['experiment']} has a request without responses")
    boundaries = experiment["window_boundaries"]
    duration_s = (boundaries[-1] - boundaries[0]) / NS_PER_S
    ttfr_ms = [(r["response_timestamps"][0] - r["timestamp"]) / NS_PER_MS for r in requests]
    latency_ms = [(r["response_timestamps"][-1] - r["timestamp"]) / NS_PER_MS for r in requests]
    return ExperimentSummary(
        concurrency=int(experiment["experiment"]["value"]),
        num_requests=len(requests),
        requests_per_s=len(requests) / duration_s,
        output_tokens_per_s=sum(map(output_tokens, requests)) / duration_s,
        ttfr_p50_ms=percentile(ttfr_ms, 50), ttfr_p99_ms=percentile(ttfr_ms, 99),
        latency_p50_ms=percentile(latency_ms, 50), latency_p99_ms=percentile(latency_ms, 99),
    )


def load_summaries(paths: list[str]) -> list[ExperimentSummary]:
    summaries = []
    for path in paths:
        with open(path) as export:
            summaries += [summarize(experiment) for experiment in json.load(export)["experiments"]]
    return sorted(summaries, key=lambda summary: summary.concurrency)


def format_table(summaries: list[ExperimentSummary]) -> str:
    rows = [list(COLUMNS)] + [summary.row() for summary in summaries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print(format_table(load_summaries(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
