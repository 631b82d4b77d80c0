"""Parallelism: FSDP2 sharding over a device mesh, balanced sequence packing (Karmarkar-Karp)."""
