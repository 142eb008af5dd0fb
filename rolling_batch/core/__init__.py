"""Rank 0's scheduling of the rolling batch: requests, the scheduler, the KV block manager and
prefix cache, n-gram drafts, structured outputs' grammars. Torch-free."""
