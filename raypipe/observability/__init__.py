"""What a run shows: Prometheus metrics, MFU, the per-step report and the
per-stage timeline (Chrome trace and Gantt chart)."""
