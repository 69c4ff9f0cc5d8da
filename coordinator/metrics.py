"""Prometheus metrics of one coordinator, in a registry of its own (tests run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """Every counter, gauge and histogram the coordinator exports, in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.jobs_submitted = Counter("echo_jobs_submitted_total", "Jobs submitted", registry=r)
        self.leases_issued = Counter("echo_leases_issued_total", "Leases issued", registry=r)
        self.leases_expired = Counter("echo_leases_expired_total", "Leases expired", registry=r)
        self.submissions = Counter(
            "echo_submissions_total",
            "Rollout group submissions by outcome",
            ["result", "reason"],
            registry=r,
        )
        self.rollout_tokens = Counter(
            "echo_rollout_tokens_total", "Tokens in accepted rollouts", registry=r
        )
        self.verify_seconds = Histogram(
            "echo_verify_seconds",
            "Time to verify one submission (steps 1-4)",
            registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 1.0),
        )
        self.scoring_seconds = Histogram(
            "echo_scoring_seconds",
            "Wall time to score one group in its job's sandbox",
            registry=r,
            buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0, 10.0),
        )
        self.scoring_failures = Counter(
            "echo_scoring_failures_total",
            "Completions that scored 0 because their scorer failed, by outcome",
            ["outcome"],
            registry=r,
        )
        self.versions_published = Counter(
            "echo_versions_published_total", "Policy versions published", registry=r
        )
        self.current_version = Gauge(
            "echo_current_version", "Latest policy version", ["job"], registry=r
        )
        self.eval_accuracy = Gauge(
            "echo_job_eval_accuracy", "Held-out greedy accuracy at the last evaluation",
            ["job"], registry=r)
        self.staleness_mean = Gauge(
            "echo_job_trained_staleness", "Mean versions behind of the last batch's groups",
            ["job"], registry=r)
        self.nodes_active = Gauge("echo_nodes_active", "Nodes seen in the last minute", registry=r)
        self.nodes_excluded = Counter("echo_nodes_excluded_total", "Nodes excluded", registry=r)
        self.violations = Counter(
            "echo_transport_violations_total", "Framing violations by peers", ["code"], registry=r
        )
