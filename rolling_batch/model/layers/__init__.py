"""Building blocks of the native models. Parallel layers shard their own weights: each layer's
`weight_loader` receives the full checkpoint tensor and keeps this rank's part."""
