"""This host's GPUs through NVML: which GPUs, their facts, and the sampler
thread that reads them while training runs. Framework-free."""
