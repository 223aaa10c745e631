"""The backend-neutral collectors (see `base.Collector` for their lifecycle)."""
