"""The worker's gRPC service: the Execute stream and its threads, registration with a scheduler, metrics."""
