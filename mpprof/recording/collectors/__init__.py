"""The backend-neutral collectors (`mpprof.backends.collector.Collector`:
the lifecycle every collector implements)."""
